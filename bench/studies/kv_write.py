"""The prefill's K/V cache write on the GPU: padding tokens dropped (ours)
against padding tokens all sent to scratch page 0, slot 0 (the write before).

One layer's scatter of a [rows, T] chunk batch into the Llama-3-8B cache
([32 layers, 8 kv heads, pages, 128 slots, 128]), with 4..1 of 4 rows valid
and with ragged rows (a short prompt's chunk leaves its tail as padding).
Correctness first (the live slots hold the chunk's K/V, nothing else moved),
then CUPTI device time, median, cache donated from call to call as the model
does.

  PYTHONPATH=. python3 bench/studies/kv_write.py --out DIR
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from models import kv_cache
from mosaic import bench

LAYERS, HKV, PAGES, PAGE, HD = 32, 8, 1400, 128, 128
ROWS, T, LAYER = 4, 512, 17
CASES = {"4 of 4 rows": [512] * 4, "3 of 4 rows": [512] * 3 + [0],
         "2 of 4 rows": [512] * 2 + [0] * 2, "1 of 4 rows": [512] + [0] * 3,
         "ragged 512/300/100/17": [512, 300, 100, 17]}


def scratch_write(kc, vc, layer, page, slot, valid, k, v):
  """The write before: every invalid token to page 0, slot 0."""
  page, slot = jnp.where(valid, page, 0), jnp.where(valid, slot, 0)
  put = lambda c, x: c.at[layer, :, page, slot].set(x.astype(c.dtype))
  return put(kc, k), put(vc, v)


IMPLS = {"drop (ours)": kv_cache.write_kv, "scratch slot (before)": scratch_write}


def inputs(lengths, rng):
  table = rng.permutation(np.arange(1, PAGES))[:ROWS * T // PAGE].reshape(ROWS, -1)
  tpos = np.broadcast_to(np.arange(T), (ROWS, T))
  valid = tpos < np.asarray(lengths)[:, None]
  page, slot = kv_cache.page_slot(jnp.asarray(tpos), jnp.asarray(valid), jnp.asarray(table), PAGE)
  k, v = (jnp.asarray(rng.standard_normal((ROWS, T, HKV, HD)), jnp.bfloat16) for _ in range(2))
  return page, slot, jnp.asarray(valid), k, v, table


def check(kc0, vc0, kc, vc, page, slot, valid, k, v):
  """Live slots hold k/v; every other (page, slot) of every layer is unchanged."""
  pg, sl, ok = np.asarray(page)[np.asarray(valid)], np.asarray(slot)[np.asarray(valid)], None
  for c0, c, x in ((kc0, kc, k), (vc0, vc, v)):
    got = np.asarray(c[LAYER][:, pg, sl].astype(jnp.float32))  # [Hkv, n, hd]
    want = np.asarray(x.astype(jnp.float32))[np.asarray(valid)].swapaxes(0, 1)
    if not np.array_equal(got, want):
      raise AssertionError("live slots do not hold the chunk's K/V")
    moved = np.array(jnp.any(c != c0, axis=(1, 4)))  # [layers, pages, slots]
    moved[LAYER, pg, sl] = False
    if moved.any():
      ok = np.argwhere(moved)[:4].tolist()
      raise AssertionError(f"written outside the live slots: (layer, page, slot) {ok}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--iters", type=int, default=20)
  a = ap.parse_args()
  rng = np.random.default_rng()
  key = jax.random.key(int(rng.integers(1 << 31)))
  shape = (LAYERS, HKV, PAGES, PAGE, HD)
  kc0, vc0 = (jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key))  # 23 GB
  rows = []
  for case, lengths in CASES.items():
    page, slot, valid, k, v, _ = inputs(lengths, rng)
    for name, write in IMPLS.items():
      if name.startswith("drop"):  # correct before timed (the scratch write is wrong by design)
        out = jax.jit(write, static_argnums=2)(kc0, vc0, LAYER, page, slot, valid, k, v)
        check(kc0, vc0, *out, page, slot, valid, k, v)
        del out
      f = jax.jit(write, static_argnums=2, donate_argnums=(0, 1))
      cache = [jnp.copy(kc0), jnp.copy(vc0)]

      def call(*xs):
        cache[:] = f(cache[0], cache[1], LAYER, *xs)
        return cache
      xs = (page, slot, valid, k, v)
      for _ in range(2):
        jax.block_until_ready(call(*xs))
      us = [1e6 * sum(s for _, s in bench.cupti_kernels(call, xs)) for _ in range(a.iters)]
      rows.append({"case": case, "write": name, "valid_tokens": int(sum(lengths)),
                   "us": float(np.median(us)), "us_max": max(us)})
      del cache
  by = {(r["case"], r["write"]): r["us"] for r in rows}
  for r in rows:
    r["vs_ours"] = r["us"] / by[(r["case"], "drop (ours)")]
  cols = ["case", "write", "valid_tokens", "us", "us_max", "vs_ours"]
  bench.write(a.out, "kv_write", rows, cols,
              "PYTHONPATH=. python3 bench/studies/kv_write.py --out DIR")
  print(bench.table(rows, cols))


if __name__ == "__main__":
  main()
