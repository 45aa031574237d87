"""Is a rotation through 2x the L2 cold enough? (the profiler's decode matmul gap)

The profiler reads the decode qkv and o_proj at 0.82-0.86 of their stand-alone
benchmarks, which rotate through ``bench.cold_sets`` weight sets (2x the L2 in
bytes: 3 sets of o_proj's 32 MB). If the L2 does not evict strictly in LRU
order, part of a set survives the two others and the stand-alone figure is
L2-warm. Two ways to tell, with CUPTI kernel time:

  sets=N   the matmul alone, rotating N weight sets: a time that keeps growing
           with N past 3 sets means the 3-set figure found lines in L2
  touchP   a strided read of 1024 elements spread over P 2 MB pages (few
           bytes; P = 1 is the control with the same kernels), then the
           matmul: a slowdown that grows with P, but not with more sets,
           points at the TLB instead

Backends: mosaic and xla with the weight as the model stores it, [K, N];
xla_nk: XLA's GEMM on the same weight stored [N, K] (each output column's
K values contiguous, so one CTA's columns span a few pages, not the whole
weight).

    PYTHONPATH=. python3 bench/studies/l2_rotation_study.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

import kernels
from mosaic import bench, registry, testing

# (name, M, K, N, residual): the decode shapes the profiler reads low, and a
# weight over 2x the L2 as the control (two sets already evict it).
SHAPES = (("o", 16, 4096, 4096, True), ("qkv", 64, 4096, 6144, False),
          ("down", 16, 14336, 4096, True))
PAGE = 2 * 2**20


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=24)
  p.add_argument("--sets", default="2,3,6,12")
  p.add_argument("--backends", default="mosaic,xla,xla_nk")
  p.add_argument("--pages", default="1,64,1024", help="pages each touch spreads over")
  a = p.parse_args(argv)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  kernels.load_all()
  mm = registry.get_op("matmul")
  keys = iter(jax.random.split(jax.random.key(0), 4096))
  rnd = lambda *s: jax.random.normal(next(keys), s, jnp.float32).astype(jnp.bfloat16)
  counts = [int(s) for s in a.sets.split(",")]
  pages = [int(s) for s in a.pages.split(",")]
  big = rnd(max(pages) * PAGE // 2)
  n_touch = 1024

  def touch(b, p):
    # n_touch elements evenly over the first p pages of b.
    return jnp.sum(b[:p * PAGE // 2:p * PAGE // 2 // n_touch].astype(jnp.float32))

  t_touch = {p: bench.time_jax(jax.jit(lambda b, p=p: touch(b, p)), [(big,)],
                               iters=a.iters).median_s for p in pages}
  rows = []
  for name, m, k, n, res in SHAPES:
    kn_sets = [(rnd(m, k), rnd(k, n), rnd(m, n) if res else None) for _ in range(max(counts))]
    nk_sets = [(x, w.T.copy(), r) for x, w, r in kn_sets[:3]] if "xla_nk" in a.backends else []
    for backend in a.backends.split(","):
      sets = nk_sets if backend == "xla_nk" else kn_sets

      def f(x, w, r, backend=backend):
        if backend == "xla_nk":  # w is [N, K]
          y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
          return (y + (0 if r is None else r.astype(jnp.float32))).astype(x.dtype)
        return mm(x, w, residual=r, backend=backend)

      def g(b, x, w, r, p):
        # The touch feeds the matmul's input so it cannot move after it.
        return f(x + (touch(b, p) * 0).astype(x.dtype), w, r)

      # Correct before timed: against the float32 reference.
      x, w, r = sets[0]
      w_kn = w.T if backend == "xla_nk" else w
      ref = x.astype(jnp.float32) @ w_kn.astype(jnp.float32) + (0 if r is None else r.astype(jnp.float32))
      err = testing.rel_error(jax.jit(f)(x, w, r), ref)
      if not err < 2e-2:
        raise SystemExit(f"{name} {backend}: rel. error {err}")
      row = {"shape": name, "M": m, "K": k, "N": n, "backend": backend, "rel_err": err,
             "weight_MB": k * n * 2 / 2**20}
      for c in counts if backend != "xla_nk" else [3]:
        row[f"sets_{c}_us"] = bench.time_jax(jax.jit(f), sets[:c], iters=a.iters).median_s * 1e6
      for pg in pages:
        gp = jax.jit(lambda *args, pg=pg: g(*args, pg))
        t = bench.time_jax(gp, [(big, *s) for s in sets[:3]], iters=a.iters).median_s
        row[f"touch{pg}_us"] = (t - t_touch[pg]) * 1e6
      rows.append(row)
      print(row, flush=True)
  cols = ["shape", "M", "K", "N", "backend", "weight_MB", *[f"sets_{c}_us" for c in counts],
          *[f"touch{pg}_us" for pg in pages], "rel_err"]
  cmd = ("PYTHONPATH=. python3 bench/studies/l2_rotation_study.py "
         + " ".join(argv or sys.argv[1:]))
  bench.write(out, "l2_rotation", rows, cols, cmd)
  (out / "touch.json").write_text(json.dumps({"touch_alone_us": {p: t * 1e6 for p, t in t_touch.items()}}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
