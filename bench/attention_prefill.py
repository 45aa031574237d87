"""Prefill attention on the GPU: our Mosaic FA3 kernel against cuDNN (jax and
torch), torch flash, and Pallas Triton, side by side in one run.

Every implementation is first checked against the float32 reference on the
same inputs (a wrong result is reported, never timed); then medians of device
time are taken on two rotating input sets. TFLOP/s count only the visible
score entries (causal halves the work; a packed batch counts each sequence's
own triangle). A short config sweep of the Mosaic kernel runs first and its
winners are written as a tuning table next to the results.

  PYTHONPATH=. python3 bench/attention_prefill.py --out /tmp/attn [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from kernels import attention_prefill as ap
from mosaic import bench, cost, registry, testing, tuning

OP = registry.get_op("attention_prefill")
COLUMNS = ["case", "impl", "ok", "rel_err", "ms", "tflops", "tc_frac", "vs_jax_cudnn",
           "vs_torch_cudnn", "note"]


ERRLOG = None


def _inputs(B, S, Hq, Hkv, D, sets=2):
  return [testing.random_inputs([(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)], jnp.bfloat16)
          for _ in range(sets)]


def _reference(q, k, v, **kw):
  f = lambda x: x.astype(jnp.float32)
  return ap.attention_prefill_xla(f(q), f(k), f(v), **kw)


def _torch_fn(which, causal, gqa):
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  backend = {"torch_cudnn": SDPBackend.CUDNN_ATTENTION,
             "torch_flash": SDPBackend.FLASH_ATTENTION}[which]

  def fn(q, k, v):
    with sdpa_kernel([backend]):
      return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                              enable_gqa=gqa)

  return fn


def _to_torch(x):
  import torch

  return torch.from_dlpack(x).transpose(1, 2).contiguous()  # [B, H, S, D]


def run_case(name, sets, kw, flops, impls, rows, ref=None, configs=None):
  """Checks then times each impl on ``sets``; appends one row per impl."""
  q, k, v = sets[0]
  if ref is None:
    ref = _reference(q, k, v, **kw)
  causal = kw.get("causal", True)
  gqa = q.shape[2] != k.shape[2]
  case_rows = []
  for impl in impls:
    row = {"case": name, "impl": impl, "ok": False}
    try:
      if impl.startswith("torch"):
        import torch

        fn = _torch_fn(impl, causal, gqa)
        tsets = [tuple(_to_torch(x) for x in s) for s in sets]
        out = fn(*tsets[0])
        torch.cuda.synchronize()
        out_j = jnp.asarray(jax.dlpack.from_dlpack(out.transpose(1, 2).contiguous()))
        row["rel_err"] = testing.assert_close(out_j, ref, jnp.bfloat16)
        t = bench.time_torch(fn, tsets, iters=10)
      else:
        cfg = (configs or {}).get(impl)
        backend = "mosaic" if impl.startswith("mosaic") else impl
        extra = {"config": cfg} if cfg is not None else {}
        f = jax.jit(lambda q, k, v, backend=backend, extra=extra: OP(
            q, k, v, backend=backend, **kw, **extra))
        out = f(q, k, v)
        row["rel_err"] = testing.assert_close(out, ref, jnp.bfloat16)
        t = bench.time_jax(f, sets, iters=10, warmup=1)
      row["ok"] = True
      row["ms"] = t.median_s * 1e3
      u = cost.utilization(cost.Cost(flops, 1.0), t.median_s)
      row["tflops"] = u.tflops
      row["tc_frac"] = u.tc_fraction
    except Exception as e:  # noqa: BLE001 -- one failing impl must not hide the others
      row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
      if ERRLOG is not None:
        with open(ERRLOG, "a") as f:
          f.write(f"==== {name} {impl}\n{traceback.format_exc()[-6000:]}\n")
    print(f"  {name:34s} {impl:14s} ok={row['ok']!s:5s} err={row.get('rel_err', float('nan')):.2e} "
          f"ms={row.get('ms', float('nan')):.3f} tflops={row.get('tflops', float('nan')):.1f} "
          f"{row.get('note', '')}", flush=True)
    case_rows.append(row)
  by = {r["impl"]: r for r in case_rows}
  for r in case_rows:
    for base in ("jax_cudnn", "torch_cudnn"):
      key = "cudnn" if base == "jax_cudnn" else base
      if r.get("tflops") and by.get(key, {}).get("tflops"):
        r[f"vs_{base}"] = r["tflops"] / by[key]["tflops"]
  rows.extend(case_rows)
  return by


def attn_flops(B, S, Hq, D, causal):
  return cost.attention(B, Hq, Hq, S, S, D, causal=causal).flops


def sweep(out_dir, rows, D, causal, S=4096, H=32):
  """Times a few configs of the Mosaic kernel; returns the fastest correct one."""
  C = ap.Config
  # A non-causal sweep has no mask, so no position vectors in SMEM: a third
  # 128-key stage or 192-key blocks fit there.
  unmasked = [C(block_kv=128, stages=3, overlap=True, pingpong=False), C(block_kv=128, stages=3),
              C(block_kv=192, stages=2, overlap=True, pingpong=False), C(block_kv=192, stages=2),
              C(block_kv=192, stages=2, overlap=True)]
  cands = {
      128: [C(block_kv=128, stages=2), C(block_kv=128, stages=2, overlap=True),
            C(block_kv=128, stages=2, overlap=True, pingpong=False),
            C(block_kv=128, stages=2, overlap=True, p_smem=True),
            C(block_kv=128, stages=2, overlap=True, p_smem=True, pingpong=False),
            *([] if causal else unmasked)],
      64: [C(block_kv=256, stages=2), C(block_kv=128, stages=3, overlap=True),
           C(block_kv=256, stages=2, overlap=True), C(block_kv=128, stages=4, overlap=True),
           C(block_kv=128, stages=4), C(block_kv=256, stages=2, overlap=True, pingpong=False),
           C(block_kv=128, stages=4, overlap=True, pingpong=False)],
      # 64 KB of Q tiles leave room for two stages of 64-key K/V blocks only.
      256: [C(block_kv=64, stages=2), C(block_kv=64, stages=2, overlap=True),
            C(block_kv=64, stages=2, overlap=True, pingpong=False),
            C(block_kv=64, stages=2, pingpong=False)],
  }[D]
  sets = _inputs(1, S, H, H, D)
  names = [f"mosaic[{c.block_kv},{c.stages}" + "".join(
      f",{tag}" for tag, on in (("ov", c.overlap), ("nopp", not c.pingpong), ("psmem", c.p_smem),
                                ("addacc", not c.acc_in_place),
                                ("inorder", causal and not c.heavy_first)) if on) + "]"
           for c in cands]
  by = run_case(f"sweep_S{S}_H{H}_D{D}_c{int(causal)}", sets, dict(causal=causal),
                attn_flops(1, S, H, D, causal), names, rows, configs=dict(zip(names, cands)))
  ok = [(by[n]["tflops"], c) for n, c in zip(names, cands) if by[n].get("tflops")]
  return max(ok, key=lambda t: t[0])[1] if ok else None


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--quick", action="store_true", help="only S=4096, D=128")
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument("--impls", default="mosaic,cudnn,torch_cudnn,torch_flash,triton")
  p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, no torch/cuDNN")
  p.add_argument("--sweeps", default="128:0,128:1,64:1,64:0",
                 help="head_dim:causal pairs whose configs are swept and tabled")
  p.add_argument("--shapes", default="",
                 help="S:Hq:Hkv:D shapes to compare (default: all; --quick: 4096:32:32:128; "
                 "head dim 256: 4096:16:8:256 with --sweeps 256:0,256:1)")
  p.add_argument("--no-extras", action="store_true",
                 help="skip the GQA 64/8 and packed-batch cases")
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  global ERRLOG
  ERRLOG = out / "errors.log"
  rows: list[dict] = []
  cmd = "PYTHONPATH=. python3 bench/attention_prefill.py " + " ".join(argv or sys.argv[1:])
  t0 = time.time()

  def flush():
    bench.write(out, "attention_prefill", rows, COLUMNS, cmd)

  best = {}
  if not (args.no_sweep or args.tiny):
    for D, causal in [tuple(map(int, x.split(":"))) for x in args.sweeps.split(",") if x]:
      causal = bool(causal)
      cfg = sweep(out, rows, D, causal)
      if cfg is not None:
        best[(D, causal)] = cfg
      flush()
    if best:
      entries = {tuning.shape_key(head_dim=D, dtype="bfloat16", causal=int(c)): cfg
                 for (D, c), cfg in best.items()}
      tuning.save("attention_prefill", entries, path=out / "tuning_nvidia_h200.json")
  print(f"sweep done at {time.time() - t0:.0f}s; best: {best}", flush=True)

  def cfgs(D, causal):
    cfg = best.get((D, causal))
    return {"mosaic": cfg} if cfg else None

  full = args.impls.split(",")
  if args.tiny:
    full = ["mosaic", "triton", "xla"]
    shapes = [(256, 2, 1, 64)]
  elif args.shapes:
    shapes = [tuple(map(int, x.split(":"))) for x in args.shapes.split(",")]
  elif args.quick:
    shapes = [(4096, 32, 32, 128)]
  else:
    shapes = [
      (4096, 32, 32, 128), (16384, 32, 32, 128), (4096, 32, 32, 64), (4096, 32, 8, 128)]
  for S, Hq, Hkv, D in shapes:
    for causal in (False, True):
      sets = _inputs(1, S, Hq, Hkv, D)
      run_case(f"B1_S{S}_Hq{Hq}_Hkv{Hkv}_D{D}_c{int(causal)}", sets, dict(causal=causal),
               attn_flops(1, S, Hq, D, causal), full, rows, configs=cfgs(D, causal))
      flush()
  if not (args.quick or args.tiny or args.no_extras):
    # GQA 64/8 at the anchor's shape.
    sets = _inputs(4, 4096, 64, 8, 128)
    run_case("B4_S4096_Hq64_Hkv8_D128_c1", sets, dict(causal=True),
             attn_flops(4, 4096, 64, 128, True), full, rows, configs=cfgs(128, True))
    flush()
    # Packed ragged batches vs a dense batch with the same total tokens: one
    # of whole 128-token blocks, one whose sequences end mid-block (as
    # prompts do), where a block holds the end of one and the start of the next.
    sets = _inputs(4, 4096, 32, 8, 128)
    by_d = run_case("dense_B4_S4096_Hq32_Hkv8_D128_c1", sets, dict(causal=True),
                    attn_flops(4, 4096, 32, 128, True), ["mosaic"], rows, configs=cfgs(128, True))
    for tag, lengths in (("", [4096, 256, 3072, 512, 2048, 1024, 3584, 1792]),
                         ("u", [4000, 300, 3100, 515, 2000, 1100, 3555, 1814])):  # 16384 tokens
      seg, pos = [], []
      for i, n in enumerate(lengths):
        seg += [i + 1] * n
        pos += list(range(n))
      seg = jnp.array([seg], jnp.int32)
      pos = jnp.array([pos], jnp.int32)
      T = sum(lengths)
      kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                kv_positions=pos)
      sets = _inputs(1, T, 32, 8, 128)
      fl = sum(cost.attention(1, 32, 32, n, n, 128, causal=True).flops for n in lengths)
      by_p = run_case(f"packed8{tag}_T{T}_Hq32_Hkv8_D128", sets, kw, fl,
                      [i for i in ("mosaic", "triton") if i in full], rows,
                      configs=cfgs(128, True))
      if by_p["mosaic"].get("tflops") and by_d["mosaic"].get("tflops"):
        ratio = by_p["mosaic"]["tflops"] / by_d["mosaic"]["tflops"]
        rows.append({"case": f"packed{tag}/dense", "impl": "mosaic", "ok": True,
                     "note": f"TFLOP/s ratio {ratio:.3f}"})
    flush()
  print(bench.table(rows, COLUMNS))
  print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
  main()
