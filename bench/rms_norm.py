"""RMSNorm on the GPU: our Mosaic GPU kernel against XLA's fused RMSNorm.

Checks correctness at full size first, autotunes block_rows (correct before
timed) and writes the winners into the tuning table, then times both side
by side on rotated inputs and reports HBM bandwidth (bytes read + written
once) against the target's ceiling.

  PYTHONPATH=. python3 bench/rms_norm.py --out bench/results
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from kernels import rms_norm as rn
from mosaic import bench, cost, testing, tuning

SHAPES = [(8192, 8192), (16384, 4096), (8192, 2048), (65536, 1024)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--tune", action="store_true", help="autotune and save the tuning table")
  args = ap.parse_args()
  rows = []
  tuned = {}
  for shape in SHAPES:
    sets = [testing.random_inputs([shape, shape[-1:]], jnp.bfloat16) for _ in range(3)]
    x, w = sets[0]
    ref = rn.rms_norm_reference(x, w)
    c = cost.rms_norm(*shape, "bfloat16")
    impls = {
        "mosaic": functools.partial(rn._rms_norm_mosaic, eps=1e-6),
        "xla": jax.jit(functools.partial(rn.rms_norm_xla, eps=1e-6)),
    }
    if args.tune:
      space = tuning.search_space(rn.Config, block_rows=[1, 2, 4], persistent=[False])
      space += [rn.Config(block_rows=b, persistent=True, stages=s, blocks_per_sm=g)
                for b, s, g in [(1, 3, 1), (2, 2, 1), (2, 4, 3), (4, 4, 2)]]
      space = [s for s in space if shape[0] % s.block_rows == 0]
      best, results = tuning.autotune(
          space,
          run=lambda cfg: rn.rms_norm_mosaic(x, w, config=cfg),
          check=lambda out: testing.assert_close(out, ref, "bfloat16"),
          time_fn=lambda cfg: bench.time_jax(
              functools.partial(rn._rms_norm_mosaic, eps=1e-6, config=cfg), sets, iters=10).median_s,
      )
      for r in results:
        us = f"{r.seconds * 1e6:.1f} us" if r.seconds is not None else "failed"
        print(f"  tune {shape} {r.config}: {us} {r.error or ''}")
      tuned[tuning.shape_key(cols=shape[1], dtype="bfloat16")] = best
      impls["mosaic"] = functools.partial(rn._rms_norm_mosaic, eps=1e-6, config=best)
    for name, f in impls.items():
      err = testing.assert_close(f(x, w), ref, "bfloat16", what=f"{name} {shape}")
      t = bench.time_jax(f, sets, iters=30)
      u = cost.utilization(c, t.median_s)
      rows.append({"shape": f"{shape[0]}x{shape[1]}", "impl": name, "us": t.median_s * 1e6,
                   "GB/s": u.gbps, "hbm_frac": u.hbm_fraction, "rel_err": err,
                   "timer": t.timer})
  by = {(r["shape"], r["impl"]): r for r in rows}
  for r in rows:
    r["vs_xla"] = by[(r["shape"], "xla")]["us"] / r["us"]
  if tuned:
    print("tuning table:", tuning.save("rms_norm", tuned))
  cols = ["shape", "impl", "us", "GB/s", "hbm_frac", "vs_xla", "rel_err"]
  bench.write(args.out, "rms_norm", rows, cols, "PYTHONPATH=. python3 bench/rms_norm.py --tune --out DIR")
  print(bench.table(rows, cols))


if __name__ == "__main__":
  main()
