"""Does the HBM layout of a KV page change how fast TMA streams it? (decode attention)

The decode kernel copies each [page, D] page of K and of V with TMA into a
tiled, 128-byte-swizzled SMEM tile. With D = 128 bf16 a row is 256 bytes and
a swizzle is 128, so each page copy is boxes of [page, 64] whose rows are 128
bytes at a 256-byte stride. A streaming probe (no MMA) answers whether the
same bytes stream faster when the page is stored in the SMEM tile's order,
so that every box reads contiguous bytes:

  rows   [P, page, D]                 today's layout (the box reads strided rows)
  tiles  [P, page/8, D/64, 8, 64]     the SMEM tile order (one contiguous page)
  halves [P, D/64, page, 64]          each 64-column half of the page contiguous

Each of ``ctas`` blocks streams its share of pages (random order, as a paged
cache is) through a ring of ``stages`` K + V slots; nothing is computed, so
the time is the copies'. GB/s = K and V bytes / CUPTI kernel time (median).

    PYTHONPATH=. python3 bench/studies/kv_layout_study.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mosaic import bench, dsl
from mosaic.dsl import lax, pl, plgpu

D = 128
LAYOUTS = ("rows", "tiles", "halves")


def _shape(layout: str, pages: int, page: int):
  return {"rows": (pages, page, D), "tiles": (pages, page // 8, D // 64, 8, 64),
          "halves": (pages, D // 64, page, 64)}[layout]


def _smem(layout: str, stages: int, page: int, dtype):
  if layout == "rows":
    return plgpu.SMEM((stages, page, D), dtype, transforms=dsl.smem_transforms((page, D), dtype))
  return plgpu.SMEM((stages, *_shape(layout, 1, page)[1:]), dtype,
                    transforms=(plgpu.SwizzleTransform(128),))


def stream(table, k, v, *, layout: str, stages: int):
  """Streams the pages ``table[c, :]`` of k and v in block c; returns a dummy."""
  ctas, steps = table.shape
  page = {"rows": k.shape[1], "tiles": k.shape[1] * 8, "halves": k.shape[2]}[layout]

  def body(table_ref, k_ref, v_ref, o_ref, k_smem, v_smem, bars):
    del o_ref
    kb, vb = bars
    c = lax.axis_index("c")

    def issue(step, slot):
      pg = table_ref[c, step]
      plgpu.copy_gmem_to_smem(k_ref.at[pg], k_smem.at[slot], kb.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[pg], v_smem.at[slot], vb.at[slot])

    for i in range(stages):
      issue(i, i)

    @pl.loop(0, steps)
    def _(i):
      slot = lax.rem(i, jnp.int32(stages))
      plgpu.barrier_wait(kb.at[slot])
      plgpu.barrier_wait(vb.at[slot])

      @pl.when(i + stages < steps)
      def _():
        issue(i + stages, slot)

  return dsl.kernel(
      body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(ctas,),
      grid_names=("c",),
      scratch_types=[_smem(layout, stages, page, k.dtype), _smem(layout, stages, page, k.dtype),
                     (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages))],
  )(table, k, v)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--pages", type=int, default=16384, help="pages of K (and of V)")
  ap.add_argument("--page", type=int, default=128)
  ap.add_argument("--ctas", default="128,132")
  ap.add_argument("--stages", default="2,3")
  ap.add_argument("--layouts", default=",".join(LAYOUTS))
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--order", default="random", choices=("random", "linear"),
                  help="pages in random order, or each block's pages consecutive in HBM")
  a = ap.parse_args(argv)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  rows = []
  for layout in a.layouts.split(","):
    shape = _shape(layout, a.pages, a.page)
    kk = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    vv = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    for ctas in (int(x) for x in a.ctas.split(",")):
      steps = a.pages // ctas
      order = rng.permutation(a.pages) if a.order == "random" else np.arange(a.pages)
      table = jnp.asarray(order[:ctas * steps].reshape(ctas, steps), jnp.int32)
      nbytes = 2 * ctas * steps * a.page * D * 2
      for stages in (int(x) for x in a.stages.split(",")):
        f = jax.jit(functools.partial(stream, layout=layout, stages=stages))
        # One input set: each call streams 1 GB, 20x the L2, so none stays there.
        t = bench.time_jax(f, [(table, kk, vv)], iters=a.iters)
        row = {"layout": layout, "order": a.order, "ctas": ctas, "stages": stages, "page": a.page,
               "us": t.median_s * 1e6, "GB/s": nbytes / t.median_s / 1e9, "timer": t.timer}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del kk, vv
  (out / "kv_layout_study.json").write_text(json.dumps(
      {"command": " ".join(sys.argv), "jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
