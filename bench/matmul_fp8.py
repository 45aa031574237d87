"""matmul_fp8: our fp8 kernel against cuBLAS's fp8 GEMM and our bf16 kernel.

Shapes: 8192^3 and the Llama-3-8B layer shapes (qkv 4096->6144, o
4096->4096, gate_up 4096->28672, down 14336->4096) at M in {1, 16, 64, 192,
2048, 8192}; a [M, K] and w [N, K] float8_e4m3fn with per-row / per-column
float32 scales, bf16 out. Rows:

- ``mosaic_fp8``: kernels/matmul_fp8.py (the config the H200 table or the
  heuristic picks);
- ``xla_fp8``: the fp8 ``dot_general`` through XLA (its cuBLASLt fp8 GEMM
  on Hopper) with the scales applied by XLA's fusion;
- ``torch_fp8``: ``torch._scaled_mm`` with row-wise scales (cuBLASLt /
  CUTLASS), where torch has it;
- ``mosaic_bf16``: kernels/matmul.py on the same shape in bf16 (the speed-up
  fp8 buys).

Every output is first checked against the float32 reference of the
dequantized operands (relative Frobenius error <= 1.6e-2); then each is
timed on rotating input sets (weights L2-cold) with device timers. Columns:
microseconds, TFLOP/s, GB/s (fp8 operand bytes + bf16 output), the fraction
of the HBM roofline at small M (``hbm_frac``: bytes over the card's
bandwidth, as ``mosaic.cost``), and ``vs_cublas`` (the best of xla_fp8 and
torch_fp8 over ours; >= 1.0 is at or above cuBLAS).

  PYTHONPATH=. python3 bench/matmul_fp8.py --out DIR [--small] [--only qkv:16,square]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from kernels import matmul as mm
from kernels import matmul_fp8 as mf
from mosaic import bench, target as target_lib

LAYERS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}  # Llama-3-8B, name: (K, N)
MS = (1, 16, 64, 192, 2048, 8192)
TOL = 1.6e-2


def shapes(small: bool):
  if small:
    return [("square", 256, 256, 256), ("qkv", 8, 384, 256), ("o", 72, 256, 512)]
  out = [("square", 8192, 8192, 8192)]
  for name, (k, n) in LAYERS.items():
    out += [(name, m, n, k) for m in MS]
  return out


def _input_sets(key, m, n, k):
  """Fresh quantized (a, a_scale, w, w_scale) sets, and their bf16 originals."""
  count = bench.cold_sets(m * k + n * k)
  sets, bf16 = [], []
  for i in range(count):
    ka, kw = jax.random.split(jax.random.fold_in(key, i))
    x = jax.random.normal(ka, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / k**0.5
    a, a_scale = mf.quantize_rows(x)
    wq, w_scale = mf.quantize_weight(w)
    sets.append((a, a_scale, wq, w_scale))
    bf16.append((x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
  return sets, bf16


def _torch_sets(sets):
  """The input sets as torch tensors on the same buffers' values: fp8 does not
  cross DLPack, so it crosses as uint8 and is viewed back; scales as the
  [M, 1] and [1, N] columns ``_scaled_mm`` takes for row-wise scaling."""
  import torch

  u8 = lambda x: torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(
      torch.float8_e4m3fn)
  return [(u8(a), torch.from_dlpack(s)[:, None], u8(w), torch.from_dlpack(t)[None, :])
          for a, s, w, t in sets]


def _torch_fp8(a, a_scale, w, w_scale):
  import torch

  return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--only", default="", help="shapes to run, e.g. qkv:16,square (name or name:M)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--no-torch", action="store_true")
  args = p.parse_args(argv)
  tgt = target_lib.current()
  command = "python3 bench/matmul_fp8.py " + " ".join(argv if argv is not None else sys.argv[1:])
  todo = shapes(args.small)
  if args.only:
    want = set(args.only.split(","))
    todo = [s for s in todo if s[0] in want or f"{s[0]}:{s[1]}" in want]
  torch_run = None
  if tgt.is_gpu and not args.no_torch:
    try:
      import torch  # noqa: F401

      torch_run = _torch_fp8
    except ImportError:
      pass
  op = jax.jit(lambda a, s, w, t: mf.matmul_fp8_mosaic(a, w, a_scale=s, w_scale=t))
  xla = jax.jit(lambda a, s, w, t: mf.matmul_fp8_xla(a, w, a_scale=s, w_scale=t))
  bf16 = jax.jit(lambda a, b: mm.matmul_mosaic(a, b))
  ref = jax.jit(lambda a, s, w, t: mf.matmul_fp8_reference(a, w, a_scale=s, w_scale=t))
  rows = []
  for name, m, n, k in todo:
    sets, bf_sets = _input_sets(jax.random.key(m * 7 + n * 3 + k), m, n, k)
    want = ref(*sets[0])
    flops = 2 * m * n * k
    fp8_bytes = m * k + n * k + 2 * m * n + 4 * (m + n)
    base = dict(shape=name, m=m, n=n, k=k)
    times = {}
    for backend, f, inputs, nbytes in (
        ("mosaic_fp8", op, sets, fp8_bytes), ("xla_fp8", xla, sets, fp8_bytes),
        ("torch_fp8", torch_run, sets if torch_run is None else _torch_sets(sets), fp8_bytes),
        ("mosaic_bf16", bf16, bf_sets, 2 * (m * k + n * k + m * n))):
      if f is None:
        continue
      row = dict(base, backend=backend)
      try:
        out = f(*inputs[0])
        if backend == "torch_fp8":
          out = jnp.asarray(jax.dlpack.from_dlpack(out))
        if backend == "mosaic_bf16":
          err = float(jnp.linalg.norm(out.astype(jnp.float32) - mm.matmul_reference(*inputs[0]))
                      / jnp.linalg.norm(mm.matmul_reference(*inputs[0])))
        else:
          err = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        row["rel_err"] = err
        if not err <= TOL:  # NaN fails too
          row["error"] = f"rel_err {err:.3g} > {TOL}"
          rows.append(row)
          continue
        if backend == "torch_fp8":
          t = bench.time_torch(f, inputs, iters=args.iters).median_s
        else:
          t = bench.time_jax(f, inputs, iters=args.iters).median_s
      except Exception as e:  # a backend that cannot run a shape is a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        continue
      times[backend] = t
      row |= dict(us=t * 1e6, tflops=flops / t / 1e12, gbps=nbytes / t / 1e9)
      if tgt.is_gpu:
        row["hbm_frac"] = nbytes / t / (tgt.ceilings.hbm_gbps * 1e9)
      rows.append(row)
    anchors = [times[b] for b in ("xla_fp8", "torch_fp8") if b in times]
    for row in rows:
      if row.get("backend") == "mosaic_fp8" and row["shape"] == name and row["m"] == m:
        if anchors and "us" in row:
          row["vs_cublas"] = min(anchors) / times["mosaic_fp8"]
        if "mosaic_bf16" in times and "us" in row:
          row["vs_bf16"] = times["mosaic_bf16"] / times["mosaic_fp8"]
    print(name, m, n, k, {b: f"{t * 1e6:.1f}us" for b, t in times.items()}, flush=True)
  cols = ["shape", "m", "n", "k", "backend", "us", "tflops", "gbps", "hbm_frac", "vs_cublas",
          "vs_bf16", "rel_err", "error"]
  j, md = bench.write(args.out, "matmul_fp8", rows, cols, command)
  print(md.read_text())
  bad = [r for r in rows if r["backend"] == "mosaic_fp8" and "error" in r]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
