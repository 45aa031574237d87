"""The server over a tensor-parallel model, on 2 CPU host devices in a child
process (the device count is fixed when jax starts)."""

import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_tp2_server_streams_what_tp1_streams():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  seed = str(np.random.default_rng().integers(1 << 30))
  r = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "tp_serve_check.py"),
                      seed], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
  assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
