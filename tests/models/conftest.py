"""Fixtures for the model tests: the transformers oracle, run once per test run.

The oracle (hf_oracle.py) runs under the torch + transformers interpreter
(.venv-oracle, or MOSAIC_ORACLE_PYTHON) in a subprocess; xdist workers share
its output through a lock file in pytest's shared temp root.
"""

import fcntl
import os
import pathlib
import subprocess
import sys

import pytest

from mosaic import testing

REPO = pathlib.Path(__file__).resolve().parents[2]


def oracle_python() -> str | None:
  p = os.environ.get("MOSAIC_ORACLE_PYTHON") or str(REPO / ".venv-oracle" / "bin" / "python")
  return p if pathlib.Path(p).exists() else None


def _run_oracle(tmp_path_factory, worker, script: str) -> pathlib.Path:
  """Runs tests/models/<script>.py OUT SEED once per test run (shared by xdist
  workers through a lock file) and returns OUT."""
  py = oracle_python()
  if py is None:
    pytest.skip("no oracle interpreter (.venv-oracle with torch + transformers): run .ci/setup")
  root = tmp_path_factory.getbasetemp()
  if worker != "master":
    root = root.parent  # shared by all xdist workers of this run
  out = root / script
  with open(root / f"{script}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / "done").exists():
      seed = testing._BASE_SEED % (2**31)  # fresh per run unless MOSAIC_TEST_SEED is set
      r = subprocess.run([py, str(pathlib.Path(__file__).parent / f"{script}.py"), str(out),
                          str(seed)], capture_output=True, text=True, timeout=600)
      if r.returncode:
        raise RuntimeError(f"{script}.py failed:\n{r.stderr[-4000:]}")
      (out / "done").write_text(str(seed))
  return out


@pytest.fixture(scope="session")
def hf_oracle(tmp_path_factory, _xdist_worker) -> pathlib.Path:
  return _run_oracle(tmp_path_factory, _xdist_worker, "hf_oracle")


@pytest.fixture(scope="session")
def hf_variants(tmp_path_factory, _xdist_worker) -> pathlib.Path:
  """Tiny checkpoints of the config variants (hf_variants.py), without tokenizers."""
  return _run_oracle(tmp_path_factory, _xdist_worker, "hf_variants")


@pytest.fixture(scope="session")
def _xdist_worker(request):
  return getattr(request.config, "workerinput", {}).get("workerid", "master")
