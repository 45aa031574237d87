"""Scoring a prompt chunk's positions (``sampling.prompt_scores``) on the GPU:
where the time of ``--enable-prompt-logprobs`` calls goes beyond the prefill.

Float32 logits [T, V] at Llama-3's vocabulary (fresh normal draws), the next
prompt token as target. Each form is checked against the float32 numpy
reference (target logprobs, and the 5 likeliest ids and logprobs) before it
is timed (CUPTI device time, median, two input sets):
- ``lax.top_k`` (ours): log_softmax, the target's entry, ``lax.top_k(lp, 5)``;
- ``argmax x 5``: the same with the 5 likeliest taken by 5 argmax passes,
  each masking the previous pick;
- ``no top-k``: log_softmax and the target's entry only (what scoring costs
  without alternatives).

  PYTHONPATH=. python3 bench/prompt_scores.py --out DIR [--small]
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mosaic import bench
from serving.engine import sampling

K = sampling.MAX_TOP_LOGPROBS


def argmax_top(lp, k):
  """The k largest of each row (values, ids) by k argmax passes."""
  rows = jnp.arange(lp.shape[0])
  vals, ids = [], []
  for _ in range(k):
    i = jnp.argmax(lp, axis=-1)
    vals.append(lp[rows, i])
    ids.append(i.astype(jnp.int32))
    lp = lp.at[rows, i].set(-jnp.inf)
  return jnp.stack(vals, -1), jnp.stack(ids, -1)


def with_argmax(logits, targets):
  lp = jax.nn.log_softmax(logits, axis=-1)
  top_lp, top_ids = argmax_top(lp, K)
  return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0], top_ids, top_lp


def no_top(logits, targets):
  lp = jax.nn.log_softmax(logits, axis=-1)
  return (jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0],)


IMPLS = {"lax.top_k (ours)": lambda x, t: sampling.prompt_scores(x[None], t[None]),
         "argmax x 5": with_argmax, "no top-k": no_top}


def check(out, logits, targets):
  x = np.asarray(logits, np.float64)
  lp = x - x.max(-1, keepdims=True)
  lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
  want = lp[np.arange(len(x)), np.asarray(targets)]
  out = [np.asarray(o).reshape(len(x), -1) for o in out]
  if not np.allclose(out[0][:, 0], want, atol=1e-4):
    raise AssertionError("target logprobs differ from the reference")
  if len(out) > 1:
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :K]
    if not np.allclose(out[2], np.take_along_axis(lp, order, -1), atol=1e-4):
      raise AssertionError("top logprobs differ from the reference")
    if not np.array_equal(np.take_along_axis(lp, out[1], -1), np.take_along_axis(lp, order, -1)):
      raise AssertionError("top ids are not the likeliest")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
  args = p.parse_args(argv)
  command = "python3 bench/prompt_scores.py " + " ".join(argv or sys.argv[1:])
  shapes = [(64, 1000)] if args.small else [(512, 128256), (2048, 128256)]
  rows = []
  for t, v in shapes:
    keys = jax.random.split(jax.random.key(t), 4)
    sets = [(jax.random.normal(keys[2 * i], (t, v), jnp.float32) * 3,
             jax.random.randint(keys[2 * i + 1], (t,), 0, v, jnp.int32)) for i in range(2)]
    for name, f in IMPLS.items():
      jf = jax.jit(f)
      row = {"T": t, "V": v, "impl": name}
      check(jf(*sets[0]), *sets[0])
      s = bench.time_jax(jf, sets).median_s
      row["ms"] = s * 1e3
      row["GBps_logits"] = t * v * 4 / s / 1e9  # one read of the logits
      rows.append(row)
      print(row, flush=True)
  bench.write(args.out, "prompt_scores", rows, ("T", "V", "impl", "ms", "GBps_logits"), command)
  print(bench.table(rows, ("T", "V", "impl", "ms", "GBps_logits")))


if __name__ == "__main__":
  main()
