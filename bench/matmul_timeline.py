"""Where a decode matmul's time goes: fixed cost against streaming, and the
phases of each CTA on the device's clock.

For each ``--shapes`` entry (``name:M``, names as in bench/matmul.py) the
table's config is forced onto the shape with K cut to each ``--k-fracs``
fraction (fresh weights each; the output checked against the float32
reference first), and timed with device timers. A least-squares line
time = fixed + K * per_k gives the fixed cost of a call (launch, the first
copies' latency, the epilogue, the last CTA's tail) and the streaming rate
of the rest.

Then the full-K call runs once more inside ``dsl.kernel_timeline``: every
CTA stamps its named regions (``prologue``: the first ring copies issued;
``k_loop``; ``epilogue``: norm scale, bias, gate, residual, the transposed
store and its wait). A CTA's start is the global timer when its first
region opens; durations are SM clock cycles converted at ``--sm-mhz``. The
report gives the spread of CTA starts, each phase's median and maximum,
and the span from the first CTA's start to the last one's end, beside the
call's device time.

  PYTHONPATH=. python3 bench/matmul_timeline.py --out DIR [--shapes down:1,o:1]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from matmul import ACTIVATION, LAYERS, RMS, RMS_EPS, _input_sets, _ref, _rel_err  # noqa: E402

from kernels import matmul as mm  # noqa: E402
from mosaic import bench, dsl  # noqa: E402

PHASES = ("prologue", "k_loop", "epilogue")


def _call(cfg, activation, rms_eps):
  return lambda a, b: mm.matmul_mosaic(a, b, config=cfg, activation=activation, rms_eps=rms_eps)


def fit(ks, us):
  """Least squares us = fixed + per_k * k -> (fixed us, per_k us)."""
  per_k, fixed = np.polyfit(np.asarray(ks, float), np.asarray(us, float), 1)
  return float(fixed), float(per_k)


def phases(trace: dict, sm_mhz: float) -> dict:
  """Per-CTA phase times (ns) from a Mosaic GPU profiler trace."""
  per_cta: dict[int, list] = {}
  for ev in trace["traceEvents"]:
    per_cta.setdefault(ev["tid"], []).append(ev)
  to_ns = 1e6 / sm_mhz  # trace units: (global ns + SM cycles) / 1e3
  starts, ends, dur = [], [], {p: [] for p in PHASES}
  for evs in per_cta.values():
    t0 = evs[0]["ts"]
    starts.append(t0 * 1e3)
    ends.append(t0 * 1e3 + (evs[-1]["ts"] - t0) * to_ns)
    open_at = {}
    for ev in evs:
      if ev["ph"] == "B":
        open_at[ev["name"]] = ev["ts"]
      elif ev["name"] in dur:
        dur[ev["name"]].append((ev["ts"] - open_at[ev["name"]]) * to_ns)
  starts, ends = np.asarray(starts), np.asarray(ends)
  out = {"ctas": len(per_cta),
         "start_spread_ns": float(starts.max() - starts.min()),
         "span_ns": float(ends.max() - starts.min()),
         "cta_ns_median": float(np.median(ends - starts))}
  for p, v in dur.items():
    if v:
      out[f"{p}_ns_median"] = float(np.median(v))
      out[f"{p}_ns_max"] = float(np.max(v))
  return out


def run_shape(spec: str, fracs, iters: int, sm_mhz: float, out: pathlib.Path) -> dict:
  name, m = spec.split(":")
  m = int(m)
  k, n = LAYERS[name]
  activation = ACTIVATION.get(name)
  rms_eps = RMS_EPS if name in RMS else None
  cfg = mm.pick_config(m, n, k, "bfloat16", activation, rms=rms_eps is not None)
  f = _call(cfg, activation, rms_eps)
  row = {"shape": spec, "m": m, "n": n, "k": k, "config": str(cfg), "points": []}
  for i, frac in enumerate(fracs):
    kk = max(cfg.tile_k, int(round(k * frac / cfg.tile_k)) * cfg.tile_k)
    sets = _input_sets(jax.random.key(100 + i), m, n, kk)
    err = float(_rel_err(f(*sets[0]), _ref(*sets[0], activation=activation, rms_eps=rms_eps)))
    if not np.isfinite(err) or err > 2e-2:
      raise SystemExit(f"{spec} K={kk}: relative error {err}")
    t = bench.time_jax(f, sets, iters=iters)
    row["points"].append({"k": kk, "us": t.median_s * 1e6, "rel_err": err})
    print(f"{spec} K={kk}: {t.median_s * 1e6:.2f} us (err {err:.2e})", flush=True)
  ks = [p["k"] for p in row["points"]]
  fixed, per_k = fit(ks, [p["us"] for p in row["points"]])
  row["fixed_us"], row["stream_tb_s"] = fixed, (n * 2) / (per_k * 1e-6) / 1e12
  full = row["points"][0]
  row["tb_s"] = n * full["k"] * 2 / (full["us"] * 1e-6) / 1e12
  tdir = out / f"timeline_{name}_{m}"
  sets = _input_sets(jax.random.key(7), m, n, k)
  with dsl.kernel_timeline(tdir, events=16):
    jf = jax.jit(f)
    for s in sets[:2]:
      jax.block_until_ready(jf(*s))
  traces = sorted(tdir.glob("*-trace.json"), key=lambda p: p.stat().st_mtime)
  if traces:
    row["timeline"] = phases(json.loads(traces[-1].read_text()), sm_mhz)
    for p in traces[:-1]:
      p.unlink()  # keep the last run's trace only
  print(json.dumps(row), flush=True)
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/matmul_timeline")
  ap.add_argument("--shapes", default="down:1,o:1,qkv_rms:1,gate_up_swiglu_rms:1,down:16,down:64")
  ap.add_argument("--k-fracs", default="1,0.5,0.25,0.125")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--sm-mhz", type=float, default=1980.0, help="SM clock (nvidia-smi)")
  a = ap.parse_args(argv)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  fracs = [float(x) for x in a.k_fracs.split(",")]
  rows = [run_shape(s, fracs, a.iters, a.sm_mhz, out) for s in a.shapes.split(",")]
  cols = ["shape", "config", "tb_s", "fixed_us", "stream_tb_s"]
  lines = [bench.table([{c: r[c] for c in cols} | {"us": r["points"][0]["us"]}
                       | r.get("timeline", {}) for r in rows],
      cols + ["us", "ctas", "start_spread_ns", "span_ns", "prologue_ns_median",
              "k_loop_ns_median", "k_loop_ns_max", "epilogue_ns_median", "epilogue_ns_max"])]
  (out / "matmul_timeline.md").write_text("\n".join(lines) + "\n")
  (out / "matmul_timeline.json").write_text(json.dumps(
      {"env": bench.environment(), "rows": rows}, indent=1))
  print(lines[0])


if __name__ == "__main__":
  main()
