"""Servers on loopback for the serving tests."""

import contextlib
import time

import pytest

from serving import engine as E
from serving.client import Client
from serving.service import Server


@contextlib.contextmanager
def running(engine, **server_kw):
  server = Server(engine, host="127.0.0.1", port=0, **server_kw).start()
  client = Client(server.address, token=server_kw.get("auth_token"))
  try:
    yield server, client
  finally:
    client.close()
    server.stop(grace=0.5)


def wait_for(cond, timeout=60.0, what="condition"):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if cond():
      return
    time.sleep(0.01)
  raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def counting():
  """The counting model (next byte = previous + 1) behind the real server."""
  with running(E.tiny_engine(max_batch=8, max_waiting=64, prompt_logprobs=True)) as sc:
    yield sc
