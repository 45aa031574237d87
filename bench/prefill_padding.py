"""What prefill calls compute for a prompt load: real tokens against tokens
run (rows x chunk bucket, or a packed call's bucket), and the calls it takes.

The engine's scheduler over the counting runner (no model: the shapes it
dispatches do not depend on one), 64 prompts submitted at once, each with a
few tokens to generate, stepped dry; every prefill call's token array is
recorded. Layouts: the row layout as the engine runs it, the row layout
without ``Scheduler.fit_buckets`` (each call padded to its longest chunk's bucket),
and packed. The chunk settings are the 8B serving benchmark's
(``bench/serving_gpu.py``: chunks up to 2,048 tokens, buckets from 512, 4
prompts a call). On a GPU a call's matmuls cost its tokens run (prefill is
compute-bound at these sizes); each call also reads the weights once.

  PYTHONPATH=. python3 bench/prefill_padding.py --out DIR [--loads 256-768,600-1000,512-512]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys

import numpy as np

from mosaic import bench


def run(layout: str, lo: int, hi: int, *, prompts: int, chunk: int, min_chunk: int, rows: int,
        seed: int = 0) -> dict:
  from serving import engine as E
  from serving.engine import api

  rng = random.Random(seed)
  engine = E.tiny_engine(num_pages=8192, page_size=16, max_context=2 * chunk + 64, max_batch=64,
                         prefill_chunk=chunk, min_chunk=min_chunk, prefill_rows=rows,
                         packed_prefill=layout == "packed", warmup=False)
  if layout == "rows, uncut":
    engine.scheduler.fit_buckets = lambda chunks: chunks
  calls = []
  for name in ("prefill", "prefill_packed"):
    f = getattr(engine.runner, name)
    setattr(engine.runner, name, lambda t, *a, _f=f, **kw: calls.append(np.size(t)) or _f(t, *a, **kw))
  real = 0
  for i in range(prompts):
    n = rng.randint(lo, hi)
    real += n
    engine.submit(api.Request(f"r{i}", prompt_ids=[rng.randrange(97, 123) for _ in range(n)],
                              add_bos=False,
                              sampling=api.SamplingParams(max_tokens=4, ignore_eos=True)))
  while engine.step():
    pass
  assert engine.stats().pages_in_use == 0
  return {"load": f"{lo}-{hi}", "layout": layout, "real_tokens": real, "run_tokens": sum(calls),
          "run_per_real": sum(calls) / real, "calls": len(calls)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/prefill_padding"))
  ap.add_argument("--loads", default="256-768,600-1000,512-512",
                  help="prompt length ranges lo-hi, drawn uniformly")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--chunk", type=int, default=2048)
  ap.add_argument("--min-chunk", type=int, default=512)
  ap.add_argument("--rows", type=int, default=4)
  a = ap.parse_args()
  rows = []
  for load in a.loads.split(","):
    lo, hi = map(int, load.split("-"))
    for layout in ("rows, uncut", "rows", "packed"):
      rows.append(run(layout, lo, hi, prompts=a.prompts, chunk=a.chunk, min_chunk=a.min_chunk,
                      rows=a.rows))
      print(rows[-1], flush=True)
  cols = ["load", "layout", "real_tokens", "run_tokens", "run_per_real", "calls"]
  bench.write(pathlib.Path(a.out), "prefill_padding", rows, cols,
              "PYTHONPATH=. python3 bench/prefill_padding.py " + " ".join(sys.argv[1:]))
  print("\n" + bench.table(rows, cols))


if __name__ == "__main__":
  main()
