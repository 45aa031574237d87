"""mosaic.torch on CPU, in an interpreter that has torch and jax together.

The project's .venv has no torch, and .venv-oracle (torch + transformers) has
no jax: .ci/setup puts jax beside .venv-oracle's torch in .venv-oracle-jax
(a pip --target folder on PYTHONPATH; jax 0.10.2, since jax 0.11 needs Python
3.12 and .venv-oracle is 3.11). This test runs tests/mosaic/torch_cases.py
there under pytest, in a subprocess, and fails with its report unless every
case passed.
"""

import os
import pathlib
import re
import subprocess

import pytest

from mosaic import testing

REPO = pathlib.Path(__file__).resolve().parents[2]


def _interpreter() -> tuple[str, str] | None:
  """(python, jax folder) of the torch + jax interpreter, or None."""
  py = os.environ.get("MOSAIC_ORACLE_PYTHON") or str(REPO / ".venv-oracle" / "bin" / "python")
  jax_dir = os.environ.get("MOSAIC_ORACLE_JAX") or str(REPO / ".venv-oracle-jax")
  if not pathlib.Path(py).exists() or not (pathlib.Path(jax_dir) / "jax").is_dir():
    return None
  return py, jax_dir


def test_torch_cases_in_torch_and_jax_interpreter():
  found = _interpreter()
  if found is None:
    pytest.skip("no torch + jax interpreter (.venv-oracle with .venv-oracle-jax): run .ci/setup")
  py, jax_dir = found
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env["PYTHONPATH"] = os.pathsep.join([jax_dir, str(REPO)])
  seed = env.setdefault("MOSAIC_TEST_SEED", str(testing._BASE_SEED))
  # os._exit after pytest: the cases' last torch tensors may still hold jax
  # buffers when the interpreter tears down, and jax's exit hook clears its
  # clients first (an abort at exit, seen now and then, is no test's result).
  code = ("import os, sys, pytest\n"
          "rc = pytest.main(sys.argv[1:])\n"
          "sys.stdout.flush(); sys.stderr.flush(); os._exit(int(rc))\n")
  r = subprocess.run(
      [py, "-c", code, "-q", "-p", "no:cacheprovider",
       str(REPO / "tests" / "mosaic" / "torch_cases.py")],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  report = f"MOSAIC_TEST_SEED={seed}\n{r.stdout[-6000:]}{r.stderr[-3000:]}"
  summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
  assert r.returncode == 0, f"torch_cases.py failed (exit {r.returncode}):\n{report}"
  counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)",
                                                    summary))
  assert counts.get("passed", 0) > 0 and set(counts) == {"passed"}, (
      f"not every case passed: {summary!r}\n{report}")
