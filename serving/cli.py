"""``python -m serving serve | generate | loadgen | profile``: flags are parsed only here."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import pathlib
import re
import ssl
import sys
import time

from serving.options import KV_CACHE_DTYPES


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Each option's help ends with its default, unless it has none (None,
  False) or the help already says what it is."""

  def _get_help_string(self, action):
    text = action.help or ""
    if (action.default is None or action.default is False or action.default is argparse.SUPPRESS
        or "default" in text.lower()):
      return text
    return super()._get_help_string(action)


_DESCRIPTION = """\
Serve a language model over gRPC (and OpenAI-compatible HTTP), and talk to it.

  python -m serving serve --model default --http-port 8000   # start a server
  python -m serving generate "The capital of France is"      # ask it, from another shell

Each command's own --help lists its options and their defaults."""

# The commands: name -> the line `python -m serving --help` shows for it.
COMMANDS = {
    "serve": "run the server: a model behind gRPC (and OpenAI-compatible HTTP with --http-port)",
    "generate": "send a prompt to a running server and stream its completion to the terminal",
    "loadgen": "load a running server with many requests; report time to first token, "
               "inter-token latency and throughput",
    "profile": "time each layer and op of a model on the device, with tensor-core and "
               "memory-bandwidth use",
}


def _client_args(p):
  p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
  p.add_argument("--token", default=os.environ.get("MOSAIC_SERVING_TOKEN"),
                 help="bearer token (default $MOSAIC_SERVING_TOKEN)")
  p.add_argument("--tls-ca", type=pathlib.Path, help="CA certificate (PEM) to verify the server")
  p.add_argument("--tls-server-name", help="expected server name in its certificate")


def _client(a):
  from serving.client import Client

  if a.tls_server_name and not a.tls_ca:
    raise SystemExit(f"{a.cmd}: --tls-server-name checks the server's certificate against "
                     "--tls-ca: give both")
  try:
    ca = a.tls_ca.read_bytes() if a.tls_ca else None
  except OSError as e:
    raise SystemExit(f"{a.cmd}: --tls-ca {a.tls_ca}: {e.strerror}") from None
  return Client(a.target, token=a.token, tls_ca=ca, tls_server_name=a.tls_server_name)


_SPECULATION_FLAGS = ("prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch",
                      "speculative_patience")


# EngineConfig fields whose serve flag is not --<field with dashes>.
_FLAG_OF = {"prefix_caching": "--no-prefix-cache", "warmup": "--no-warmup",
            "scheduling": "--scheduling-policy", "prompt_logprobs": "--enable-prompt-logprobs",
            "token_budget": "--max-num-batched-tokens", "min_chunk": "--prefill-chunk"}


def _as_flags(message: str) -> str:
  """An EngineConfig error with its fields named as the serve flags that set them."""
  def flag(m):
    name = _FLAG_OF.get(m.group(1), "--" + m.group(1).replace("_", "-"))
    return name if m.group(2) in (None, "True") else f"{name} {m.group(2)}"
  return re.sub(r"EngineConfig\.(\w+)(?:=([^\s,;:)]+))?", flag, message)


def _engine_config(a) -> dict:
  from serving import engine as E

  cfg = dict(max_batch=a.max_batch, max_waiting=a.max_waiting, prefill_chunk=a.prefill_chunk,
             prefill_rows=a.prefill_rows, max_seq_len=a.max_seq_len,
             prefix_caching=not a.no_prefix_cache, warmup=not a.no_warmup,
             default_max_tokens=a.default_max_tokens, decode_steps=a.decode_steps,
             stream_interval=a.stream_interval, mixed_steps=a.mixed_steps,
             decode_prefill_budget=a.decode_prefill_budget, prefill_first=a.prefill_first,
             packed_prefill=a.packed_prefill, compile_threads=a.compile_threads,
             scheduling=a.scheduling_policy, prompt_logprobs=a.enable_prompt_logprobs,
             jump_forward=a.jump_forward, num_speculative_tokens=a.num_speculative_tokens)
  for f in _SPECULATION_FLAGS:  # given: EngineConfig's default otherwise
    if getattr(a, f) is not None:
      if not a.num_speculative_tokens:
        raise SystemExit(f"serve: --{f.replace('_', '-')} sets how speculation drafts; it "
                         "needs --num-speculative-tokens")
      cfg[f] = getattr(a, f)
  if a.token_budget is not None:  # 0 is a value to refuse, not "the default"
    cfg["token_budget"] = a.token_budget
  if 1 <= a.prefill_chunk < E.EngineConfig.min_chunk:  # (the smallest chunk bucket)
    cfg["min_chunk"] = a.prefill_chunk
  if a.compile_threads is None:
    cfg["compile_threads"] = E.auto_compile_threads()
  elif a.no_warmup:
    raise SystemExit(f"serve: --compile-threads {a.compile_threads} compiles the warm-up's "
                     "shapes: it does nothing with --no-warmup")
  if a.tensor_parallel_size < 1:
    raise SystemExit(f"serve: --tensor-parallel-size {a.tensor_parallel_size} must be >= 1")
  if a.decode_unroll is not None and a.decode_unroll < 1:
    raise SystemExit(f"serve: --decode-unroll {a.decode_unroll}: layers per iteration must be >= 1")
  try:
    E.EngineConfig(**cfg)  # bad flags fail here, before any model is loaded
  except ValueError as e:
    raise SystemExit(f"serve: {_as_flags(str(e))}") from None
  return cfg


def use_compilation_cache(path: pathlib.Path) -> None:
  """jax's persistent compilation cache in ``path``: a restarted server loads
  the steps its warm-up compiled before instead of compiling them again, and
  gets the same executables, whose kernel choices XLA's autotuner would
  otherwise make afresh in each process. Every compiled function is kept,
  however fast it compiled. jax decides at its first compile whether a cache
  is in use, so this must run before anything is compiled."""
  import jax

  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise SystemExit(f"serve: --compilation-cache {path}: {e}") from None
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def build_engine(a):
  from serving import engine as E

  cfg = _engine_config(a)
  if a.compilation_cache:  # here, so an --engine-process child uses it too
    use_compilation_cache(a.compilation_cache)
  spec = None if a.model in (None, "default") else a.model
  return E.model_engine(spec, dtype=a.dtype, num_pages=a.num_pages,
                        gpu_memory_utilization=a.gpu_memory_utilization, page_size=a.page_size,
                        kv_cache_dtype=KV_CACHE_DTYPES[a.kv_cache_dtype],
                        attention=a.attention_backend,
                        decode_attention=a.decode_attention_backend, matmul=a.matmul_backend,
                        decode_unroll=a.decode_unroll, tp=a.tensor_parallel_size,
                        residual_dtype=a.residual_dtype, quantization=a.quantization,
                        step_delay=a.step_delay, **cfg)


def cmd_serve(a) -> int:
  from serving.service import Server

  tls = None
  if a.tls_cert or a.tls_key:
    if not (a.tls_cert and a.tls_key):
      raise SystemExit("--tls-cert and --tls-key go together")
    try:
      tls = (a.tls_cert.read_bytes(), a.tls_key.read_bytes())
      ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(a.tls_cert, a.tls_key)
    except ssl.SSLError as e:  # (before the model loads; gRPC would blame the port)
      raise SystemExit(f"serve: --tls-cert {a.tls_cert} and --tls-key {a.tls_key} are not a "
                       f"PEM certificate and its key: {e.reason or e}") from None
    except OSError as e:
      raise SystemExit(f"serve: TLS: {e.filename}: {e.strerror}") from None
  if a.engine_process:
    from serving.engine import api
    from serving.engine.process import ProcessEngine

    _engine_config(a)  # bad flags end here, before a process starts
    try:
      engine = ProcessEngine(build_engine, a)
    except api.EngineFailed as e:  # the child's build_engine raised (as below)
      raise SystemExit(f"serve: {e}") from None
  else:
    try:
      engine = build_engine(a)
    except (ValueError, FileNotFoundError) as e:  # a flag the model cannot take, a bad path
      raise SystemExit(f"serve: {e}") from None
  try:
    server = Server(engine, host=a.host, port=a.port, auth_token=a.auth_token, tls=tls,
                    metrics_port=a.metrics_port, http_port=a.http_port)
  except (ValueError, OSError) as e:  # a port out of range or taken: before the warm-up
    engine.stop()
    raise SystemExit(f"serve: {e}") from None
  server.handle_signals(a.drain_timeout)
  server.start()
  print(f"serving {engine.info.model_name} on {server.address}", flush=True)
  if a.ready_file:
    tmp = a.ready_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": server.port, "pid": os.getpid(),
                               "http_port": server.openai_http.server_port
                               if server.openai_http else None,
                               "metrics_port": server.metrics_http.server_port
                               if server.metrics_http else None}))
    tmp.replace(a.ready_file)
  server.wait()
  return 0


def _sampling(a) -> dict:
  kw = {f: getattr(a, f) for f, _ in _SAMPLING_FLAGS if getattr(a, f) is not None}
  if a.stop:
    kw["stop"] = a.stop
  if a.ignore_eos:
    kw["ignore_eos"] = True
  if a.include_stop_str_in_output:
    kw["include_stop_str_in_output"] = True
  if a.logprobs:
    kw["logprobs"] = True
  if a.logit_bias:
    kw["logit_bias"] = dict(a.logit_bias)
  if a.allowed_token_ids:
    kw["allowed_token_ids"] = a.allowed_token_ids
  if a.json_schema is not None:
    kw["structured_outputs"] = {"json": a.json_schema}
  elif a.json_object:
    kw["structured_outputs"] = {"json_object": True}
  elif a.regex is not None:
    kw["structured_outputs"] = {"regex": a.regex}
  elif a.choice:
    kw["structured_outputs"] = {"choice": {"choices": a.choice}}
  elif a.grammar is not None:
    kw["structured_outputs"] = {"grammar": a.grammar}
  return kw


def _text_or_file(text: str) -> str:
  """The argument itself, or the file's text for @path."""
  if not text.startswith("@"):
    return text
  try:
    return pathlib.Path(text[1:]).read_text()
  except OSError as e:
    raise argparse.ArgumentTypeError(f"{text[1:]}: {e.strerror}") from None


def _int_in(lo: int, hi: int | None = None, what: str = "an integer"):
  """An argparse type: an integer in [lo, hi] (hi None: no upper bound)."""
  def parse(text: str) -> int:
    try:
      n = int(text)
    except ValueError:
      n = None
    if n is None or n < lo or (hi is not None and n > hi):
      raise argparse.ArgumentTypeError(
          f"{text!r} is not {what} {f'>= {lo}' if hi is None else f'in {lo}..{hi}'}")
    return n
  return parse


# The request's wire types (generate.proto): the server judges the values,
# these only keep a number from failing to encode.
_INT32 = _int_in(-2**31, 2**31 - 1)
_UINT64 = _int_in(0, 2**64 - 1)
_SAMPLING_HELP = {
    "temperature": "0 (the default) picks the likeliest token; higher samples more freely",
    "top_k": "sample among the k likeliest tokens (default: 0, no cut)",
    "top_p": "sample among the likeliest tokens whose probabilities sum to p (default: 1)",
    "min_p": "drop tokens below min_p times the likeliest one's probability (default: 0)",
    "repetition_penalty": "penalize the tokens of the prompt and text so far; > 1 repeats "
                          "less (default: 1, none)",
    "presence_penalty": "in [-2, 2]: taken off the logits of tokens generated so far "
                        "(default: 0)",
    "frequency_penalty": "in [-2, 2]: times its count, taken off each generated token's "
                         "logit (default: 0)",
    "seed": "makes sampling reproducible (default: none)",
    "max_tokens": "tokens to generate at most (default: the server's --default-max-tokens, "
                  "256 unless set)",
    "min_tokens": "tokens generated before EOS or a stop may end the text (default: 0)",
    "top_logprobs": "with --logprobs, also this many likeliest tokens' logprobs (0-20; default: 0)",
    "n": "completions of the prompt; completion 0 streams, the others print after it "
         "(default: 1)",
    "prompt_logprobs": "print the prompt's logprobs, with this many likeliest tokens each "
                       "(a server with --enable-prompt-logprobs; default: none)",
    "truncate_prompt_tokens": "keep only the prompt's last N tokens (default: the whole "
                              "prompt; a longer one than the context is refused)",
}
_SAMPLING_FLAGS = (("temperature", float), ("top_k", _INT32), ("top_p", float), ("min_p", float),
                   ("repetition_penalty", float), ("presence_penalty", float),
                   ("frequency_penalty", float), ("seed", _UINT64), ("max_tokens", _INT32),
                   ("min_tokens", _INT32), ("top_logprobs", _INT32), ("n", _INT32),
                   ("prompt_logprobs", _INT32), ("truncate_prompt_tokens", _INT32))


def _number(text: str, *, positive: bool) -> float:
  try:
    x = float(text)
  except ValueError:
    x = float("nan")
  if not (x > 0 if positive else x >= 0):  # (NaN fails both)
    raise argparse.ArgumentTypeError(f"{text!r} is not a number {'>' if positive else '>='} 0")
  return x


_positive = functools.partial(_number, positive=True)
_seconds = functools.partial(_number, positive=False)


_port = _int_in(0, 65535, "a port")


def _token_ids(text: str) -> list[int]:
  try:
    return [_INT32(t) for t in text.split(",")]
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ids") from None


def _token_bias(text: str) -> tuple[int, float]:
  tid, sep, bias = text.partition("=")
  try:
    return _INT32(tid), float(bias)
  except (ValueError, argparse.ArgumentTypeError):
    raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN_ID=BIAS") from None


def cmd_generate(a) -> int:
  from serving.proto import generate_pb2 as pb

  with _client(a) as c:
    t0 = time.perf_counter()
    first = None
    n = 0
    final = None
    others: dict[int, list] = {}  # with --n: completions 1.. print after completion 0
    lps = []  # completion 0's token logprobs (--logprobs)
    prompt = a.prompt
    if a.chat or a.system is not None:  # one user turn, after the system message if any
      prompt = ([{"role": "system", "content": a.system}] if a.system is not None else []) + [
          {"role": "user", "content": a.prompt}]
    for chunk in c.stream(prompt, timeout=a.timeout, priority=a.priority, **_sampling(a)):
      if chunk.index:
        others.setdefault(chunk.index, []).append(chunk)
        continue
      if chunk.token_ids and first is None:
        first = time.perf_counter() - t0
      n += len(chunk.token_ids)
      lps += chunk.logprobs
      sys.stdout.write(chunk.text)
      sys.stdout.flush()
      if chunk.HasField("final"):
        final = chunk.final
    total = time.perf_counter() - t0
  print()
  for i, chunks in sorted(others.items()):
    done = chunks[-1].final
    print(f"--- completion {i} ({done.usage.completion_tokens} tokens, "
          f"{pb.FinishReason.Name(done.finish_reason)}) ---")
    print("".join(ch.text for ch in chunks))
  for what, scored in (("prompt logprobs", final.prompt_logprobs if final else ()),
                       ("logprobs", lps)):
    if not scored:
      continue
    print(f"{what} ({len(scored)} tokens, sum {sum(x.logprob for x in scored):.4f}):",
          file=sys.stderr)
    for x in scored:  # token id, its logprob, [the likeliest ids: logprob]
      top = ", ".join(f"{t.token_id}: {t.logprob:.4f}" for t in x.top)
      print(f"  {x.token_id:>8} {x.logprob:10.4f}" + (f"   [{top}]" if top else ""),
            file=sys.stderr)
  if final is not None:
    reason = pb.FinishReason.Name(final.finish_reason)
    which = final.WhichOneof("stop_reason")
    if which:
      reason += f" ({which} {getattr(final, which)!r})"
    per_tok = (total - (first or 0)) / max(n - 1, 1) * 1e3
    print(f"[{n} tokens, {reason}; prompt {final.usage.prompt_tokens} tokens "
          f"({final.usage.cached_prompt_tokens} cached); time to first token "
          f"{(first or 0) * 1e3:.1f} ms, {per_tok:.1f} ms/token after it, total "
          f"{total * 1e3:.0f} ms; server queue {final.timings.queue_s * 1e3:.1f} ms]",
          file=sys.stderr)
  return 0


def cmd_loadgen(a) -> int:
  from serving import loadgen

  with _client(a) as c:
    info = c.model_info()
    r = loadgen.run(c, num_requests=a.num_requests, input_len=a.input_len,
                    output_len=a.output_len, concurrency=a.concurrency, rate=a.rate,
                    vocab=min(info.vocab_size, 256) if a.byte_prompts else info.vocab_size,
                    seed=a.seed, range_ratio=a.range_ratio,
                    shared_prefix_len=a.shared_prefix_len, prefix_groups=a.prefix_groups,
                    structured=({"regex": a.regex} if a.regex is not None else
                                {"json": a.json_schema} if a.json_schema is not None else None))
  print(loadgen.format_report(r))
  if a.json:
    a.json.write_text(json.dumps(r, indent=1))
  return 0 if r["completed"] else 1


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m serving", description=_DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-v", "--verbose", action="store_true",
                 help="log at INFO level (serve always does)")
  sub = p.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")
  p.commands = sub.choices  # name -> the command's parser (main's errors use its usage)

  def command(name):
    return sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name],
                          formatter_class=_HelpFormatter)

  s = command("serve")
  s.add_argument("--model", default="default",
                 help="default (the embedded SmolLM2-135M-Instruct; the default), tiny, toy, "
                      "counting (test models), or a checkpoint path")
  s.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                 help="weights and activations (default: float32 on the CPU, bfloat16 on a GPU)")
  s.add_argument("--quantization", default=None, choices=("fp8",),
                 help="quantize the layers' linear weights at load: fp8 is W8A8 on fp8 tensor "
                 "cores (float8_e4m3fn weights with per-channel scales, activations quantized "
                 "per token at each call; the embedding and lm_head keep --dtype)")
  s.add_argument("--residual-dtype", default=None, choices=("bfloat16", "float16", "float32"),
                 help="the residual stream between layers (default: --dtype); float32 under "
                 "bfloat16 weights keeps the layers' sums in float32 (the norms then run as "
                 "kernels of their own instead of inside the next matmul)")
  s.add_argument("--attention-backend",
                 help="attention implementation (mosaic, mosaic_fp8, cudnn, triton, xla, ...); "
                 "also used for decode where attention_decode has that name, unless "
                 "--decode-attention-backend is given")
  s.add_argument("--decode-attention-backend", help="attention_decode implementation")
  s.add_argument("--matmul-backend", help="matmul implementation (mosaic, xla, ...)")
  s.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                 help="devices the weights and KV cache are split over (Megatron layout: "
                      "heads and MLP features; two all-reduces a layer)")
  s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
  s.add_argument("--port", type=_port, default=50051, help="gRPC port; 0 picks a free port")
  s.add_argument("--max-batch", type=int, default=64,
                 help="requests running at once (more wait for a place)")
  s.add_argument("--max-waiting", type=int, default=256,
                 help="requests waiting for a place; past it, new ones are refused")
  s.add_argument("--num-pages", type=int,
                 help="KV pages (page 0 reserved); default: as many as fit in "
                      "--gpu-memory-utilization of the device's memory beside the weights, "
                      "or 1024 where the device reports no memory (the CPU)")
  s.add_argument("--gpu-memory-utilization", type=float,
                 help="share of the device memory jax may use (its bytes_limit) for the "
                      "weights and the KV cache (default 0.8); sizes the cache, so it is "
                      "refused beside --num-pages; the rest is for activations and compiler "
                      "scratch")
  s.add_argument("--page-size", type=int, help="tokens per KV page (default: the kernel's)")
  s.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                 help="KV cache dtype: auto = the model's; fp8 = float8_e4m3fn, half the "
                      "bytes a page (values stored at scale 1, saturating at +-448)")
  s.add_argument("--max-seq-len", type=int, help="context limit (default: the model's)")
  s.add_argument("--prefill-chunk", type=int, default=512,
                 help="prompt tokens a request prefills per step (longer prompts take several)")
  s.add_argument("--prefill-rows", type=int, default=4,
                 help="prompts prefilled side by side in one step")
  s.add_argument("--max-num-batched-tokens", "--token-budget", dest="token_budget", type=int,
                 help="tokens per step, decodes and prompt chunks together (vLLM's name; "
                      "--token-budget is the same flag); at least --max-batch (default: "
                      "--max-batch + --prefill-chunk)")
  s.add_argument("--default-max-tokens", type=int, default=256,
                 help="tokens generated at most for a request that does not say")
  s.add_argument("--decode-steps", type=int, default=1,
                 help="decode steps per dispatch, sampled on the device, when nothing waits "
                      "for prefill (fewer host round trips; tokens past a request's end are "
                      "dropped)")
  s.add_argument("--decode-unroll", type=int,
                 help="layers per iteration of a one-token decode step's layer loop (default: "
                      "all, no loop: the fastest step, the longest warm-up; 1 compiles fastest)")
  s.add_argument("--stream-interval", type=int, default=1,
                 help="tokens per streamed message after the first (fewer, larger messages "
                      "cost less host time per token with many concurrent streams)")
  s.add_argument("--mixed-steps", action="store_true",
                 help="run a step's decodes and prefill chunks as one device call (one pass "
                      "over the weights; warm-up compiles the mixed shapes too)")
  s.add_argument("--decode-prefill-budget", type=int,
                 help="prompt tokens per step while requests decode (default: what "
                      "--max-num-batched-tokens leaves)")
  s.add_argument("--prefill-first", action="store_true",
                 help="while prompt chunks wait, steps prefill them alone and decoding "
                      "requests wait (more tokens/s for bursts, longer inter-token gaps)")
  s.add_argument("--packed-prefill", action=argparse.BooleanOptionalAction, default=None,
                 help="prefill a step's prompt chunks packed in one row (ragged prompts "
                      "cost their own tokens, not the longest one's chunk bucket each); "
                      "default: packed wherever the attention backend takes segment ids")
  s.add_argument("--compile-threads", type=int,
                 help="threads compiling the warm-up's shapes side by side (1: one at a time; "
                      "default: one per core, up to 8)")
  s.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                 help="priority: requests are admitted by their priority (lower first), then "
                 "arrival, and the least urgent is preempted first")
  s.add_argument("--enable-prompt-logprobs", action="store_true",
                 help="requests may ask for their prompt's logprobs (prompt_logprobs); "
                      "warm-up then also compiles the calls that score a prompt")
  s.add_argument("--jump-forward", action="store_true",
                 help="structured outputs take the tokens their grammar forces without "
                      "sampling them, computed as a prompt chunk (fewer steps)")
  s.add_argument("--num-speculative-tokens", type=int, default=0,
                 help="n-gram (prompt lookup) speculation: draft up to this many tokens per "
                      "step from earlier text and check them in one call (small batches, "
                      "no grammars; 0: off)")
  s.add_argument("--prompt-lookup-max", type=int,
                 help="longest n-gram matched for drafts (default: 3)")
  s.add_argument("--prompt-lookup-min", type=int,
                 help="shortest n-gram matched for drafts (default: 1)")
  s.add_argument("--speculative-max-batch", type=int,
                 help="speculate only while at most this many requests run (default: 4)")
  s.add_argument("--speculative-patience", type=int,
                 help="a request that gains nothing from this many checks in a row stops "
                      "drafting for a while (8 of its tokens, doubling; 0: never) (default: 4)")
  s.add_argument("--engine-process", action="store_true",
                 help="run the engine in a process of its own, so that the gRPC stream "
                      "threads do not share its interpreter (serving.engine.process)")
  s.add_argument("--no-prefix-cache", action="store_true",
                 help="do not reuse the KV pages of a prompt prefix seen before")
  s.add_argument("--no-warmup", action="store_true",
                 help="start at once, without compiling every step shape first: each new "
                      "shape then compiles when a request first needs it")
  s.add_argument("--compilation-cache", type=pathlib.Path,
                 default=os.environ.get("MOSAIC_COMPILATION_CACHE") or None,
                 help="directory of jax's persistent compilation cache: a restart loads the "
                      "compiled steps (and their autotuned kernel choices) instead of compiling")
  s.add_argument("--auth-token", default=os.environ.get("MOSAIC_SERVING_TOKEN"),
                 help="require this bearer token (default $MOSAIC_SERVING_TOKEN)")
  s.add_argument("--tls-cert", type=pathlib.Path, help="serve TLS with this certificate (PEM)")
  s.add_argument("--tls-key", type=pathlib.Path, help="and this private key (PEM)")
  s.add_argument("--metrics-port", type=_port, help="serve Prometheus /metrics on this port")
  s.add_argument("--http-port", type=_port,
                 help="also serve OpenAI-compatible HTTP (/v1/completions, "
                      "/v1/chat/completions, /v1/models) on this port")
  s.add_argument("--drain-timeout", type=_seconds, default=30.0,
                 help="seconds SIGTERM waits for in-flight requests before stopping")
  s.add_argument("--step-delay", type=float, default=0.0,
                 help="counting model only: seconds per step (drain and timeout tests)")
  s.add_argument("--ready-file", type=pathlib.Path,
                 help="write {port, pid} here as JSON once serving")
  s.set_defaults(fn=cmd_serve)

  g = command("generate")
  _client_args(g)
  g.add_argument("prompt", help="the prompt text")
  g.add_argument("--chat", action="store_true",
                 help="send the prompt as a user message, through the model's chat template")
  g.add_argument("--system", help="a system message before it (implies --chat)")
  for f, t in _SAMPLING_FLAGS:
    g.add_argument("--" + f.replace("_", "-"), type=t, help=_SAMPLING_HELP.get(f))
  g.add_argument("--stop", action="append", help="end the text at this string; repeatable")
  g.add_argument("--ignore-eos", action="store_true",
                 help="go on past the end-of-sequence token (until --max-tokens)")
  g.add_argument("--include-stop-str-in-output", action="store_true",
                 help="keep the stop string that ended the text")
  g.add_argument("--logprobs", action="store_true",
                 help="print each generated token's logprob (completion 0's, to stderr)")
  g.add_argument("--allowed-token-ids", type=_token_ids, metavar="ID,ID,...",
                 help="only these token ids may be generated")
  g.add_argument("--logit-bias", action="append", type=_token_bias, metavar="TOKEN_ID=BIAS",
                 help="added to the token's logit, in [-100, 100]; repeatable")
  so = g.add_argument_group("structured outputs (one of)").add_mutually_exclusive_group()
  so.add_argument("--json-schema", type=_text_or_file, metavar="SCHEMA|@FILE",
                  help="the output is JSON matching this JSON schema")
  so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
  so.add_argument("--regex", help="the output matches this regular expression")
  so.add_argument("--choice", action="append", help="the output is one of these; repeatable")
  so.add_argument("--grammar", type=_text_or_file, metavar="LARK|@FILE",
                  help="the output matches this Lark grammar")
  g.add_argument("--timeout", type=float, help="deadline in seconds")
  g.add_argument("--priority", type=_INT32, default=0,
                 help="lower is more urgent (a server with --scheduling-policy priority)")
  g.set_defaults(fn=cmd_generate)

  l = command("loadgen")
  _client_args(l)
  l.add_argument("--concurrency", type=_int_in(1),
                 help="requests kept in flight (default: 1, unless --rate is given)")
  l.add_argument("--rate", type=_positive, help="Poisson arrivals per second")
  l.add_argument("--num-requests", type=_int_in(1), default=64, help="requests sent in all")
  l.add_argument("--input-len", type=_int_in(1), default=512, help="prompt tokens a request")
  l.add_argument("--output-len", type=_int_in(1), default=256,
                 help="tokens generated a request (EOS ignored)")
  l.add_argument("--range-ratio", type=float, default=0.0,
                 help="draw each request's lengths from [L(1-r), L(1+r)] (0: all equal)")
  l.add_argument("--shared-prefix-len", type=_int_in(0), default=0,
                 help="each prompt starts with one of --prefix-groups shared random prefixes "
                 "of this many tokens (a system prompt)")
  l.add_argument("--prefix-groups", type=_int_in(1), default=1,
                 help="distinct shared prefixes (with --shared-prefix-len)")
  l.add_argument("--byte-prompts", action="store_true", help="prompt ids below 256 only")
  lso = l.add_mutually_exclusive_group()
  lso.add_argument("--regex", help="every request's output matches this (structured outputs)")
  lso.add_argument("--json-schema", type=_text_or_file, metavar="SCHEMA|@FILE",
                   help="every request's output is JSON matching this schema")
  l.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
  l.add_argument("--json", type=pathlib.Path, help="write the results here")
  l.set_defaults(fn=cmd_loadgen)

  from serving import profiler  # its flags live with it (also: python -m serving.profiler)

  pr = command("profile")
  profiler.add_arguments(pr)
  pr.set_defaults(fn=profiler.run_cli)
  return p


def main(argv=None) -> int:
  p = parser()
  a = p.parse_args(argv)
  # (the command's own usage line with the error, as argparse gives its own)
  err = p.commands[a.cmd].error
  if a.cmd == "loadgen" and a.json and not a.json.parent.is_dir():  # (before the load, not after)
    err(f"--json {a.json}: {a.json.parent} is not a directory")
  if a.cmd == "loadgen" and not 0.0 <= a.range_ratio < 1.0:
    err(f"--range-ratio must be in [0, 1), got {a.range_ratio}")
  if (a.cmd == "serve" and a.gpu_memory_utilization is not None
      and not 0.0 < a.gpu_memory_utilization <= 1.0):
    err(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
  if a.cmd == "loadgen" and a.concurrency is not None and a.rate is not None:
    err(f"--concurrency {a.concurrency} and --rate {a.rate:g}: give one of them")
  if a.cmd == "loadgen" and a.prefix_groups != 1 and not a.shared_prefix_len:
    err(f"--prefix-groups {a.prefix_groups} needs --shared-prefix-len")
  if a.cmd == "generate" and a.timeout is not None and not a.timeout > 0:
    err(f"--timeout {a.timeout:g}: seconds > 0")
  if a.cmd == "serve" and a.ready_file and not a.ready_file.parent.is_dir():
    err(f"--ready-file {a.ready_file}: {a.ready_file.parent} is not a directory")
  if a.cmd == "generate" and a.top_logprobs and not a.logprobs:
    err(f"--top-logprobs {a.top_logprobs} needs --logprobs")
  if a.cmd == "loadgen" and a.concurrency is None and a.rate is None:
    a.concurrency = 1
  logging.basicConfig(level=logging.INFO if a.verbose or a.cmd == "serve" else logging.WARNING,
                      format="%(asctime)s %(name)s %(levelname)s %(message)s")
  logging.getLogger("jax").setLevel(logging.WARNING)
  if a.cmd not in ("generate", "loadgen"):
    return a.fn(a)
  import grpc

  try:
    return a.fn(a)
  except grpc.RpcError as e:  # the server's answer, or none: one line, not a traceback
    raise SystemExit(f"{a.cmd}: {e.code().name}: {e.details()}") from None
  except KeyboardInterrupt:  # Ctrl-C: the call is cancelled (the server ends it), no traceback
    print(file=sys.stderr)
    return 130
