"""Where a paged decode attention call spends its device time, kernel by kernel.

One ``attention_decode`` call on the mosaic backend is our kernel plus, with
split-K, the small XLA kernels that merge the splits' partials. This times
each kernel of the call with CUPTI (``mosaic.bench.time_jax_kernels``), on
fresh random bf16 K/V pages in random order, at the issue's shapes (Hq 32,
Hkv 8, D 128), after checking the output against the float32 reference:

    PYTHONPATH=. python3 bench/attention_decode_kernels.py --out DIR

writes ``attention_decode_kernels.json``: per shape, each kernel's median us.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

from kernels import attention_decode as ad
from mosaic import bench, testing

HQ, HKV, D = 32, 8, 128
SHAPES = ((1, 131072), (8, 32768), (64, 4096), (1, 512))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=30)
  a = p.parse_args(argv)

  page = ad.DEFAULT_PAGE_SIZE
  f = jax.jit(ad.attention_decode_mosaic)
  out = {}
  for b, length in SHAPES:
    lengths = jnp.full((b,), length, jnp.int32)
    # Enough input sets that each call reads its K/V from HBM, not L2.
    count = bench.cold_sets(2 * b * length * HKV * D * 2)
    sets = []
    for i in range(count):
      q, k, v = testing.random_inputs([(b, 1, HQ, D), (b, length, HKV, D), (b, length, HKV, D)],
                                      jnp.bfloat16, seed=i)
      # Pages in random order, the same table for K and V (same seed).
      (kp, table), (vp, _) = (ad.contiguous_to_paged(x, page, seed=b) for x in (k, v))
      sets.append((q, kp, vp, lengths, table))
      del k, v
    testing.assert_close(f(*sets[0]), ad.attention_decode_reference(*sets[0]), jnp.bfloat16)
    kernels = {}  # name -> median us; a name seen again gets its launch index
    for i, (name, sec) in enumerate(bench.time_jax_kernels(f, sets, iters=a.iters, warmup=1)):
      kernels[name if name not in kernels else f"{name}#{i}"] = sec * 1e6
    out[f"B={b} L={length}"] = kernels
    print(f"B={b} L={length}", json.dumps(out[f"B={b} L={length}"]), flush=True)
  path = pathlib.Path(a.out)
  path.mkdir(parents=True, exist_ok=True)
  (path / "attention_decode_kernels.json").write_text(json.dumps(out, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
