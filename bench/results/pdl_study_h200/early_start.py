"""Does a programmatic dependent launch (PDL) shorten the model's decode step?

With ``early_start`` (rms_norm, attention_decode) and ``prefetch`` (matmul)
set, each of our kernels lets the next one launch at its start, and each
waits for the previous one's results only after its own launch (and, for a
matmul, an L2 prefetch of its first weight blocks): the start-up of every
short decode kernel overlaps the tail of the one before.

This builds the Llama-3-8B-shaped random bf16 model once and, per variant,
fresh jitted decode steps with the kernels' configs patched; it checks the
variant's logits against the plain kernels' (same kernels, same order: they
must agree to bf16 rounding), then times the decode step back to back (the
pipelined engine's steady state) at each batch, context 600.

  PYTHONPATH=. python3 bench/early_start.py --out $OUT [--prefetch 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serving_gpu import random_model  # noqa: E402


def patch(prefetch: int, early: bool, mm_early: bool):
  """Sets the PDL fields on every config the three kernels pick."""
  import kernels
  from kernels import attention_decode as ad
  from kernels import matmul as mm
  from kernels import rms_norm as rn

  kernels.load_all()
  orig = getattr(patch, "orig", None)
  if orig is None:
    orig = patch.orig = (mm.pick_config, rn._pick_config, ad._pick_config)
  mm.pick_config = lambda *a, **k: dataclasses.replace(orig[0](*a, **k), prefetch=prefetch,
                                                                  early_start=mm_early)
  rn._pick_config = lambda *a, **k: dataclasses.replace(orig[1](*a, **k), early_start=early)
  ad._pick_config = lambda *a, **k: dataclasses.replace(orig[2](*a, **k), early_start=early)
  jax.clear_caches()


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--config", default="llama3.1-8b")
  ap.add_argument("--batches", default="1,16,64")
  ap.add_argument("--context", type=int, default=600)
  ap.add_argument("--prefetch", default="1", help="matmul prefetch values to try, e.g. 2,4")
  ap.add_argument("--iters", type=int, default=30)
  ap.add_argument("--num-pages", type=int, default=700)
  a = ap.parse_args()
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  from serving import engine as E

  model = random_model(a.config, "bfloat16")
  page = E.default_page_size()
  per_row = -(-a.context // page)
  max_pages = per_row + 1
  # (name, matmul prefetch, norm/attention early start, matmul early start)
  variants = [("off", 0, False, False), ("norm_attn_only", 0, True, False),
              ("all_no_prefetch", 0, True, True)]
  variants += [(f"all_p{p}", int(p), True, True) for p in a.prefetch.split(",") if int(p)]
  variants += [("off_again", 0, False, False)]
  res = {"card": jax.devices()[0].device_kind, "jax": jax.__version__, "config": a.config,
         "context": a.context, "command": "PYTHONPATH=. python3 bench/early_start.py "
         + " ".join(sys.argv[1:]), "rows": []}
  ref = {}
  for name, prefetch, early, mm_early in variants:
    patch(prefetch, early, mm_early)
    runner = E.ModelRunner(model, num_pages=a.num_pages, page_size=page, attention="mosaic",
                           matmul="mosaic")
    for b in [int(x) for x in a.batches.split(",")]:
      if b * per_row >= a.num_pages:
        raise SystemExit(f"--num-pages {a.num_pages} is too few for {b} rows")
      rng = np.random.default_rng(b)
      tokens = jax.numpy.asarray(rng.integers(0, 1000, b), jax.numpy.int32)
      lengths = np.full((b,), a.context, np.int32)
      table = np.zeros((b, max_pages), np.int32)
      table[:, :per_row] = 1 + rng.permutation(b * per_row).reshape(b, per_row)
      f = lambda: runner.decode(tokens, lengths, table)  # noqa: E731
      logits = np.asarray(jax.block_until_ready(f()), np.float32)
      if not np.isfinite(logits).all():
        raise SystemExit(f"{name} B={b}: non-finite logits")
      if b not in ref:
        ref[b] = logits
      err = float(np.linalg.norm(logits - ref[b]) / np.linalg.norm(ref[b]))
      same_top1 = float(np.mean(logits.argmax(-1) == ref[b].argmax(-1)))
      times = []
      for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(a.iters):
          o = f()
        jax.block_until_ready(o)
        times.append((time.perf_counter() - t0) / a.iters * 1e3)
      row = {"variant": name, "batch": b, "step_ms": float(np.median(times)),
             "step_ms_all": times, "rel_err_vs_off": err, "top1_agree": same_top1}
      res["rows"].append(row)
      print(row, flush=True)
    del runner
  (out / "early_start.json").write_text(json.dumps(res, indent=1))
  lines = ["| variant | " + " | ".join(f"B={b} ms" for b in a.batches.split(",")) + " |",
           "|---|" + "---|" * len(a.batches.split(","))]
  for name, *_ in variants:
    ms = [f"{r['step_ms']:.3f}" for r in res["rows"] if r["variant"] == name]
    lines.append(f"| {name} | " + " | ".join(ms) + " |")
  (out / "early_start.md").write_text(
      f"# Decode step with PDL ({res['card']}, jax {res['jax']})\n\ncommand: `{res['command']}`\n\n"
      + "\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
