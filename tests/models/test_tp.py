"""Tensor parallelism over a 'tp' mesh axis, on 2 CPU host devices in a child
process (tp_check.py)."""

import pathlib

from tests.host_devices import run_checked


def test_tp2_matches_tp1():
  run_checked(pathlib.Path(__file__).parent / "tp_check.py", timeout=600)
