"""End-to-end serving on the GPU: Llama-3-8B-shaped random bf16 weights.

Builds the engine exactly as `python -m serving serve` does, from the serve
flags it prints and records (``serve_flags``: serving.cli.build_engine over
models.load of config "llama3.1-8b", random weights drawn on the device), and
the gRPC server on loopback in this process; the load generator (`python -m
serving loadgen`) runs in a separate process so that its threads do not share
this process's GIL. It measures:

1. correctness first: a greedy token from the server must be among the 5
   best tokens of the same prompt through the XLA reference backends;
2. TTFT of a 2048-token prompt (concurrency 1, output 1 token);
3. time per output token at concurrency 1 (512 in / 256 out);
4. output tokens/s at concurrency 64 (512 in / 256 out);
5. the engine's host time per step at concurrency 64 (step wall time minus
   the time blocked on the device's results), from the engine's own log;
   steps are pipelined, so host work overlaps the device's next step;
6. where the c=64 run's wall time went: its engine iterations by kind
   (prompt chunks, chunks beside one-step decodes, one-step and multi-step
   decodes) in the summary's ``schedule_c64``, every iteration's record in
   ``steps_c64.json``;
7. with ``--rounds N``, the c=64 load N - 1 more times on the same server
   (``round2_c64``...): a cost that only the first round pays (a first use
   after warm-up) shows as the difference; ``--profile-round K`` traces the
   engine's process (host and device) for the first ``--profile-steps``
   iterations of round K.

``--range-ratio r`` draws each c=1 and c=64 request's prompt and output
lengths from [L(1-r), L(1+r)] (vLLM's --random-range-ratio): ragged prompts
pad the engine's prefill batches, as real traffic does. It also compiles
continued prompt chunks at warm-up, which ragged prompts meet.

Targets (issue 7): TPOT at c=1 <= 4.0 ms, TTFT(2048) <= 60 ms, >= 10,000
output tok/s at c=64, host <= 10% of a step. Anchor: Hugging Face transformers
on the same card, 92 ms/token at c=1, 2,673 tok/s at batch 64.

  PYTHONPATH=. python3 bench/serving_gpu.py --out $OUT [--attention mosaic --matmul mosaic]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
ANCHOR = ROOT.parent / "shared" / "anchors" / "h200-2026-11-30-hf-transformers-e2e.json"
HF_ANCHOR = {"hf_tpot_c1_ms": 92.55, "hf_tok_s_b64": 2673.4}


class IdTokenizer:
  """Token ids as text (one CJK character per id): no tokenizer files needed."""

  bos_id = None
  eos_ids = ()

  def __init__(self, vocab: int):
    self.vocab = vocab

  def encode(self, text):
    return [ord(c) % self.vocab for c in text]

  def decode(self, ids):
    return "".join(chr(0x4E00 + i % 20000) for i in ids)


def random_model(config: str, dtype: str, fold_norms: bool = True,
                 decode_append: bool = True, decode_unroll: int | None = None, tp: int = 1,
                 quantization: str | None = None):
  """models.load's random weights of a named config (random_device_params),
  with the model's layout options, behind an IdTokenizer."""
  import models
  from models import config as config_lib
  from models import model as model_lib

  cfg = config_lib.get(config)
  params = model_lib.random_device_params(cfg, dtype)
  return models.Model(cfg, params, IdTokenizer(cfg.vocab_size), dtype=dtype,
                      fold_norms=fold_norms, decode_append=decode_append,
                      decode_unroll=decode_unroll, mesh=model_lib.tp_mesh(cfg, tp),
                      quantization=quantization)


def flags_model(a):
  """random_model with the model flags of ``model_flags``."""
  return random_model(a.config, a.dtype, a.fold_norms, a.decode_append, a.decode_unroll,
                      a.tp, a.quantization)


def loadgen(target, out, name, **kw):
  path = pathlib.Path(out) / f"loadgen_{name}.json"
  cmd = [sys.executable, "-m", "serving", "loadgen", "--target", target, "--json", str(path)]
  for k, v in kw.items():
    cmd += [f"--{k.replace('_', '-')}", str(v)]
  t0 = time.perf_counter()
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  print(p.stdout, p.stderr[-2000:] if p.returncode else "", flush=True)
  if p.returncode:
    raise RuntimeError(f"loadgen {name} failed ({p.returncode})")
  r = json.loads(path.read_text())
  r["loadgen_wall_s"] = time.perf_counter() - t0
  return r


@contextlib.contextmanager
def profiled(engine, log_dir: pathlib.Path | None, steps: int):
  """Traces the engine's process (its device work included) under ``log_dir``
  for its next ``steps`` iterations, or until the block ends; ``None``: no
  trace. A trace slows the host: a traced round's figures are not headline."""
  if log_dir is None:
    yield
    return
  done = threading.Event()

  def watch():
    while not done.is_set() and len(engine.step_times) < steps:
      time.sleep(0.005)
    engine.stop_profile()

  engine.start_profile(str(log_dir))
  watcher = threading.Thread(target=watch, name="profile-watch", daemon=True)
  watcher.start()
  try:
    yield
  finally:
    done.set()
    watcher.join()
    print(f"trace of up to {steps} iterations in {log_dir}", flush=True)


def host_share(engine, min_decodes):
  """Host time per step (wall minus the time blocked on the device's results).

  Steps are pipelined: the device has the step dispatched before the host
  reads the previous one's tokens, so host time hides behind device time
  while it is shorter; the step wall time is then the device's step time.
  """
  steps = [t for t in engine.step_times if t.decodes >= min_decodes and t.launched]
  if not steps:
    return {}
  host = [t.wall - t.wait for t in steps]
  return {"steps": len(steps),
          "step_ms_p50": statistics.median(t.wall for t in steps) * 1e3,
          "host_ms_p50": statistics.median(host) * 1e3,
          # Of the host time: building inputs and dispatching the jitted calls
          # (XLA runs the step's thunks from this thread), the rest is Python.
          "launch_ms_p50": statistics.median(t.launch for t in steps) * 1e3,
          # and the tokens read back: accepting them, their text and events.
          "tokens_ms_p50": statistics.median(t.tokens for t in steps) * 1e3,
          "host_fraction_p50": statistics.median(h / t.wall for h, t in zip(host, steps))}


def schedule(records) -> dict:
  """Where a load's wall time went, by the kind of iteration: prompt chunks
  alone, prompt chunks with one-step decodes beside them, one-step decodes,
  multi-step decode calls. Per kind: iterations, their summed wall time, the
  decode tokens computed (rows x steps) and the prompt tokens."""
  def kind(t):
    if t.prefill_tokens:
      return "prefill+decode" if t.decodes else "prefill"
    return "decode" if t.steps <= 1 else "decode_multi"

  out = {}
  for t in records:
    if not (t.decodes or t.prefill_tokens):
      continue  # an iteration that only read back the last tokens
    k = out.setdefault(kind(t), {"iterations": 0, "wall_s": 0.0, "decode_tokens": 0,
                                 "prompt_tokens": 0})
    k["iterations"] += 1
    k["wall_s"] += t.wall
    k["decode_tokens"] += t.decodes * t.steps
    k["prompt_tokens"] += t.prefill_tokens
  if records:
    out["span_s"] = records[-1].start + records[-1].wall - records[0].start
    # Iterations that compiled something (none after a full warm-up), and their wall time.
    compiled = [t for t in records if t.compiles]
    out["compiling_iterations"] = len(compiled)
    out["compiling_wall_s"] = sum(t.wall for t in compiled)
  return out


def xla_reference(model, prompt, all_logits: bool = False) -> np.ndarray:
  """XLA's forward (xla backends) of ``prompt`` on the same weights: float32
  logits at the last position [V], or at every position [T, V]."""
  import models
  from serving.engine import default_page_size

  page = default_page_size()  # the result does not depend on the page size
  pages = -(-len(prompt) // page)
  table = np.arange(1, pages + 1, dtype=np.int32)[None]
  cache = model.init_cache(pages + 1, page_size=page)
  logits, _ = models.Model.prefill(model, cache, np.asarray([prompt], np.int32),
                                   np.zeros(1, np.int32), np.array([len(prompt)], np.int32),
                                   table, attention="xla", matmul="xla", all_logits=all_logits)
  return np.asarray(jnp.asarray(logits[0], jnp.float32))


def check_prompt_logprobs(target, ref_logits, prompt, got) -> dict:
  """The served prompt logprobs of ``prompt`` against XLA's forward of the
  same weights over it (``ref_logits`` [T, V], float32, from xla_reference):
  ‖served - ref‖ / ‖ref‖ over the prompt tokens' logprobs, and the same
  greedy token as the unscored request."""
  from serving.client import Client

  with Client(target) as c:
    r = c.generate(prompt, max_tokens=1, prompt_logprobs=5)
  ref = np.asarray(jax.nn.log_softmax(jnp.asarray(ref_logits), axis=-1))
  want = ref[np.arange(len(prompt) - 1), prompt[1:]]
  served = np.array([x.logprob for x in r.prompt_logprobs])
  ids_ok = [x.token_id for x in r.prompt_logprobs] == prompt[1:]
  err = float(np.linalg.norm(served - want) / np.linalg.norm(want)) if ids_ok else float("inf")
  top1 = float(np.mean([x.top[0].token_id == int(np.argmax(ref[i]))
                        for i, x in enumerate(r.prompt_logprobs)])) if ids_ok else 0.0
  ok = ids_ok and np.isfinite(served).all() and err < 2e-2 and r.token_ids[0] == got
  print(f"prompt logprobs: {len(served)} positions, rel. err {err:.2e} against xla, "
        f"top-1 agrees at {top1:.1%}, token {r.token_ids[0]}: {'ok' if ok else 'MISMATCH'}",
        flush=True)
  return {"prompt_logprobs_rel_err": err, "prompt_logprobs_top1_agree": top1,
          "prompt_logprobs_correct": bool(ok)}


def time_scored(target, vocab, n, requests=5) -> float:
  """Median wall time (ms) of a unary call scoring an n-token random prompt
  and generating one token (the time to its first token)."""
  from serving.client import Client

  rng = np.random.default_rng(11)
  times = []
  with Client(target) as c:
    for _ in range(requests):
      prompt = rng.integers(0, vocab, n).tolist()
      t0 = time.perf_counter()
      r = c.generate(prompt, max_tokens=1, prompt_logprobs=5)
      times.append((time.perf_counter() - t0) * 1e3)
      assert len(r.prompt_logprobs) == n - 1
  return float(statistics.median(times))


def roofline_tok_s(config, concurrency: int, input_len: int, output_len: int, *,
                   weight_bytes: int = 2, kv_bytes: int = 2, tp: int = 1,
                   quantization: str | None = None) -> float:
  """Output tokens/s no schedule can beat on this card: mosaic.cost's
  serving step (every request decodes a token a step while the prompts that
  keep the batch full share the pass over the weights) at the target's
  ceilings, over ``tp`` cards. ``quantization="fp8"``: the layers' linears
  are one byte a weight and run at the fp8 peak (lm_head stays as is)."""
  from mosaic import cost

  # An untied embedding table is a gather, not a matmul: only lm_head is read whole.
  matmul_params = config.num_params() - (
      0 if config.tie_embeddings else config.vocab_size * config.hidden_size)
  head = config.vocab_size * config.hidden_size  # lm_head (or the tied embedding's matmul)
  fp8 = matmul_params - head if quantization == "fp8" else 0
  step = cost.serving_step(
      weight_bytes=weight_bytes * (matmul_params - fp8) + fp8, matmul_params=matmul_params,
      fp8_params=fp8,
      kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_bytes,
      attn_flops_per_pair=4 * config.num_layers * config.num_heads * config.head_dim,
      concurrency=concurrency, input_len=input_len, output_len=output_len)
  return concurrency * tp / cost.roofline_seconds(step)


def flags_num_pages(a, model, page: int) -> int:
  """--num-pages, or as serve sizes the cache: what fits in
  --gpu-memory-utilization of the device beside the weights."""
  from serving import engine as E

  n = a.num_pages or E.fit_num_pages(model, page, a.gpu_memory_utilization,
                                     kv_cache_dtype=a.kv_cache_dtype, tp=a.tp)
  print(f"KV cache: {n} pages of {page} tokens", flush=True)
  return n


def serve_flags(a) -> list[str]:
  """The `python -m serving serve` flags of this benchmark's engine: it is
  built by the CLI's own code (serving.cli.build_engine), so a benchmark
  cannot pass where the README's command fails."""
  if not (a.fold_norms and a.decode_append):
    raise SystemExit("--no-fold-norms / --no-decode-append are not serve options; "
                     "bench/model.py measures those layouts")
  cmax, chunk = a.concurrency, a.ttft_len
  flags = ["--model", a.config, "--dtype", a.dtype, "--attention-backend", a.attention,
           "--matmul-backend", a.matmul, "--max-batch", str(cmax), "--max-waiting", "512",
           "--max-seq-len", str(a.max_seq_len), "--prefill-chunk", str(chunk),
           "--prefill-rows", "4", "--token-budget", str(cmax + chunk),
           "--default-max-tokens", str(a.output_len), "--decode-steps", str(a.decode_steps),
           "--stream-interval", str(a.stream_interval),
           "--compile-threads", str(a.compile_threads),
           "--tensor-parallel-size", str(a.tp)]
  for flag, value in (("--decode-attention-backend", a.decode_attention),
                      ("--page-size", a.page_size),
                      ("--num-pages", a.num_pages),
                      # the fraction sizes the cache only without a page count
                      ("--gpu-memory-utilization",
                       None if a.num_pages else a.gpu_memory_utilization),
                      ("--decode-prefill-budget", a.decode_prefill_budget),
                      ("--decode-unroll", a.decode_unroll),
                      ("--compilation-cache", a.compilation_cache),
                      ("--num-speculative-tokens", a.num_speculative_tokens or None)):
    if value is not None:
      flags += [flag, str(value)]
  if a.kv_cache_dtype:
    flags += ["--kv-cache-dtype", "fp8"]
  if a.quantization:
    flags += ["--quantization", a.quantization]
  for flag, on in (("--mixed-steps", a.mixed_steps), ("--prefill-first", a.prefill_first),
                   ("--enable-prompt-logprobs", a.prompt_logprobs)):
    if on:
      flags.append(flag)
  if a.packed_prefill is not None:
    flags.append("--packed-prefill" if a.packed_prefill else "--no-packed-prefill")
  return flags


def build_engine(a):
  """The benchmark's engine, as `python -m serving serve` builds it from
  ``serve_flags(a)`` (module-level, so that an engine process can build it)."""
  from serving import cli

  flags = serve_flags(a)
  print("serve flags:", " ".join(flags), flush=True)
  t0 = time.perf_counter()
  engine = cli.build_engine(cli.parser().parse_args(["serve", *flags]))
  print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
  return engine


def model_flags(ap: argparse.ArgumentParser) -> None:
  """The model and engine flags the serving benchmarks share."""
  ap.add_argument("--config", default="llama3.1-8b")
  ap.add_argument("--attention", default="mosaic")
  ap.add_argument("--matmul", default="mosaic")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--decode-steps", type=int, default=1, help="EngineConfig.decode_steps")
  ap.add_argument("--num-pages", type=int, default=None,
                  help="KV pages (default: as serve, what fits in --gpu-memory-utilization)")
  ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                  help="as serve's flag: the device memory share for weights and KV cache")
  ap.add_argument("--quantization", default=None, choices=(None, "fp8"),
                  help="as serve's flag: fp8 makes the layers' linears W8A8")
  ap.add_argument("--kv-cache-dtype", default=None, choices=(None, "float8_e4m3fn"),
                  help="the KV cache's dtype (default the model's)")
  ap.add_argument("--stream-interval", type=int, default=1, help="EngineConfig.stream_interval")
  ap.add_argument("--mixed-steps", action="store_true", help="EngineConfig.mixed_steps")
  ap.add_argument("--num-speculative-tokens", type=int, default=0,
                  help="EngineConfig.num_speculative_tokens (n-gram speculation)")
  ap.add_argument("--decode-prefill-budget", type=int,
                  help="EngineConfig.decode_prefill_budget (prompt tokens per decoding step)")
  ap.add_argument("--prefill-first", action="store_true", help="EngineConfig.prefill_first")
  ap.add_argument("--packed-prefill", action=argparse.BooleanOptionalAction, default=None,
                  help="EngineConfig.packed_prefill (default: packed where the backend can)")
  ap.add_argument("--compile-threads", type=int,
                  help="EngineConfig.compile_threads (default: one per core, up to 8)")
  ap.add_argument("--prompt-logprobs", action="store_true",
                  help="EngineConfig.prompt_logprobs: also check and time scored prompts")
  ap.add_argument("--tp", type=int, default=1,
                  help="tensor parallelism: devices the weights and KV cache are split over")
  ap.add_argument("--compilation-cache", type=pathlib.Path,
                  help="jax's persistent compilation cache directory (as serve's flag)")
  ap.add_argument("--no-decode-append", dest="decode_append", action="store_false",
                  help="RoPE, the K/V write and decode attention as separate ops "
                       "(models.Model decode_append)")
  ap.add_argument("--decode-unroll", type=int, default=None,
                  help="layers per iteration of the decode step's layer loop "
                       "(models.Model decode_unroll; default all, no loop)")
  ap.add_argument("--no-fold-norms", dest="fold_norms", action="store_false",
                  help="keep the layers' norms as kernels of their own (models.Model fold_norms)")


def apply_model_flags(a) -> None:
  """What the shared flags change in this process (call before compiling)."""
  if a.compilation_cache:
    from serving import cli

    cli.use_compilation_cache(a.compilation_cache)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serving_out"))
  model_flags(ap)
  ap.add_argument("--decode-attention", default=None)
  ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
  ap.add_argument("--ttft-len", type=int, default=2048)
  ap.add_argument("--input-len", type=int, default=512)
  ap.add_argument("--output-len", type=int, default=256)
  ap.add_argument("--concurrency", type=int, default=64)
  ap.add_argument("--requests-per-stream", type=int, default=2,
                  help="requests of the concurrency run per stream: 2 times it in two waves "
                       "(the first prefill overlaps nothing); more approach steady state, "
                       "where streams are out of step and prompts arrive while others decode")
  ap.add_argument("--rounds", type=int, default=1,
                  help="runs of the concurrency load on the same server; the first is the "
                       "headline, later ones show what of it was a one-time cost")
  ap.add_argument("--profile-round", type=int,
                  help="trace the engine's process during this round of the concurrency "
                       "load (1 = the headline round, whose figures the trace then slows)")
  ap.add_argument("--profile-steps", type=int, default=24,
                  help="engine iterations the trace covers from the round's start")
  ap.add_argument("--max-seq-len", type=int, default=4096)
  ap.add_argument("--page-size", type=int, help="default: the decode kernel's")
  ap.add_argument("--range-ratio", type=float, default=0.0,
                  help="c=1 and c=64 lengths drawn from [L(1-r), L(1+r)] (0: all equal)")
  ap.add_argument("--shared-prefix-len", type=int, default=0,
                  help="c=1 and c=64 prompts start with one of --prefix-groups shared random "
                  "prefixes of this many tokens (a system prompt), then --input-len own tokens")
  ap.add_argument("--prefix-groups", type=int, default=1)
  ap.add_argument("--engine-process", action="store_true",
                  help="the engine in a process of its own (serving.engine.process)")
  a = ap.parse_args()
  apply_model_flags(a)
  if a.compile_threads is None:
    from serving.engine.engine import auto_compile_threads

    a.compile_threads = auto_compile_threads()  # resolved here: an engine process gets `a`
  if a.requests_per_stream < 1:
    ap.error(f"--requests-per-stream must be >= 1, got {a.requests_per_stream}")
  if a.rounds < 1:
    ap.error(f"--rounds must be >= 1, got {a.rounds}")
  if a.profile_round is not None and not 1 <= a.profile_round <= a.rounds:
    ap.error(f"--profile-round must be one of the rounds 1..{a.rounds}, got {a.profile_round}")
  if a.profile_steps < 1:
    ap.error(f"--profile-steps must be >= 1, got {a.profile_steps}")
  if not 0.0 <= a.range_ratio < 1.0:
    ap.error(f"--range-ratio must be in [0, 1), got {a.range_ratio}")
  if a.shared_prefix_len < 0 or a.prefix_groups < 1:
    ap.error(f"--shared-prefix-len {a.shared_prefix_len} must be >= 0 and --prefix-groups "
             f"{a.prefix_groups} >= 1")
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)

  from mosaic import bench
  from serving.service import Server

  if a.engine_process:
    # Two processes share the GPU: neither may take most of its memory up front.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    # This process's reference weights must go back to the driver when freed
    # (below): jax's default arena keeps what it frees. The engine process,
    # spawned later, keeps the default allocator.
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
      raise SystemExit("serving_gpu: jax's GPU client started before its allocator was set")
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    jax.devices()  # the client reads the variable here, once
    del os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"]
    from serving.engine.process import ProcessEngine

  # 1. correctness, checked before timing against XLA's forward of the same
  # seeded weights. The reference is computed first: with --engine-process
  # this process draws its own copy of the weights, which must be gone before
  # the engine process starts, as beside `serve`'s server, which holds none:
  # the engine sizes its cache as if alone on the card and grows its arena
  # by regions of tens of GiB in the warm-up (beside the copy it ran out of
  # memory on the H200).
  rng = np.random.default_rng(0)
  n_in = a.input_len
  if a.engine_process:
    engine, model = None, flags_model(a)  # the engine process starts below
  else:
    engine = build_engine(a)
    model = engine.runner.model
  cfg = model.config
  prompt = rng.integers(0, cfg.vocab_size, n_in).tolist()
  ref_logits = xla_reference(model, prompt, all_logits=a.prompt_logprobs)
  ref_last = ref_logits[n_in - 1] if a.prompt_logprobs else ref_logits
  top5 = np.argsort(-ref_last)[:5].tolist()
  del model
  if a.engine_process:
    jax.clear_caches()
    gc.collect()  # the weights' buffers go back to the driver here
    engine = ProcessEngine(build_engine, a)  # its own copy of the (seeded) random model

  page = engine.info.page_size
  cmax, chunk = a.concurrency, a.ttft_len
  t0 = time.perf_counter()
  server = Server(engine, port=0).start()  # warm-up compiles every bucketed shape here
  warm = time.perf_counter() - t0
  print(f"warm-up + start {warm:.1f} s; serving on {server.address}", flush=True)
  target = server.address
  rows, summary = [], {"warmup_s": warm,
                       "serve_command": "python -m serving serve " + " ".join(serve_flags(a)),
                       "config": a.config, "attention": a.attention,
                       "matmul": a.matmul, "page_size": page,
                       "decode_steps": a.decode_steps, "stream_interval": a.stream_interval,
                       "mixed_steps": a.mixed_steps,
                       "decode_prefill_budget": a.decode_prefill_budget,
                       "prefill_first": a.prefill_first, "packed_prefill": a.packed_prefill,
                       "compile_threads": a.compile_threads, "tp": a.tp,
                       "prompt_logprobs": a.prompt_logprobs,
                       "num_speculative_tokens": a.num_speculative_tokens,
                       "profile_round": a.profile_round,
                       "engine_process": a.engine_process, "range_ratio": a.range_ratio,
                       "shared_prefix_len": a.shared_prefix_len, "prefix_groups": a.prefix_groups,
                       "requests_per_stream": a.requests_per_stream}

  from serving.client import Client

  with Client(target) as c:
    got = c.generate(prompt, max_tokens=1).token_ids[0]
  summary["correct"] = bool(got in top5)
  print(f"correctness: server token {got}, xla top-5 {top5}: "
        f"{'ok' if summary['correct'] else 'MISMATCH'}", flush=True)
  if a.prompt_logprobs:
    summary.update(check_prompt_logprobs(target, ref_logits, prompt, got))
    summary["correct"] = summary["correct"] and summary["prompt_logprobs_correct"]
  del ref_logits

  n1, n64 = (2, cmax) if a.quick else (4, a.requests_per_stream * cmax)
  io = dict(input_len=n_in, output_len=a.output_len)
  shape = f"{n_in}/{a.output_len}"
  if a.range_ratio:
    io["range_ratio"] = a.range_ratio
    from serving import loadgen as loadgen_lib  # (this file's loadgen runs its CLI)

    shape += " " + loadgen_lib.spread(a.range_ratio)
  if a.shared_prefix_len:
    io.update(shared_prefix_len=a.shared_prefix_len, prefix_groups=a.prefix_groups)
    shape = f"{a.shared_prefix_len} shared ({a.prefix_groups} groups) + " + shape
  try:
    # Each run draws other prompts (--seed): a prefix-cache hit would time a
    # continued-chunk prefill, which the warm-up does not compile by default.
    r = loadgen(target, out, f"ttft{chunk}", concurrency=1, num_requests=5, input_len=chunk,
                output_len=1, seed=1)
    summary[f"ttft_{chunk}_ms_p50"] = r["ttft_p50_ms"]
    rows.append({"case": f"TTFT, {chunk}-token prompt, c=1", "ours": r["ttft_p50_ms"],
                 "target": 60.0, "anchor_hf": 63.3, "unit": "ms"})

    if a.prompt_logprobs:
      ms = time_scored(target, cfg.vocab_size, chunk)
      summary[f"ttft_{chunk}_scored_ms_p50"] = ms
      rows.append({"case": f"TTFT, {chunk}-token prompt with prompt_logprobs=5, c=1",
                   "ours": ms, "target": "", "anchor_hf": "", "unit": "ms"})

    engine.step_times.clear()
    r = loadgen(target, out, "c1", concurrency=1, num_requests=n1, seed=2, **io)
    summary["tpot_c1_ms_p50"] = r["tpot_p50_ms"]
    summary["host_c1"] = host_share(engine, 1)
    rows.append({"case": f"time per output token, c=1 ({shape})",
                 "ours": r["tpot_p50_ms"],
                 "target": 4.0, "anchor_hf": HF_ANCHOR["hf_tpot_c1_ms"], "unit": "ms"})

    def load_round(i):
      """Round i of the concurrency load: the load generator's report and the
      engine's records of it (also written to steps_c64[_round<i>].json)."""
      name = f"c{cmax}" if i == 1 else f"c{cmax}_round{i}"
      trace = out / f"trace_c{cmax}_round{i}" if a.profile_round == i else None
      engine.step_times.clear()
      with profiled(engine, trace, a.profile_steps):
        r = loadgen(target, out, name, concurrency=cmax, num_requests=n64,
                    seed=3 if i == 1 else 3 + i, **io)  # other prompts each round
      records = list(engine.step_times)
      (out / f"steps_{name}.json").write_text(json.dumps([t._asdict() for t in records]))
      return r, records

    r, records = load_round(1)
    summary[f"tok_s_c{cmax}"] = r["output_tok_s"]
    summary[f"itl_c{cmax}_ms_p50"] = r["itl_p50_ms"]
    summary[f"itl_c{cmax}_ms_p99"] = r["itl_p99_ms"]
    summary[f"ttft_c{cmax}_ms_p50"] = r["ttft_p50_ms"]
    summary[f"cached_prompt_tokens_c{cmax}"] = r["cached_prompt_tokens"]
    rows.append({"case": f"output tok/s, c={cmax} ({shape})",
                 "ours": r["output_tok_s"],
                 "target": 10000.0, "anchor_hf": HF_ANCHOR["hf_tok_s_b64"], "unit": "tok/s"})
    bound = roofline_tok_s(cfg, cmax, n_in, a.output_len, tp=a.tp,
                           kv_bytes=1 if a.kv_cache_dtype else 2, quantization=a.quantization)
    summary[f"roofline_tok_s_c{cmax}"] = bound
    summary[f"roofline_fraction_c{cmax}"] = r["output_tok_s"] / bound
    print(f"c={cmax}: {r['output_tok_s']:.0f} output tok/s = "
          f"{r['output_tok_s'] / bound:.1%} of the roofline's {bound:.0f}", flush=True)
    rows.append({"case": f"fraction of the roofline ({bound:.0f} tok/s), c={cmax}",
                 "ours": r["output_tok_s"] / bound * 100, "target": "", "anchor_hf": "",
                 "unit": "%"})
    # Stalls while prompts enter show as a long inter-token tail (issue bar: p99 <= 2.5x p50).
    rows.append({"case": f"inter-token latency p99 / p50, c={cmax}",
                 "ours": r["itl_p99_ms"] / r["itl_p50_ms"], "target": 2.5, "anchor_hf": "",
                 "unit": "x"})
    summary[f"schedule_c{cmax}"] = schedule(records)
    hs = host_share(engine, max(1, cmax * 3 // 4))
    summary[f"host_c{cmax}"] = hs
    if hs:
      rows.append({"case": f"engine host time / step, c={cmax}",
                   "ours": hs["host_fraction_p50"] * 100, "target": 10.0, "anchor_hf": "",
                   "unit": "%"})
      rows.append({"case": f"engine step, c={cmax} (p50)", "ours": hs["step_ms_p50"],
                   "target": "",
                   "anchor_hf": "", "unit": "ms"})
      rows.append({"case": f"of which launching the device calls, c={cmax} (p50)",
                   "ours": hs["launch_ms_p50"], "target": "", "anchor_hf": "", "unit": "ms"})
      rows.append({"case": f"of which the tokens read back, c={cmax} (p50)",
                   "ours": hs["tokens_ms_p50"], "target": "", "anchor_hf": "", "unit": "ms"})
    for i in range(2, a.rounds + 1):  # the same load again on the same server
      ri, later = load_round(i)
      summary[f"round{i}_c{cmax}"] = {"tok_s": ri["output_tok_s"],
                                      "itl_ms_p50": ri["itl_p50_ms"],
                                      "ttft_ms_p50": ri["ttft_p50_ms"],
                                      "schedule": schedule(later)}
      rows.append({"case": f"output tok/s, c={cmax}, round {i} (same server)",
                   "ours": ri["output_tok_s"], "target": "", "anchor_hf": "", "unit": "tok/s"})
  except Exception as e:  # noqa: BLE001 - keep what was measured
    traceback.print_exc()
    summary["error"] = f"{type(e).__name__}: {e}"
  finally:
    try:  # compiles after warm-up would be timed (asked of an engine process too)
      counters = engine.counters()
      summary["compiled_shapes"] = counters["compiled_shapes"]
      summary["packed_prefill"] = counters["packed_prefill"]  # as resolved by the engine
      summary["mixed_steps_run"] = counters["mixed_steps_run"]
      summary["spec_draft_tokens"] = counters["spec_draft_tokens"]
      summary["spec_accepted_tokens"] = counters["spec_accepted_tokens"]
      # Any backend compile after warm-up: model steps, sampling, the engine's jnp calls.
      summary["compiles_after_start"] = counters["compiles_after_start"]
      summary["compile_s_after_start"] = counters["compile_s_after_start"]
    except Exception as e:  # noqa: BLE001 - an engine process that died says so above
      summary["compiled_shapes"] = f"not known: {e!r}"
    server.stop(grace=1.0)

  (out / "serving_gpu_summary.json").write_text(json.dumps(summary, indent=1, default=str))
  bench.write(out, "serving_gpu", rows, ["case", "ours", "target", "anchor_hf", "unit"],
              "PYTHONPATH=. python3 bench/serving_gpu.py " + " ".join(sys.argv[1:]))
  print("\n" + bench.table(rows, ["case", "ours", "target", "anchor_hf", "unit"]))
  print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
  main()
