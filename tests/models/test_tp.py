"""Tensor parallelism over a 'tp' mesh axis, on 2 CPU host devices in child
processes (tp_check.py; bench/tensor_parallel.py --quick)."""

import json
import pathlib
import subprocess
import sys

from tests.host_devices import REPO, host_env, run_checked


def test_tp2_matches_tp1():
  run_checked(pathlib.Path(__file__).parent / "tp_check.py", timeout=600)


def test_tensor_parallel_bench_checks_tokens_then_times(tmp_path):
  r = subprocess.run([sys.executable, "bench/tensor_parallel.py", "--out", str(tmp_path),
                      "--config", "tiny", "--quick"], capture_output=True, text=True,
                     env=host_env(2), cwd=REPO, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  rows = json.loads((tmp_path / "tensor_parallel_tiny_tp2.json").read_text())["rows"]
  tokens = [row for row in rows if row["part"] == "tokens"]
  assert len(tokens) == 2 and all(row["agree"] == row["tokens"] == 4 for row in tokens), tokens
  assert all(row["logit_diff_over_max"] < 1e-4 for row in tokens), tokens
  steps = {(row["tp"], row["batch"]) for row in rows if row["part"] == "decode"}
  assert steps == {(1, 1), (1, 4), (2, 1), (2, 4)}, steps
  summary = json.loads(next(row for row in rows if row["part"] == "summary")["summary"])
  assert summary["devices"] == 2 and summary["tokens_agree"]
  assert summary["tpot_ratio_b1"] > 0 and summary["throughput_ratio_b4"] > 0
