"""fp8 (W8A8) accuracy: logits of ``--quantization fp8`` against bf16.

On the embedded SmolLM2-135M-Instruct (and the tiny random config), over a
passage of real English (this repository's README, ``--tokens`` positions):
for each pair of weight formats, teacher-forced logits at every position
(one prefill), reported as the mean and max over positions of the relative
error ||ours - ref|| / ||ref||, the max over positions of max|ours - ref| /
max|ref|, and the top-1 agreement; then a greedy continuation of the
passage's first 32 tokens (``--greedy`` new tokens) and the position where it
first leaves the reference's. Pairs: fp8 vs bf16 (the question), bf16 vs
float32 (what bf16 itself costs), fp8 vs float32. The figures are numerics,
not speed: they are the same on any device (the xla backend runs the fp8
products; the mosaic kernel matches it to rounding, tests/models/test_fp8.py).

  PYTHONPATH=. python3 bench/fp8_accuracy.py --out DIR [--tokens 256] [--greedy 256]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

import models
from models import model as model_lib
from mosaic import bench

REPO = pathlib.Path(__file__).resolve().parent.parent
FORMATS = {"float32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
           "fp8": dict(dtype="bfloat16", quantization="fp8")}
PAIRS = (("fp8", "bf16"), ("bf16", "float32"), ("fp8", "float32"))


def all_logits(model, ids, page=16):
  pages = -(-len(ids) // page)
  cache = model.init_cache(pages + 1, page)
  logits, _ = model.prefill(cache, np.asarray([ids], np.int32), [0], [len(ids)],
                            np.arange(1, pages + 1, dtype=np.int32)[None], all_logits=True)
  out = np.asarray(logits[0], np.float64)
  if not np.isfinite(out).all():
    raise SystemExit("non-finite logits")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--tokens", type=int, default=256)
  p.add_argument("--greedy", type=int, default=256)
  p.add_argument("--models", default="default,tiny")
  a = p.parse_args(argv)
  text = (REPO / "README.md").read_text()
  rows = []
  for spec in a.models.split(","):
    loaded = {name: models.load(spec, **kw) for name, kw in FORMATS.items()}
    ids = loaded["float32"].tokenizer.encode(text)[:a.tokens + 1]
    logits = {name: all_logits(m, ids) for name, m in loaded.items()}
    greedy = {name: model_lib.generate(m, ids[:32], a.greedy, stop_at_eos=False)
              for name, m in loaded.items()}
    for ours, ref in PAIRS:
      x, r = logits[ours], logits[ref]
      rel = np.linalg.norm(x - r, axis=-1) / np.linalg.norm(r, axis=-1)
      peak = np.abs(x - r).max(-1) / np.abs(r).max(-1)
      same = [i for i, (u, v) in enumerate(zip(greedy[ours], greedy[ref])) if u != v]
      rows.append(dict(model=loaded["float32"].config.name, ours=ours, ref=ref,
                       positions=len(ids), mean_rel=float(rel.mean()), max_rel=float(rel.max()),
                       max_abs_over_max=float(peak.max()),
                       top1_agree=float((x.argmax(-1) == r.argmax(-1)).mean()),
                       greedy_tokens=a.greedy, greedy_first_diff=same[0] if same else None))
      print(rows[-1], flush=True)
  cols = ["model", "ours", "ref", "positions", "mean_rel", "max_rel", "max_abs_over_max",
          "top1_agree", "greedy_tokens", "greedy_first_diff"]
  command = "python3 bench/fp8_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:])
  _, md = bench.write(a.out, "fp8_accuracy", rows, cols, command)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
