"""Runs a check script in a child process with several CPU host devices (jax
fixes the device count when it starts, so a test cannot add devices to its
own process)."""

import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def host_env(devices: int = 2) -> dict[str, str]:
  """The environment of a child process with ``devices`` CPU host devices."""
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
              JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def run_checked(script: pathlib.Path, devices: int = 2, timeout: float = 900) -> str:
  """Runs ``script SEED`` (a fresh seed each time) on ``devices`` host devices;
  fails unless it exits 0 and prints "ok". Returns its stdout."""
  env = host_env(devices)
  seed = str(np.random.default_rng().integers(1 << 30))
  r = subprocess.run([sys.executable, str(script), seed], capture_output=True, text=True,
                     env=env, cwd=REPO, timeout=timeout)
  assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
  return r.stdout
