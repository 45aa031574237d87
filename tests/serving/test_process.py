"""The engine in a process of its own (serving.engine.process) behind gRPC."""

import concurrent.futures
import gzip
import json
import re
import time

import grpc
import pytest

from serving import engine as E
from serving.engine import api
from serving.engine.process import ProcessEngine
from serving.proto import generate_pb2 as pb

from tests.serving.conftest import running, wait_for


def _expected(last: str, n: int) -> str:
  return "".join(chr(ord(last) + 1 + i) for i in range(n))


@pytest.fixture(scope="module")
def served():
  # Pages for the whole context: a request may ask for 1,000 tokens.
  engine = ProcessEngine(E.tiny_engine, max_batch=8, max_waiting=12, step_delay=0.002,
                         stream_interval=2, num_pages=2100)
  with running(engine) as (server, c):
    yield engine, server, c


def test_streams_calls_and_errors_cross_the_process(served):
  engine, server, c = served
  prompts = [chr(ord("a") + i) * (1 + i) for i in range(8)]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    streamed = list(pool.map(
        lambda p: "".join(ch.text for ch in c.stream(p, max_tokens=9, ignore_eos=True)), prompts))
  assert streamed == [_expected(p[-1], 9) for p in prompts]
  r = c.generate("hello a", max_tokens=5, request_id="one")
  assert r.text == _expected("a", 5) and r.finish_reason == pb.FINISH_REASON_LENGTH
  assert c.tokenize("ab").token_ids[-2:] == [ord("a"), ord("b")]
  assert c.detokenize(list("hé".encode())) == "hé"
  assert engine.stats().pages_in_use == 0 and engine.error is None
  assert any(t[2] >= 1 for t in engine.step_times)  # step timings came back
  counters = engine.counters()  # the counting model compiles nothing it could report
  assert counters["steps"] == engine.stats().steps > 0 and counters["compiled_shapes"] is None
  with pytest.raises(grpc.RpcError) as e:  # the engine's InvalidRequest, raised here
    c.generate("a", max_tokens=5000)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  r = c.generate("k", max_tokens=4, n=3, min_tokens=2)  # n requests' events, merged
  assert [x.text for x in r.completions] == [_expected("k", 4)] * 3
  r = c.generate([{"role": "user", "content": "hi"}], max_tokens=3)  # rendered there too
  assert r.text == '!"#' and r.usage.prompt_tokens == len("user: hi\nassistant: ")
  assert c.tokenize([{"role": "user", "content": "hi"}]).prompt == "user: hi\nassistant: "
  # Structured outputs: the grammar is compiled and followed in the engine's process.
  r = c.generate("a", structured_outputs={"choice": {"choices": ["xyz", "bcq"]}})
  assert r.text == "bcq" and r.finish_reason == pb.FINISH_REASON_STOP
  with pytest.raises(grpc.RpcError) as e:
    c.generate("a", structured_outputs={"regex": "(ab"})
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unclosed" in e.value.details()


def test_a_profile_traces_the_engine_process(served, tmp_path):
  """start_profile / stop_profile run in the engine's process: the trace has
  its steps, and the profiler's own errors come back to the caller."""
  engine, server, c = served
  with pytest.raises(RuntimeError, match="No profile started"):
    engine.stop_profile()
  engine.start_profile(str(tmp_path))
  with pytest.raises(RuntimeError, match="already been started"):
    engine.start_profile(str(tmp_path / "again"))
  assert c.generate("a", max_tokens=4, ignore_eos=True).text == _expected("a", 4)
  engine.stop_profile()
  traces = list(tmp_path.glob("plugins/profile/*/*.trace.json.gz"))
  assert len(traces) == 1
  events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
  # The engine's Python frames are on its timeline (the scheduler's steps).
  assert any(re.search(r"engine\.py:\d+ step$", e.get("name", "")) for e in events)
  assert not (tmp_path / "again").exists()


def test_cancel_frees_pages_and_a_full_queue_is_refused(served):
  engine, server, c = served
  futs = []
  with concurrent.futures.ThreadPoolExecutor(28) as pool:
    # 8 running + 12 waiting fit; the rest are refused. The deadline leaves the
    # 28 calls time to arrive before the first expire and free their places
    # (with 1 s, one CI run on a 2-core machine saw no refusal); 20 x 1000 tokens
    # at 8 a step of >= 2 ms take > 5 s, so the last admitted still time out.
    for i in range(28):
      futs.append(pool.submit(c.generate, "a", max_tokens=1000, ignore_eos=True, timeout=3.0))
    codes = set()
    for f in futs:
      try:
        f.result()
      except grpc.RpcError as e:
        codes.add(e.code())
  assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
  assert grpc.StatusCode.DEADLINE_EXCEEDED in codes
  wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed in the engine process")


def test_a_failing_factory_is_reported_when_built():
  with pytest.raises(api.EngineFailed, match="max_batch"):
    ProcessEngine(E.tiny_engine, max_batch=0)  # EngineConfig refuses it


def test_a_dead_engine_process_fails_requests_and_calls():
  engine = ProcessEngine(E.tiny_engine, max_batch=2, step_delay=0.01)
  engine.start()
  handle = engine.submit(api.Request("r", prompt_ids=[1, 2], add_bos=False,
                                     sampling=api.SamplingParams(max_tokens=200, ignore_eos=True)))
  engine._proc.kill()
  events = []
  wait_for(lambda: events.append(handle.events.get(timeout=30)) or
           isinstance(events[-1], api.Failed), what="the request to fail")
  with pytest.raises(api.EngineFailed):
    engine.stats()
  assert engine.error is not None
  engine.stop()


def test_tokenize_after_the_engine_process_died_is_an_internal_error():
  """Tokenize / Detokenize (gRPC and HTTP) once the engine process is gone:
  the reason, as Generate gets it (INTERNAL / 500), not UNKNOWN and a traceback."""
  import http.client

  engine = ProcessEngine(E.tiny_engine, max_batch=2)
  with running(engine, http_port=0) as (server, c):
    engine._proc.kill()
    engine._proc.join(30)
    for call in (lambda: c.stub.Tokenize(pb.TokenizeRequest(text="x")),
                 lambda: c.stub.Detokenize(pb.DetokenizeRequest(token_ids=[5]))):
      with pytest.raises(grpc.RpcError) as e:
        call()
      assert e.value.code() == grpc.StatusCode.INTERNAL, e.value
      assert "engine process" in e.value.details(), e.value.details()
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
      conn = http.client.HTTPConnection("127.0.0.1", server.openai_http.server_port, timeout=30)
      conn.request("POST", path, body=json.dumps(body),
                   headers={"Content-Type": "application/json"})
      r = conn.getresponse()
      out = json.loads(r.read())
      conn.close()
      assert r.status == 500 and "engine process" in out["error"]["message"], out


def test_a_drain_after_the_engine_process_died_stops_the_server():
  """SIGTERM to the process group (systemd, `timeout`) reaches the engine
  process too: the drain then found it dead, its thread died on the error and
  the server never stopped (serve hung until SIGKILL)."""
  engine = ProcessEngine(E.tiny_engine, max_batch=2)
  with running(engine) as (server, c):
    engine._proc.kill()
    engine._proc.join(30)
    t0 = time.monotonic()
    server.drain_and_stop(timeout=5.0)
    assert server._stopped.is_set() and time.monotonic() - t0 < 5.0


def test_metrics_of_the_engine_process_reach_the_server():
  import urllib.request

  engine = ProcessEngine(E.tiny_engine)
  with running(engine, metrics_port=0) as (server, c):
    c.generate("a", max_tokens=4)
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{server.metrics_http.server_port}/metrics").read().decode()
  for name in ("time_to_first_token_seconds_count 1", "generation_tokens_total 4.0",
               "request_latency_seconds_count 1", "kv_pages_total 63", "requests_running 0"):
    assert "mosaic_serving_" + name in body, name
  assert "mosaic_serving_step_seconds_count 0" not in body  # step timings crossed over too


def _exit_while_building():
  import os

  os._exit(3)


def test_an_engine_process_that_dies_while_building_is_reported():
  with pytest.raises(api.EngineFailed, match="exited with code 3"):
    ProcessEngine(_exit_while_building)


def test_compilation_cache_flag_reaches_the_engine_process(tmp_path):
  # serve --engine-process builds the engine from the CLI's flags in the child,
  # so the child must set the cache up itself (jax's settings do not cross).
  from serving import cli

  cache = tmp_path / "cache"
  # The fewest shapes to compile: a 32-token chunk (two prefill widths, not
  # six), one prompt a call, one batch size, a context of one 128-token page
  # (one page-table width).
  a = cli.parser().parse_args(["serve", "--model", "tiny", "--num-pages", "16", "--max-batch", "1",
                               "--prefill-chunk", "32", "--prefill-rows", "1", "--max-seq-len",
                               "128", "--compilation-cache", str(cache)])
  engine = ProcessEngine(cli.build_engine, a)
  try:
    engine.start()  # the warm-up compiles every step shape, in the child
  finally:
    engine.stop()
  assert len(list(cache.iterdir())) >= 3


def test_a_step_leaves_as_one_message_and_late_events_on_idle_ticks():
  import pickle

  from serving.engine.process import _Outbox, _StepObserver

  box = _Outbox()
  box.add(("event", "a", 1))
  box.add(("event", "a", 2))
  assert box.ready.empty()  # nothing leaves while a step is in progress
  tick = box.flush_stale(None)
  assert tick is not None and box.ready.empty()  # one tick: may still be a step's
  assert box.flush_stale(tick) is None  # waiting a whole tick: out of any step
  assert pickle.loads(box.ready.get_nowait()) == ("batch", [("event", "a", 1), ("event", "a", 2)])

  step = E.StepRecord(0.1, 0.0, 1, True, 0.01, 0.02, 16, 1, 5.0, 2)
  box.add(("event", "b", 3))
  _StepObserver(box).on_step(None, step)  # the step's end sends at once
  assert pickle.loads(box.ready.get_nowait()) == ("batch", [("event", "b", 3)])
  _, [(kind, record)] = pickle.loads(box.ready.get_nowait())
  # Pickling the events is the step's host time too: wall and token times grow by it.
  pickled = record.wall - 0.1
  assert kind == "step" and pickled > 0 and record[1:5] == (0.0, 1, True, 0.01)
  assert abs(record.tokens - 0.02 - pickled) < 1e-9 and record[6:] == (16, 1, 5.0, 2)
  assert box.flush_stale(None) is None and box.ready.empty()


def _engine_whose_decode_fails(**kw):
  engine = E.tiny_engine(**kw)

  def decode(*a, **k):
    raise RuntimeError("decode broke")

  engine.runner.decode = decode
  return engine


def test_a_failure_outside_a_step_reaches_the_request():
  engine = ProcessEngine(_engine_whose_decode_fails, max_batch=2)
  engine.start()
  try:
    handle = engine.submit(api.Request("r", prompt_ids=[1, 2], add_bos=False,
                                       sampling=api.SamplingParams(max_tokens=4)))
    events = []
    wait_for(lambda: events.append(handle.events.get(timeout=30)) or
             isinstance(events[-1], (api.Failed, api.Final)), what="the request to end")
    assert isinstance(events[-1], api.Failed) and "decode broke" in events[-1].message
  finally:
    engine.stop()


def test_events_cross_a_pickle_unchanged():
  import pickle

  top = ((7, -0.25), (3, -1.5))
  events = [api.Delta((7, 8), "hé", (api.TokenLogprob(7, -0.25, top), api.TokenLogprob(8, -2.0))),
            api.Delta((), "tail"),
            api.Final(api.FinishReason.STOP, 3, 2, 0, 0.1, 0.2, 0.3), api.Failed("boom")]
  assert pickle.loads(pickle.dumps(events)) == events


def test_n_completions_are_one_admission_decision_across_the_process(served):
  engine, server, c = served  # max_batch 8 + max_waiting 12
  r = c.generate("k", max_tokens=2, n=20)
  assert [x.text for x in r.completions] == ["lm"] * 20
  with pytest.raises(grpc.RpcError) as e:
    c.generate("k", max_tokens=2, n=21)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-waiting" in e.value.details()
  wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")


def test_the_servers_side_of_an_engine_process_never_imports_jax(tmp_path):
  """With --engine-process the model lives in the child; the server's process
  relays events and must not import jax (a first event whose unpickling did,
  StepRecord's module, held the first stream up for half a second)."""
  import os
  import pathlib
  import subprocess
  import sys
  import textwrap

  root = pathlib.Path(__file__).resolve().parents[2]
  code = textwrap.dedent("""
      import pickle, sys
      from serving.cli import build_engine, parser
      from serving.engine import api
      from serving.engine.process import ProcessEngine
      import serving.service
      if __name__ == "__main__":
        a = parser().parse_args(["serve", "--model", "counting", "--no-warmup"])
        e = ProcessEngine(build_engine, a)
        e.start()
        h = e.submit(api.Request("r", prompt_ids=[97],
                                 sampling=api.SamplingParams(max_tokens=3, ignore_eos=True)))
        while not isinstance(h.events.get(timeout=60), api.Final):
          pass
        e.stop()
        print(len(e.step_times) > 0, sorted(m for m in sys.modules if m.split(".")[0] == "jax"))
  """)
  script = tmp_path / "parent.py"
  script.write_text(code)
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in sys.path if p])}
  out = subprocess.run([sys.executable, str(script)], cwd=root, env=env, check=True,
                       capture_output=True, text=True, timeout=120).stdout
  assert out.strip().splitlines()[-1] == "True []"
