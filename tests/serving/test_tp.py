"""The server over a tensor-parallel model, on 2 CPU host devices in a child
process (tp_serve_check.py)."""

import pathlib

from tests.host_devices import run_checked


def test_tp2_server_streams_what_tp1_streams():
  run_checked(pathlib.Path(__file__).parent / "tp_serve_check.py")
