"""Our ops from PyTorch on the GPU (mosaic.torch): what the torch path costs,
FA3 prefill through torch against torch's cuDNN SDPA, and a transformers
model with attn_implementation="mosaic" against "sdpa".

Three parts, each checked before it is timed (relative Frobenius error
against a float32 reference, NaN fails; a wrong result is reported, never
timed):

1. ``overhead``: per-call cost of ``torch.ops.mosaic.<op>`` against the same
   kernel (backend "mosaic") called from jax on the same buffers, for
   rms_norm and attention_prefill at a small shape (host-bound: the
   difference is the torch path's host work) and a large one (device-bound).
   ``host_us``: time for a call to return, ``us_per_call``: wall time of
   ``--calls`` back-to-back calls until the device is done, divided by the
   calls; medians of ``--repeats`` runs. ``overhead_us`` is torch's
   us_per_call minus jax's.
2. ``prefill``: attention_prefill through torch at S=4096, head_dim 128,
   causal and not (our op in torch's [B, H, S, D] layout, "bhsd", and in the
   kernel's own [B, S, H, D], "bshd") against
   ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, and the jax call of the same
   kernel. Medians of CUDA-event times around the call for the torch rows
   (our op's jax kernels run between its stream handshakes, so the events
   bracket them, and any host gap before they launch counts too) and of
   CUPTI kernel time for the jax row.
3. ``model``: a random-weight Llama (fixed seed; ``--model llama1b``: 16
   layers, hidden 2048, 16 heads of 128, 8 kv heads; ``smollm2``: the
   SmolLM2-135M config) in bf16. Last-position logits of a 4k prompt with
   "mosaic" and "sdpa" against the same weights in float32 ("sdpa"; sdpa's
   drift within MODEL_TOL, mosaic's within 1.5x sdpa's); the
   prefill time at 4k context of each (median of CUDA-event times); and a
   64-token greedy generation with each, which must be equal. Random weights
   give flat logits, so a bf16 near-tie can flip a token: where the two
   generations differ, the row says at which token and whether sdpa's own
   top-2 logit gap there is within the mosaic-sdpa logit difference (a tie)
   or not (a failure). ``--gguf PATH`` runs a checkpoint instead (the
   embedded SmolLM2-135M-Instruct, as transformers loads a GGUF), its
   generation from a chat prompt, with the text in the row.

  PYTHONPATH=. python3 bench/torch_interop.py --out /tmp/torch_interop [--quick] [--gguf F]

Writes torch_interop.json and .md under --out (mosaic.bench.write).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the card

import jax
import numpy as np
import torch

from mosaic import bench, cost, registry, testing
from mosaic import torch as mtorch

COLUMNS = ["part", "case", "impl", "ok", "rel_err", "host_us", "us_per_call", "overhead_us",
           "ms", "tflops", "vs_torch_cudnn", "note"]
ERRLOG: pathlib.Path | None = None
# A bf16 model's last-position logits against the same weights in float32:
# bound for sdpa's drift; mosaic's must also stay within 1.5x sdpa's.
MODEL_TOL = 0.1
_seeds = iter(range(testing._BASE_SEED, testing._BASE_SEED + 1_000_000))


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
  g = torch.Generator(device="cuda").manual_seed(next(_seeds))
  return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| (mosaic.testing.rel_error: inf with NaN or inf)."""
  f64 = lambda t: t.detach().double().cpu().numpy()
  return testing.rel_error(f64(out), f64(ref))


def _check(row, out, ref, tol):
  row["rel_err"] = err = rel_err(out, ref)
  if not err <= tol:  # NaN-safe
    raise AssertionError(f"relative error {err:.3e} > {tol:.1e}")


def _fail(row, e):
  row["ok"] = False
  row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
  if ERRLOG is not None:
    with open(ERRLOG, "a") as f:
      f.write(f"==== {row['part']} {row['case']} {row['impl']}\n{traceback.format_exc()[-6000:]}\n")


def _print(row):
  fmt = lambda k: f"{row[k]:.3g}" if isinstance(row.get(k), float) else str(row.get(k, "-"))
  print(f"  {row['part']:8s} {row['case']:30s} {row['impl']:14s} ok={row.get('ok')!s:5s} "
        + " ".join(f"{k}={fmt(k)}" for k in ("rel_err", "host_us", "us_per_call", "ms", "tflops")
                   if k in row) + f" {row.get('note', '')}", flush=True)


# --------------------------------------------------------------------------
# 1. per-call overhead


def per_call(fn, args, sync, calls: int, repeats: int) -> tuple[float, float]:
  """(host seconds for a call to return, wall seconds per call until the
  device is done), medians over ``repeats`` runs of ``calls`` calls."""
  sync(fn(*args))
  host, wall = [], []
  for _ in range(repeats):
    sync(None)
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    t1 = time.perf_counter()
    sync(out)
    t2 = time.perf_counter()
    host.append((t1 - t0) / calls)
    wall.append((t2 - t0) / calls)
  return statistics.median(host), statistics.median(wall)


def _torch_sync(_):
  torch.cuda.synchronize()


def _jax_sync(out):
  if out is not None:
    jax.block_until_ready(out)
  torch.cuda.synchronize()


def overhead(rows, calls, repeats, quick):
  norm = registry.get_op("rms_norm")
  prefill = registry.get_op("attention_prefill")
  cases = [
      ("rms_norm", "small_16x2048", (randn(16, 2048), randn(2048))),
      ("rms_norm", "large_32768x8192", (randn(32768, 8192), randn(8192))),
      ("attention_prefill", "small_B1_S128_H8_D128",
       (randn(1, 128, 8, 128), randn(1, 128, 8, 128), randn(1, 128, 8, 128))),
      ("attention_prefill", "large_B1_S4096_H32_D128",
       (randn(1, 4096, 32, 128), randn(1, 4096, 32, 128), randn(1, 4096, 32, 128))),
  ]
  if quick:
    cases = [c for c in cases if c[1].startswith("small") or c[0] == "rms_norm"]
  for op_name, case, targs in cases:
    if op_name == "rms_norm":
      x, w = targs
      t_fn = lambda x, w: torch.ops.mosaic.rms_norm(x, w, 1e-6, "mosaic")
      j_fn = jax.jit(lambda x, w: norm(x, w, eps=1e-6, backend="mosaic"))
      ref = ((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
             * w.float())
      tol = testing.tolerance("bfloat16")
    else:
      t_fn = lambda q, k, v: torch.ops.mosaic.attention_prefill(q, k, v, True, None, None, "bshd",
                                                                "mosaic")
      j_fn = jax.jit(lambda q, k, v: prefill(q, k, v, causal=True, backend="mosaic"))
      ref = _ref_attention_bshd(*targs, causal=True)
      tol = testing.tolerance("bfloat16")
    jargs = [mtorch.to_jax(t) for t in targs]  # the same buffers
    by = {}
    for impl, fn, args, sync in (("jax", j_fn, jargs, _jax_sync),
                                 ("torch", t_fn, targs, _torch_sync)):
      row = {"part": "overhead", "case": f"{op_name}_{case}", "impl": impl, "ok": True}
      try:
        out = fn(*args)
        _check(row, mtorch.to_torch(out) if impl == "jax" else out, ref, tol)
        host, wall = per_call(fn, args, sync, calls, repeats)
        row["host_us"], row["us_per_call"] = host * 1e6, wall * 1e6
        by[impl] = row
      except Exception as e:  # noqa: BLE001 -- one failing case must not hide the others
        _fail(row, e)
      rows.append(row)
      _print(row)
    if "jax" in by and "torch" in by:
      by["torch"]["overhead_us"] = by["torch"]["us_per_call"] - by["jax"]["us_per_call"]


# --------------------------------------------------------------------------
# 2. FA3 prefill through torch vs torch's cuDNN SDPA


def _ref_attention_bshd(q, k, v, causal):
  """float32 reference in [B, S, H, D] (torch's math SDPA on float32 copies)."""
  from torch.nn.attention import SDPBackend, sdpa_kernel

  f = lambda t: t.float().transpose(1, 2)
  with sdpa_kernel([SDPBackend.MATH]):
    out = torch.nn.functional.scaled_dot_product_attention(
        f(q), f(k), f(v), is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
  return out.transpose(1, 2)


def prefill(rows, shapes):
  from torch.nn.attention import SDPBackend, sdpa_kernel

  op = registry.get_op("attention_prefill")
  for B, S, Hq, Hkv, D in shapes:
    for causal in (False, True):
      case = f"B{B}_S{S}_Hq{Hq}_Hkv{Hkv}_D{D}_c{int(causal)}"
      flops = cost.attention(B, Hq, Hkv, S, S, D, causal=causal).flops
      # Two input sets, rotated, in torch's layout [B, H, S, D] and the kernel's [B, S, H, D].
      sets = [(randn(B, Hq, S, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D)) for _ in range(2)]
      bshd = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in sets]
      ref = _ref_attention_bshd(*bshd[0], causal=causal)
      gqa = Hq != Hkv

      def cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
          return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                  enable_gqa=gqa)

      impls = [
          ("torch_cudnn", cudnn, sets, lambda o: o.transpose(1, 2)),
          ("mosaic_bhsd", lambda q, k, v: torch.ops.mosaic.attention_prefill(
              q, k, v, causal, None, None, "bhsd", "mosaic"), sets, lambda o: o.transpose(1, 2)),
          ("mosaic_bshd", lambda q, k, v: torch.ops.mosaic.attention_prefill(
              q, k, v, causal, None, None, "bshd", "mosaic"), bshd, lambda o: o),
          ("jax_mosaic", None, bshd, None),
      ]
      by = {}
      for impl, fn, tsets, as_bshd in impls:
        row = {"part": "prefill", "case": case, "impl": impl, "ok": True}
        try:
          if impl == "jax_mosaic":
            f = jax.jit(lambda q, k, v: op(q, k, v, causal=causal, backend="mosaic"))
            jsets = [tuple(mtorch.to_jax(t) for t in s) for s in tsets]
            _check(row, mtorch.to_torch(f(*jsets[0])), ref, testing.tolerance("bfloat16"))
            t = bench.time_jax(f, jsets, iters=10, warmup=1)
          else:
            _check(row, as_bshd(fn(*tsets[0])), ref, testing.tolerance("bfloat16"))
            t = bench.time_torch(fn, tsets, iters=10)
          row["ms"] = t.median_s * 1e3
          row["tflops"] = flops / t.median_s / 1e12
          by[impl] = row
        except Exception as e:  # noqa: BLE001
          _fail(row, e)
        rows.append(row)
        _print(row)
      base = by.get("torch_cudnn", {}).get("tflops")
      for r in by.values():
        if base and r.get("tflops"):
          r["vs_torch_cudnn"] = r["tflops"] / base


# --------------------------------------------------------------------------
# 3. transformers: attn_implementation="mosaic" against "sdpa"


def model_config(name):
  from transformers import LlamaConfig

  if name == "llama1b":
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False)
  if name == "smollm2":  # SmolLM2-135M's config
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True)
  raise ValueError(f"--model {name!r} must be llama1b or smollm2")


def _set_attn(model, impl):
  if hasattr(model, "set_attn_implementation"):
    model.set_attn_implementation(impl)
  else:
    model.config._attn_implementation = impl


def _cuda_ms(fn, iters=5, warmup=1) -> float:
  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(iters):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    samples.append(a.elapsed_time(b))
  return statistics.median(samples)


def first_difference(a, b) -> int | None:
  n = min(a.shape[-1], b.shape[-1])
  diff = (a[0, :n] != b[0, :n]).nonzero()
  if len(diff):
    return int(diff[0])
  return None if a.shape == b.shape else n


# The greedy generation's request when the model is a checkpoint (--gguf), in
# the checkpoint's own chat template.
QUESTION = "Explain in a few sentences why the sky is blue."


def load_model(name, seed, gguf):
  """(model in float32 on the GPU, tokenizer or None, its name): the --gguf
  checkpoint as transformers itself loads it (dequantized by the gguf
  package), else a random-weight config of ``model_config``."""
  from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

  if gguf:
    path = pathlib.Path(gguf)
    # The tokenizer first: a checkpoint it cannot prompt is refused before the
    # weights are dequantized.
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not tok.chat_template:
      raise SystemExit(f"--gguf {gguf}: the checkpoint has no chat template to prompt it with")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).to("cuda")
    return model, tok, path.stem
  torch.manual_seed(seed)
  with torch.device("cuda"):
    return LlamaForCausalLM(model_config(name)), None, name


def model_part(rows, name, seed, context, new_tokens, prompt_len, gguf=None):
  mtorch.register_transformers_attention()
  model, tok, name = load_model(name, seed, gguf)  # float32 weights: the reference
  model.eval()
  cfg = model.config
  ids = torch.randint(3, cfg.vocab_size, (1, context), device="cuda",
                      generator=torch.Generator(device="cuda").manual_seed(seed))
  case = f"{name}_ctx{context}"
  with torch.no_grad():
    _set_attn(model, "sdpa")
    ref = model(ids, logits_to_keep=1).logits[:, -1].float()
    model.to(torch.bfloat16)
    prefill_ms, errs = {}, {}
    for impl in ("sdpa", "mosaic"):
      row = {"part": "model", "case": f"{case}_prefill", "impl": impl, "ok": True}
      try:
        _set_attn(model, impl)
        errs[impl] = row["rel_err"] = rel_err(model(ids, logits_to_keep=1).logits[:, -1], ref)
        # A bf16 model's last logits drift from the float32 model's through
        # every layer: the bar is sdpa's own drift, not a kernel tolerance.
        bar = MODEL_TOL if impl == "sdpa" else min(MODEL_TOL, 1.5 * errs["sdpa"] + 1e-3)
        if not errs[impl] <= bar:
          raise AssertionError(f"last-position logits: relative error {errs[impl]:.3e} > {bar:.2e}"
                               f" against the float32 model")
        prefill_ms[impl] = row["ms"] = _cuda_ms(lambda: model(ids, logits_to_keep=1))
        row["note"] = "whole-model prefill; rel_err: last logits vs the float32 model"
      except Exception as e:  # noqa: BLE001
        _fail(row, e)
      rows.append(row)
      _print(row)
    if "sdpa" in prefill_ms and "mosaic" in prefill_ms:
      rows[-1]["note"] += f"; {prefill_ms['sdpa'] / prefill_ms['mosaic']:.2f}x sdpa's speed"

    row = {"part": "model", "case": f"{name}_greedy{new_tokens}", "impl": "mosaic vs sdpa",
           "ok": True}
    try:
      prompt = ids[:, :prompt_len] if tok is None else tok.apply_chat_template(
          [{"role": "user", "content": QUESTION}], add_generation_prompt=True,
          return_tensors="pt", return_dict=True)["input_ids"].cuda()
      gen = {}
      for impl in ("sdpa", "mosaic"):
        _set_attn(model, impl)
        gen[impl] = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)
      t = first_difference(gen["mosaic"], gen["sdpa"])
      if t is None:
        row["note"] = f"{new_tokens} greedy tokens equal"
        if tok is not None:
          text = tok.decode(gen["mosaic"][0, prompt.shape[1]:], skip_special_tokens=True)
          row["note"] += f" (from {QUESTION!r} in its chat template): {text!r}"
      else:
        prefix = gen["sdpa"][:, :t]
        at = {}
        for impl in ("sdpa", "mosaic"):
          _set_attn(model, impl)
          at[impl] = model(prefix, logits_to_keep=1).logits[0, -1].float()
        top2 = at["sdpa"].topk(2).values
        gap = float(top2[0] - top2[1])
        noise = float((at["mosaic"] - at["sdpa"]).abs().max())
        tie = gap <= 2 * noise
        row["ok"] = tie
        row["note"] = (f"differ from token {t - prompt.shape[1]}: sdpa's top-2 gap {gap:.3g} "
                       f"{'<=' if tie else '>'} 2x the mosaic-sdpa logit difference {noise:.3g} "
                       f"({'a bf16 near-tie' if tie else 'NOT a tie'})")
    except Exception as e:  # noqa: BLE001
      _fail(row, e)
    rows.append(row)
    _print(row)
  del model
  torch.cuda.empty_cache()


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--quick", action="store_true", help="fewer shapes, the smaller model")
  p.add_argument("--parts", default="overhead,prefill,model")
  p.add_argument("--calls", type=int, default=200)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--model", choices=("llama1b", "smollm2"),
                 help="the random-weight model (default llama1b; smollm2 under --quick)")
  p.add_argument("--context", type=int, default=4096)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--prompt-len", type=int,
                 help="random tokens the random model's generation starts from (default 128)")
  p.add_argument("--gguf", help="a GGUF checkpoint that transformers reads (the embedded "
                 "SmolLM2 model) instead of --model's random weights; needs the gguf package")
  args = p.parse_args(argv)
  for flag, value in (("--model", args.model), ("--prompt-len", args.prompt_len)):
    if args.gguf and value is not None:
      p.error(f"{flag} is the random model's: --gguf runs the checkpoint, prompted in its "
              "chat template")
  if args.gguf and not pathlib.Path(args.gguf).is_file():
    p.error(f"--gguf {args.gguf}: no such file")
  if not torch.cuda.is_available() or not any(d.platform == "gpu" for d in jax.devices()):
    sys.exit("torch_interop: needs a CUDA GPU visible to both torch and jax")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  global ERRLOG
  ERRLOG = out / "torch_interop_errors.log"
  cmd = "PYTHONPATH=. python3 bench/torch_interop.py " + " ".join(argv or sys.argv[1:])
  rows: list[dict] = []
  t0 = time.time()
  seed = testing._BASE_SEED % (2**31)
  print(f"torch {torch.__version__}, jax {jax.__version__}, seed {seed}", flush=True)

  def flush():
    bench.write(out, "torch_interop", rows, COLUMNS, cmd + f"  # MOSAIC_TEST_SEED={seed}")

  parts = args.parts.split(",")
  if "overhead" in parts:
    overhead(rows, args.calls, args.repeats, args.quick)
    flush()
  if "prefill" in parts:
    shapes = [(1, 4096, 32, 32, 128)] + ([] if args.quick else [(1, 4096, 32, 8, 128)])
    prefill(rows, shapes)
    flush()
  if "model" in parts:
    random_model = args.model or ("smollm2" if args.quick else "llama1b")
    model_part(rows, random_model, seed, args.context, args.new_tokens,
               128 if args.prompt_len is None else args.prompt_len, args.gguf)
    flush()
  print(bench.table(rows, COLUMNS))
  print(f"total {time.time() - t0:.0f}s")
  return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
