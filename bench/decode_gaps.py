"""Where a back-to-back decode step idles: kernel durations and the gaps
between kernels in a trace of consecutive steps (no profiler-only settings).

The model's decode step (Llama-3-8B shapes, random weights, the engine's
runner) runs ``--steps`` times back to back at batch ``--batch`` under
jax.profiler.trace, as a pipelined engine issues it: the host enqueues each
call without waiting. From the device's kernels (serving.profiler.parse_trace)
it reports, per step: the span, the kernels' busy time, the idle time, and the
idle time before each kind of kernel (ours: a Mosaic GPU kernel; an XLA
fusion; the rest), with the kernels' median durations by name.

The first traced step is dropped (the host may not be ahead yet). Run it once
as is and once under another ``XLA_FLAGS`` to compare settings.

  PYTHONPATH=. python3 bench/decode_gaps.py --out DIR [--tag T] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serving_gpu import apply_model_flags, flags_model, flags_num_pages, model_flags  # noqa: E402


def kind(name: str) -> str:
  if "mosaic" in name:
    return "mosaic"
  if "fusion" in name:
    return "xla_fusion"
  return "other"


def analyse(kernels, steps: int) -> dict:
  """Per-step idle time from kernels [(ts us, dur us, name, stream)] of
  ``steps`` consecutive calls: equal shares of the kernels when they divide
  evenly (each call runs the same ones), else a step starts at each kernel
  named like the trace's first."""
  kernels = sorted(kernels)
  if len(kernels) % steps == 0:
    # Every call runs the same kernels.
    starts = [i * (len(kernels) // steps) for i in range(steps)]
  else:
    first = kernels[0][2]
    starts = [i for i, k in enumerate(kernels) if k[2] == first]
  bounds = list(zip(starts, starts[1:] + [len(kernels)]))
  per_step, gaps_by_kind, gaps_by_name, durs = [], collections.defaultdict(list), \
      collections.defaultdict(list), collections.defaultdict(list)
  for s, (i, j) in enumerate(bounds):
    ks = kernels[i:j]
    span = ks[-1][0] + ks[-1][1] - ks[0][0]
    busy = sum(k[1] for k in ks)
    # Idle before a kernel: time since the latest end of anything before it
    # (negative when kernels overlap, e.g. on two streams).
    idle, end = collections.defaultdict(float), ks[0][0]
    for k in ks:
      gap = k[0] - end
      if s > 0:
        gaps_by_kind[kind(k[2])].append(gap)
        gaps_by_name[k[2]].append(gap)
        durs[k[2]].append(k[1])
      idle[kind(k[2])] += max(gap, 0.0)
      end = max(end, k[0] + k[1])
    per_step.append({"kernels": len(ks), "span_us": span, "busy_us": busy,
                     "idle_us": sum(idle.values()), "idle_before_us": dict(idle),
                     "streams": len({k[3] for k in ks})})
  steady = per_step[1:] or per_step
  i, j = bounds[1] if len(bounds) > 1 else bounds[0]
  ends = [0.0] + [k[0] + k[1] for k in kernels]  # ends[n]: the end of kernel n - 1
  sequence = [{"name": k[2], "dur_us": k[1], "gap_us": k[0] - ends[n] if n else 0.0}
              for n, k in zip(range(i, j), kernels[i:j])]
  med = lambda key: statistics.median(p[key] for p in steady)
  return {
      "steps_traced": len(per_step),
      "step_span_us": med("span_us"), "step_busy_us": med("busy_us"),
      "step_idle_us": med("idle_us"),
      "idle_before_us": {k: statistics.median(p["idle_before_us"].get(k, 0.0) for p in steady)
                         for k in ("mosaic", "xla_fusion", "other")},
      "gap_median_us_by_kind": {k: statistics.median(v) for k, v in gaps_by_kind.items()},
      "count_per_step_by_kind": {k: len(v) / max(1, len(steady)) for k, v in gaps_by_kind.items()},
      "by_name": {n: {"count_per_step": len(durs[n]) / max(1, len(steady)),
                      "dur_median_us": statistics.median(durs[n]),
                      "gap_before_median_us": statistics.median(gaps_by_name[n])}
                  for n in sorted(durs, key=lambda n: -sum(durs[n]))},
      "per_step": per_step,
      "sequence": sequence,  # the second step's kernels in order
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--tag", default="default")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--context", type=int, default=600)
  ap.add_argument("--steps", type=int, default=6)
  model_flags(ap)
  a = ap.parse_args()
  apply_model_flags(a)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  from serving import engine as E
  from serving import profiler

  model = flags_model(a)
  page = E.default_page_size()
  num_pages = flags_num_pages(a, model, page)
  runner = E.ModelRunner(model, num_pages=num_pages, page_size=page, attention=a.attention,
                         matmul=a.matmul, kv_cache_dtype=a.kv_cache_dtype)
  b, per_row = a.batch, -(-a.context // page)
  table = np.zeros((b, -(-4096 // page)), np.int32)
  table[:, :per_row] = 1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
  ids = np.random.default_rng(0).integers(0, min(1000, runner.vocab_size), b)
  tokens = jax.numpy.asarray(ids, jax.numpy.int32)
  lengths = np.full((b,), a.context, np.int32)
  f = lambda: runner.decode(tokens, lengths, table)
  logits = np.asarray(jax.block_until_ready(f()), np.float32)
  if not np.isfinite(logits).all():
    bad = np.argwhere(~np.isfinite(logits))
    raise SystemExit(f"the decode step's logits are not finite: {logits.shape}, "
                     f"at {bad[:4].tolist()}")
  for _ in range(5):
    o = f()
  jax.block_until_ready(o)
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(a.steps):
        o = f()
      jax.block_until_ready(o)
    tr = profiler.parse_trace(profiler.find_trace_file(tmp))
  kernels = [(k.ts, k.dur, k.name, k.tid) for k in tr.kernels]
  res = {"tag": a.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""), "batch": b,
         "decode_append": a.decode_append,
         "context": a.context, "jax": jax.__version__,
         "device": jax.devices()[0].device_kind,
         "logits": {"argmax": logits.argmax(-1).ravel()[:8].tolist(),
                    "sum": float(np.sum(logits, dtype=np.float64))},
         **analyse(kernels, a.steps)}
  (out / f"decode_gaps_{a.tag}_b{b}.json").write_text(json.dumps(res, indent=1))
  summary = {k: v for k, v in res.items() if k not in ("by_name", "per_step", "sequence")}
  print(json.dumps(summary, indent=1))
  for n, v in list(res["by_name"].items())[:25]:
    print(f"  {n[:60]:60s} x{v['count_per_step']:5.1f} dur {v['dur_median_us']:7.2f} "
          f"gap {v['gap_before_median_us']:6.2f}")


if __name__ == "__main__":
  main()
