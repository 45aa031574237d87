"""Tensor parallelism against one device: the same tokens, and what it buys.

For a named config with random bf16 weights (default llama3.1-8b), the model
is built at TP=1 and at TP=N (``--tp``, default 2) from the same draw
(``models.load``), both on the mosaic backends:

1. Correctness first. ``--prompts`` random prompts of 64 tokens each
   continue greedily for ``--tokens`` tokens (``models.generate``) on both.
   The TP=N tokens must equal TP=1's; over the tokens both chose, the
   logits must stay within ``--tol`` x max|logit| of TP=1's (the two sum the
   row-parallel matmuls in another order, in float32). A failure is a row
   with its error, and no timing follows.
2. Decode steps at batch 1 and 64, 512 tokens of context (bench/model.py's
   wall-time step loop, medians): TPOT at B=1 and tokens/s at B=64 for each
   TP, their ratios beside the targets (TPOT <= 0.6x, B=64 >= 1.6x), and
   each step against its HBM bound (one device's weights and KV bytes at the
   target's bandwidth).

``--no-tp1`` skips TP=1 (a model that fits only split, e.g. llama3.1-70b on
two H200s): only TP=N's steps and bound are reported.

  PYTHONPATH=. python3 bench/tensor_parallel.py --out DIR [--config llama3.1-8b] [--tp 2]
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
    PYTHONPATH=. python3 bench/tensor_parallel.py --out DIR --config tiny --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np

BACKENDS = dict(attention="mosaic", matmul="mosaic", norm="mosaic")
BATCHES = (1, 64)
TARGETS = {"tpot_ratio_max": 0.6, "b64_throughput_ratio_min": 1.6}


def check_tokens(one, many, prompts: int, tokens: int, tol: float, seed: int, backends):
  """Greedy continuations on both models: a row per prompt."""
  import models

  rng = np.random.default_rng(seed)
  vocab = one.config.vocab_size
  rows = []
  for i in range(prompts):
    prompt = rng.integers(3, vocab, 64).tolist()
    a, la = models.generate(one, prompt, tokens, stop_at_eos=False, return_logits=True, **backends)
    b, lb = models.generate(many, prompt, tokens, stop_at_eos=False, return_logits=True, **backends)
    la, lb = np.asarray(la, np.float32), np.asarray(lb, np.float32)
    same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    n = max(1, same)  # the logits that chose the same tokens (and the first that differ)
    worst = float(np.max(np.abs(lb[:n] - la[:n])) / np.max(np.abs(la[:n])))
    row = {"prompt": i, "tokens": len(a), "agree": same, "logit_diff_over_max": worst}
    if not np.isfinite(lb).all():
      row["error"] = "NaN or inf in the TP logits"
    elif same < len(a):
      row["error"] = f"token {same} differs: {a[same]} at TP=1, {b[same]}"
    elif not worst <= tol:
      row["error"] = f"logits differ by {worst:.2e} x max|logit| > {tol}"
    rows.append(row)
  return rows


def step_rows(model, tp: int, iters: int, context: int, batches, page_size: int, backends):
  from bench.model import _steps
  from mosaic import target as target_lib

  cfg = model.config
  gbps = target_lib.current().ceilings.hbm_gbps
  rows = []
  for batch in batches:
    times, logits = _steps(model, "decode", batch, context, backends, page_size, iters)
    med = statistics.median(times)
    # One device reads its share of the weights and of the KV heads each step.
    kv = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * batch * context
    bound = (2 * cfg.num_params() + kv) / tp / (gbps * 1e9)
    row = {"tp": tp, "batch": batch, "context": context, "ms": med * 1e3,
           "min_ms": min(times) * 1e3, "tok_s": batch / med, "hbm_bound_ms": bound * 1e3,
           "of_bound": bound / med, "timer": "wall"}
    if not np.isfinite(logits).all():
      row["error"] = "NaN or inf in the logits"
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, type=pathlib.Path)
  ap.add_argument("--config", default="llama3.1-8b", help="named config (random weights)")
  ap.add_argument("--tp", type=int, default=2)
  ap.add_argument("--no-tp1", action="store_true", help="only TP=N (a model too big for one)")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--tol", type=float, default=1e-2)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--context", type=int, default=512)
  ap.add_argument("--seed", type=int, default=None, help="prompts' seed (default: fresh)")
  ap.add_argument("--quick", action="store_true",
                  help="CPU check: xla backends, 2 prompts of 4 tokens, batch 1 and 4")
  a = ap.parse_args(argv)
  if a.tp < 2:
    ap.error(f"--tp {a.tp}: tensor parallelism compares 2 or more devices with one")

  import jax

  import models
  from models import jitted, kv_cache
  from mosaic import bench

  backends, batches, ps = BACKENDS, BATCHES, kv_cache.DEFAULT_PAGE_SIZE
  if a.quick:
    backends = dict(attention="xla", matmul="xla", norm="xla")
    a.prompts, a.tokens, a.iters, a.context, batches, ps = 2, 4, 2, 40, (1, 4), 16
  if len(jax.devices()) < a.tp:
    sys.exit(f"--tp {a.tp} needs {a.tp} devices; this machine has {len(jax.devices())} "
             f"({jax.devices()[0].device_kind})")
  seed = a.seed if a.seed is not None else int(np.random.default_rng().integers(1 << 30))
  dtype = "float32" if a.quick else "bfloat16"
  many = models.load(a.config, dtype=dtype, tp=a.tp)
  one = None if a.no_tp1 else models.load(a.config, dtype=dtype)
  rows, failed = [], False
  summary = {"config": a.config, "tp": a.tp, "device": jax.devices()[0].device_kind,
             "devices": len(jax.devices()), "seed": seed, "backends": backends}
  if one is not None:
    checks = check_tokens(one, many, a.prompts, a.tokens, a.tol, seed, backends)
    rows += [{"part": "tokens"} | r for r in checks]
    failed = any("error" in r for r in checks)
    summary["tokens_agree"] = not failed
    summary["worst_logit_diff_over_max"] = max(r["logit_diff_over_max"] for r in checks)
  if not failed:
    steps = {}
    for tp, model in ((1, one), (a.tp, many)):
      if model is not None:
        steps[tp] = step_rows(model, tp, a.iters, a.context, batches, ps, backends)
        rows += [{"part": "decode"} | r for r in steps[tp]]
    failed = any("error" in r for rs in steps.values() for r in rs)
    if 1 in steps:
      lo, hi = batches[0], batches[-1]
      by = {(r["tp"], r["batch"]): r for rs in steps.values() for r in rs}
      summary[f"tpot_ratio_b{lo}"] = by[(a.tp, lo)]["ms"] / by[(1, lo)]["ms"]
      summary[f"throughput_ratio_b{hi}"] = by[(a.tp, hi)]["tok_s"] / by[(1, hi)]["tok_s"]
      summary["targets"] = TARGETS
  rows.append({"part": "summary", "summary": json.dumps(summary)})
  print(json.dumps(summary), flush=True)
  cols = ["part", "prompt", "tokens", "agree", "logit_diff_over_max", "tp", "batch", "context",
          "ms", "min_ms", "tok_s", "hbm_bound_ms", "of_bound", "timer", "error", "summary"]
  bench.write(a.out, f"tensor_parallel_{a.config}_tp{a.tp}", rows, cols,
              " ".join(sys.argv if argv is None else ["bench/tensor_parallel.py", *argv]))
  print(bench.table(rows, cols))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
