"""Do the model's decode logits come out the same in every process?

Runs ``bench/serving_host.py --decode-only --iters 1`` in ``--runs`` fresh
processes and compares the logits' fingerprints (sum and top-8 tokens, at
B=1 and at the max batch; seeded weights and inputs, so every process should
match). XLA times some of its fusion choices afresh in each process. Where
two choices add their terms in a different order, the step's results differ
by rounding between processes (bench/results/matmul_h200_run11_stream_k/).
``--compilation-cache DIR`` shares jax's persistent cache among the runs:
the first compiles and stores, and the others load its executables.
``--dump-autotune`` keeps each run's XLA autotuning choices
(``autotune_<i>.txt``), so two runs that differ can be compared.
Other arguments go to serving_host.py (e.g. ``--config``, ``--attention``).

  PYTHONPATH=. python3 bench/determinism.py --out DIR [--runs 6] [--compilation-cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, type=pathlib.Path)
  ap.add_argument("--runs", type=int, default=6)
  ap.add_argument("--timeout-s", type=float, default=120.0, help="per run")
  ap.add_argument("--compilation-cache", type=pathlib.Path)
  ap.add_argument("--dump-autotune", action="store_true")
  a, rest = ap.parse_known_args(argv)
  if a.runs < 2:
    ap.error(f"--runs must be >= 2 to compare anything, got {a.runs}")
  a.out.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, str(HERE / "serving_host.py"), "--decode-only", "--iters", "1", *rest]
  if a.compilation_cache:
    cmd += ["--compilation-cache", str(a.compilation_cache)]
  runs = []
  for i in range(a.runs):
    env = dict(os.environ)
    if a.dump_autotune:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          f" --xla_gpu_dump_autotune_results_to={a.out / f'autotune_{i}.txt'}")
    p = subprocess.run(cmd + ["--out", str(a.out), "--tag", f"run{i}"], env=env,
                       capture_output=True, text=True, timeout=a.timeout_s)
    (a.out / f"run{i}.log").write_text(p.stdout + p.stderr)
    if p.returncode:
      raise SystemExit(f"run {i} failed (rc {p.returncode}); see {a.out / f'run{i}.log'}")
    res = json.loads((a.out / f"serving_host_run{i}.json").read_text())
    runs.append({k: v["logits"] for k, v in res.items() if isinstance(v, dict) and "logits" in v})
    print(f"run {i}: " + ", ".join(f"{k} sum {v['sum']:.10g}" for k, v in runs[-1].items()),
          flush=True)
  summary = {}
  for key in runs[0]:
    values = [json.dumps(r[key], sort_keys=True) for r in runs]
    summary[key] = {"distinct": len(set(values)),
                    "counts": {v: values.count(v) for v in dict.fromkeys(values)}}
  same = all(s["distinct"] == 1 for s in summary.values())
  report = {"command": " ".join(cmd), "compilation_cache": str(a.compilation_cache or ""),
            "runs": runs, "summary": summary, "all_runs_agree": same}
  (a.out / "determinism.json").write_text(json.dumps(report, indent=1) + "\n")
  for key, s in summary.items():
    print(f"{key}: {s['distinct']} distinct fingerprint(s) over {a.runs} runs")
  print("all runs agree" if same else "runs disagree", flush=True)


if __name__ == "__main__":
  main()
