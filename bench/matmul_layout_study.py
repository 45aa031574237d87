"""Decode matmuls: the weight as stored [K, N] against column panels [N/tn, K, tn].

With swapped operands (``Config.swap_ab``) a CTA streams its tile_n weight
columns over all of K. Stored [K, N], each K row of that stripe is a
tile_n * 2-byte piece at an N * 2-byte stride; as panels (``to_panels``)
the stripe is one contiguous run. This study times both layouts with the
same configs, beside cuBLAS (XLA with its Triton GEMMs off), on rotating
weight copies, every output checked against the float32 reference first.

  PYTHONPATH=. python3 bench/matmul_layout_study.py --out DIR [--only down:1,qkv:16]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from bench.matmul import ACTIVATION, CUBLAS_ONLY, LAYERS, _input_sets, _ref, _rel_err
from kernels import matmul as mm
from mosaic import bench, cost

COLUMNS = ["shape", "M", "config", "layout", "us", "GBps", "cublas_us", "vs_cublas", "err"]


def configs(m: int, n: int, k: int, act) -> list[mm.Config]:
  """The table's config and a few swap_ab neighbours: more CTAs per column
  stripe (smaller tile_m: the stripe is read by each token tile, from L2
  when they run together) and two splits."""
  table = mm.fit_smem(mm.pick_config(m, n, k, jnp.bfloat16, act))
  out = [table] if table.swap_ab else []
  tn = 128 if (act or n // 64 > 264) else 64
  rep = dataclasses.replace
  tm_full = next(t for t in (8, 16, 32, 64) if t >= m)
  for tm in sorted({tm_full, max(8, tm_full // 2), max(8, tm_full // 4)}, reverse=True):
    for tk, split in ((128, 1), (256, 1), (128, 2)):
      base = mm.Config(tile_m=tm, tile_n=tn, tile_k=tk, split_k=split, swap_ab=True)
      if act and split > 1:
        continue
      fits = [s for s in range(2, 16) if rep(base, stages=s).smem_bytes() <= mm.SMEM_LIMIT]
      if fits:
        out.append(rep(base, stages=min(fits[-1], 6 if tk == 128 else 3)))
  seen, res = set(), []
  for c in out:
    if c not in seen:
      seen.add(c)
      res.append(c)
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--only", default="down:1,down:16,down:64,qkv:1,qkv:16,o:1,o:16,gate_up:1")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--max-configs", type=int, default=8)
  args = p.parse_args(argv)
  command = "python3 bench/matmul_layout_study.py " + " ".join(
      argv if argv is not None else sys.argv[1:])
  rows = []
  for item in args.only.split(","):
    name, _, ms = item.partition(":")
    m = int(ms)
    k, n = LAYERS[name]
    act = ACTIVATION.get(name)
    sets = _input_sets(jax.random.key(m * 7 + n * 3 + k), m, n, k)
    ref = _ref(*sets[0], activation=act)
    c = cost.matmul(m, n, k)
    cublas = jax.jit(lambda a, b: mm.matmul_xla(a, b, activation=act),
                     compiler_options=CUBLAS_ONLY if jax.default_backend() == "gpu" else None)
    cublas_s = bench.time_jax(cublas, sets, iters=args.iters).median_s
    for cfg in configs(m, n, k, act)[:args.max_configs]:
      for layout in ("KN", "panels"):
        panels = layout == "panels"
        run = jax.jit(lambda a, b, cfg=cfg, panels=panels: mm._run(
            a, b, None, None, cfg=cfg, out_dtype=jnp.bfloat16, activation=act, panels=panels))
        lsets = [(a, mm.to_panels(b, cfg.tile_n)) for a, b in sets] if panels else sets
        row = {"shape": name, "M": m, "config": mm_cfg_str(cfg), "layout": layout,
               "cublas_us": cublas_s * 1e6}
        try:
          err = float(_rel_err(run(*lsets[0]), ref))
          row["err"] = err
          if not err <= 1.6e-2:
            row["us"] = f"WRONG {err:.2e}"
          else:
            s = bench.time_jax(run, lsets, iters=args.iters).median_s
            row["us"] = s * 1e6
            row["GBps"] = cost.utilization(c, s).gbps
            row["vs_cublas"] = cublas_s / s
        except Exception as e:  # noqa: BLE001 -- a failure is a row
          row["us"] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(" ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                       for k_, v in row.items()), flush=True)
        bench.write(args.out, "matmul_layout_study", rows, COLUMNS, command)
      del lsets
  print(bench.table(rows, COLUMNS))


def mm_cfg_str(c):
  from bench.matmul import cfg_str
  return cfg_str(c)


if __name__ == "__main__":
  main()
