"""Whole-model steps on the GPU: our kernels against XLA (cuBLAS) and cuDNN/Triton.

For a Llama-family config with random bf16 weights (default llama3.1-8b, the
size of the recorded transformers anchors), each backend set runs the jitted
``prefill`` (B prompts of T tokens, fresh cache) and ``decode`` (B sequences
at context C, one new token each) steps of models.llama:

  xla           every op on XLA (matmul = cuBLAS): the in-run anchor
  mosaic        every op on our Mosaic GPU kernels
  cudnn+triton  prefill attention on cuDNN, decode attention on Pallas Triton

Before timing, each set's logits are compared with the xla set's on the same
inputs (relative Frobenius error; through many random layers bf16 rounding
compounds, so the bar is --tol). Steps donate their cache, so timing threads
the cache from step to step and measures wall time per step around
block_until_ready (timer "wall", host launch included, as a server sees it).
The transformers figures of /work/shared/anchors (if given with --anchors)
are printed alongside.

  PYTHONPATH=. python3 bench/model.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

BACKENDS = {
    "xla": (dict(attention="xla", matmul="xla", norm="xla"),
            dict(attention="xla", matmul="xla", norm="xla")),
    "mosaic": (dict(attention="mosaic", matmul="mosaic", norm="mosaic"),
               dict(attention="mosaic", matmul="mosaic", norm="mosaic")),
    "cudnn+triton": (dict(attention="cudnn", matmul="xla", norm="xla"),
                     dict(attention="triton", matmul="xla", norm="xla")),
}
PREFILL = [(1, 2048), (16, 512)]  # (batch, prompt tokens)
DECODE = [(16, 512), (64, 512)]  # (batch, context tokens)


def _steps(model, phase, batch, length, kw, page_size, iters, seed=0):
  """(per-step wall times, logits of the first step)."""
  cfg = model.config
  rng = np.random.default_rng(seed)
  per = -(-(length + 1) // page_size)
  table = (1 + np.arange(batch * per, dtype=np.int32)).reshape(batch, per)
  cache = model.init_cache(1 + batch * per, page_size)
  if phase == "prefill":
    tokens = rng.integers(0, cfg.vocab_size, (batch, length), dtype=np.int32)
    call = lambda c: model.prefill(c, tokens, np.zeros(batch, np.int32),
                                   np.full(batch, length, np.int32), table, **kw)
  else:
    # Fill the context with a prefill first, then time one-token steps.
    ctx = rng.integers(0, cfg.vocab_size, (batch, length - 1), dtype=np.int32)
    _, cache = model.prefill(cache, ctx, np.zeros(batch, np.int32),
                             np.full(batch, length - 1, np.int32), table,
                             **{k: v for k, v in kw.items() if k != "attention"})
    tokens = rng.integers(0, cfg.vocab_size, (batch,), dtype=np.int32)
    call = lambda c: model.decode(c, tokens, np.full(batch, length, np.int32), table, **kw)
  first, cache = call(cache)
  first = np.asarray(jax.device_get(first), np.float32)
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    logits, cache = call(cache)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
  return times, first


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--model", default="llama3.1-8b", help="named config (random weights)")
  ap.add_argument("--layers", type=int, default=None, help="cut the config to this many layers")
  ap.add_argument("--backends", default=",".join(BACKENDS))
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--page-size", type=int, default=None)
  ap.add_argument("--tol", type=float, default=5e-2)
  ap.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke run)")
  ap.add_argument("--anchors", default="/work/shared/anchors/h200-2026-11-30-hf-transformers-e2e.json")
  args = ap.parse_args()

  from models import config as config_lib, kv_cache, model as model_lib, tokenizer as tok_lib
  from mosaic import bench, testing

  cfg = config_lib.get(args.model)
  if args.layers:
    cfg = cfg.replace(num_layers=args.layers, name=f"{cfg.name}-{args.layers}l")
  ps = args.page_size or kv_cache.DEFAULT_PAGE_SIZE
  t0 = time.perf_counter()
  params = model_lib.random_params(cfg, seed=0, dtype="bfloat16")
  model = model_lib.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="bfloat16")
  del params
  print(f"{cfg.name}: {cfg.num_params() / 1e9:.2f}B params, built in {time.perf_counter() - t0:.0f}s",
        flush=True)
  weight_bytes = 2 * cfg.num_params()
  names = [b for b in args.backends.split(",") if b]
  for b in names:
    if b not in BACKENDS:
      sys.exit(f"unknown backend set {b!r}; known: {', '.join(BACKENDS)}")
  rows, failed = [], False
  prefill, decode = ([(2, 32)], [(2, 40)]) if args.quick else (PREFILL, DECODE)
  cases = [("prefill", b, t) for b, t in prefill] + [("decode", b, c) for b, c in decode]
  for phase, batch, length in cases:
    ref = None
    for name in ["xla"] + [n for n in names if n != "xla"]:
      pre, dec = BACKENDS[name]
      kw = pre if phase == "prefill" else dec
      row = {"phase": phase, "batch": batch, "tokens": length, "backends": name}
      try:
        times, logits = _steps(model, phase, batch, length, kw, ps, args.iters)
      except Exception as e:  # one backend failing must not hide the others' figures
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"{phase} B={batch} {length}: {name}: {row['error']}", flush=True)
        failed = True
        rows.append(row)
        continue
      if ref is None:
        ref = logits
      err = testing.rel_error(logits, ref)
      row["rel_err_vs_xla"] = err
      if not err <= args.tol:
        row["error"] = f"logits differ from xla: {err:.3e} > {args.tol}"
        failed = True
      med = statistics.median(times)
      row["ms"] = med * 1e3
      row["min_ms"] = min(times) * 1e3
      new_tokens = batch * (length if phase == "prefill" else 1)
      row["tok_s"] = new_tokens / med
      # Decode is bound by reading the weights (and the cache) once per step.
      kv_bytes = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * batch * length
      row["hbm_frac"] = ((weight_bytes + kv_bytes) / med / 1e9 / cost_target_gbps()
                         if phase == "decode" else None)
      row["tflops"] = 2 * cfg.num_params() * new_tokens / med / 1e12
      row["timer"] = "wall"
      rows.append(row)
      print(f"{phase} B={batch} {length}: {name}: {med * 1e3:.2f} ms, {row['tok_s']:.0f} tok/s, "
            f"err {err:.2e}", flush=True)
  anchors = pathlib.Path(args.anchors)
  if anchors.exists():
    for k, v in json.loads(anchors.read_text()).items():
      if isinstance(v, dict):
        rows.append({"phase": "anchor", "backends": f"transformers {k}",
                     "ms": v.get("tpot_ms"), "tok_s": v.get("out_tok_s"),
                     "error": f"ttft {v.get('ttft_ms', 0):.1f} ms (recorded, 8B)"})
  cols = ["phase", "batch", "tokens", "backends", "ms", "min_ms", "tok_s", "tflops", "hbm_frac",
          "rel_err_vs_xla", "timer", "error"]
  bench.write(args.out, f"model_{cfg.name}", rows, cols, " ".join(sys.argv))
  print(bench.table(rows, cols))
  return 1 if failed else 0


def cost_target_gbps() -> float:
  from mosaic import target

  return target.current().ceilings.hbm_gbps


if __name__ == "__main__":
  sys.exit(main())
