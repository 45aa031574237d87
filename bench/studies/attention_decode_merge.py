"""The B=1 decode step's attention: the kernel and the merge of its splits.

In the model's B=1 decode step (Llama-3-8B heads: Hq 32, Hkv 8, D 128) the
attention is ``attention_decode_append``: our kernel writes each split's
float32 partial output and log-sum-exp, then XLA merges the splits
(``attention_decode._combine``). At the served context
(a few hundred keys in a table of 32 pages) the kernel and the merge are
latency, not bandwidth: ~4.9 us and ~2.8 us a layer in the step's trace
(two merge kernels, before the merge took every term to the output's shape).

Part 1 times merge formulations, each as the step runs it (merge, unpack,
bf16), on fresh random partials with some splits empty (lse = -inf), after
checking each against a float64 numpy merge; it prints the kernels XLA
emits for each. Part 2 times the whole append op at B=1 under a few configs
(split counts, step lengths), each checked against the float32 reference
first, L2-cold (rotating caches). Times are CUPTI medians, kernel by kernel.

  PYTHONPATH=. python3 bench/studies/attention_decode_merge.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kernels import attention_decode as ad
from kernels import attention_decode_append as ada
from mosaic import bench, testing

HKV, G, D = 8, 4, 128


# --------------------------------------------------------------------------
# Merge formulations: o_parts [S, B, Hkv, R, D], lse [S, B, Hkv, R] (log2) ->
# [B, Hkv, R, D] float32.


def merge_lse_shape(o_parts, lse):
  """The merge before: weights at lse's shape, broadcast over D where they
  multiply the partials (XLA: two kernels)."""
  parts = range(lse.shape[0])
  mx = functools.reduce(jnp.maximum, [lse[s] for s in parts])
  safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
  w = [jnp.exp2(lse[s] - safe) for s in parts]
  den = functools.reduce(jnp.add, w)
  num = functools.reduce(jnp.add, [w[s][..., None] * o_parts[s] for s in parts])
  return jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def merge_online(o_parts, lse):
  """Splits folded in one at a time (running max, sum and output), every
  term at the output's shape."""
  lf = jnp.broadcast_to(lse[..., None], o_parts.shape)
  m, den, num = lf[0], jnp.ones_like(lf[0]), o_parts[0]
  for s in range(1, lse.shape[0]):
    m2 = jnp.maximum(m, lf[s])
    safe = jnp.where(jnp.isfinite(m2), m2, 0.0)
    a, b = jnp.exp2(m - safe), jnp.exp2(lf[s] - safe)
    den, num, m = den * a + b, num * a + o_parts[s] * b, m2
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


MERGES = {"weights at lse's shape (before)": merge_lse_shape,
          "every term at the output's shape (attention_decode._combine)": ad._combine,
          "online": merge_online}


def merge_numpy(o_parts, lse):
  o, l = np.asarray(o_parts, np.float64), np.asarray(lse, np.float64)
  mx = l.max(0)
  safe = np.where(np.isfinite(mx), mx, 0.0)
  w = np.exp2(l - safe[None])
  den = w.sum(0)
  num = (w[..., None] * o).sum(0)
  return np.where(den[..., None] > 0, num / np.where(den > 0, den, 1.0)[..., None], 0.0)


def merge_inputs(splits, b, seed, empty):
  o, = testing.random_inputs([(splits, b, HKV, G, D)], jnp.float32, seed=seed)
  lse = jax.random.normal(testing.fresh_key(seed), (splits, b, HKV, G), jnp.float32) * 4 + 10
  # The last ``empty`` splits held no key (a context shorter than the table).
  lse = lse.at[splits - empty:].set(-jnp.inf)
  return o, lse


def as_in_step(merge):
  def f(o_parts, lse):
    return ad._unpack_o(merge(o_parts, lse), 1, HKV * G).astype(jnp.bfloat16)
  return jax.jit(f)


def part_merge(iters):
  rows = []
  for splits, empty in ((16, 11), (8, 3)):
    sets = [merge_inputs(splits, 1, seed, empty) for seed in range(4)]
    want = merge_numpy(*sets[0]).reshape(1, 1, HKV * G, D)
    for name, merge in MERGES.items():
      f = as_in_step(merge)
      err = testing.rel_error(f(*sets[0]), want)
      ok = bool(np.isfinite(err) and err < 1e-2)
      row = {"part": "merge", "splits": splits, "empty": empty, "merge": name, "rel_err": err,
             "correct": ok}
      if ok:
        ks = bench.time_jax_kernels(f, sets, iters=iters, warmup=2)
        row.update(kernels=[[n, round(s * 1e6, 3)] for n, s in ks],
                   us=round(sum(s for _, s in ks) * 1e6, 3))
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


# --------------------------------------------------------------------------
# The append op at B=1, the served table (max_seq_len 4096, 128-token pages).


def append_inputs(length, table_pages, page, seed):
  rng = np.random.default_rng(seed)
  num_pages = table_pages + 1
  table = rng.permutation(np.arange(1, num_pages))[:table_pages].reshape(1, -1)
  qkv, kp, vp = testing.random_inputs(
      [(1, 1, HKV, G + 2, D), (2, HKV, num_pages, page, D), (2, HKV, num_pages, page, D)],
      jnp.bfloat16, seed=seed)
  ang = jnp.asarray(rng.uniform(0, 2 * np.pi, (1, D // 2)), jnp.float32)
  rope = ada.rope_table(jnp.cos(ang), jnp.sin(ang))
  return qkv, kp, vp, jnp.asarray([length], jnp.int32), jnp.asarray(table, jnp.int32), rope


CONFIGS = {
    "auto": None,
    "splits=8": ad.Config(pages_per_step=1, steps_per_page=1, stages=2, splits=8, swap_ab=True),
    "splits=4": ad.Config(pages_per_step=1, steps_per_page=1, stages=2, splits=4, swap_ab=True),
    "splits=1 stages=4": ad.Config(pages_per_step=1, steps_per_page=1, stages=4, splits=1,
                                   swap_ab=True),
    "64-key steps, splits=16": ad.Config(pages_per_step=1, steps_per_page=2, stages=2,
                                         splits=16, swap_ab=True),
    "64-key steps, splits=8": ad.Config(pages_per_step=1, steps_per_page=2, stages=2,
                                        splits=8, swap_ab=True),
    "64-key steps, splits=8, 3 stages": ad.Config(pages_per_step=1, steps_per_page=2, stages=3,
                                                  splits=8, swap_ab=True),
}


def part_append(iters, lengths, table_pages):
  page = ad.DEFAULT_PAGE_SIZE
  rows = []
  for length in lengths:
    n_sets = bench.cold_sets(2 * 2 * HKV * (table_pages + 1) * page * D * 2)
    sets = [append_inputs(length, table_pages, page, seed) for seed in range(n_sets)]
    ref = ada.attention_decode_append_reference(*sets[0], layer=1)[0]
    for name, cfg in CONFIGS.items():
      f = jax.jit(functools.partial(ada.attention_decode_append_mosaic, layer=1, config=cfg))
      row = {"part": "append", "length": length, "table_pages": table_pages, "config": name}
      try:
        err = testing.rel_error(f(*sets[0])[0], ref)
        row.update(rel_err=err, correct=bool(np.isfinite(err) and err < 2e-2))
        if row["correct"]:
          # The op updates the caches in place; the step donates them, this timing
          # reuses them, so XLA copies them first: those copies are left out.
          ks = bench.time_jax_kernels(f, sets, iters=iters, warmup=1,
                                      drop=lambda name: "memcpy" in name)
          row.update(kernels=[[n, round(s * 1e6, 3)] for n, s in ks],
                     us=round(sum(s for _, s in ks) * 1e6, 3))
      except Exception as e:  # a config the kernel refuses: recorded, not fatal
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=50)
  p.add_argument("--lengths", default="600,4096")
  p.add_argument("--table-pages", type=int, default=32)
  p.add_argument("--no-merge", action="store_true", help="the append op's configs only")
  a = p.parse_args(argv)
  rows = [] if a.no_merge else part_merge(a.iters)
  rows += part_append(a.iters, [int(x) for x in a.lengths.split(",")], a.table_pages)
  path = pathlib.Path(a.out)
  path.mkdir(parents=True, exist_ok=True)
  (path / "attention_decode_merge.json").write_text(
      json.dumps({"env": bench.environment(), "rows": rows}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
