"""The fault suite: what a hostile or unlucky client does to a running server.

Each scenario runs against the counting engine (next byte = previous + 1, so
every output is known) on loopback, bounded in time, and ends with the same
check (``Baseline.recovered``): the server answers a normal request with the
known text, no request is left running or waiting, the KV pages in use are 0
(and the allocator's books balance), and no thread or file descriptor was
left behind (counted before and after). Scenarios:

- fuzzed GenerateRequest fields (hypothesis) and raw bytes on the wire:
  a status, never INTERNAL or a crash; what succeeds is consistent;
- storms of cancels, deadlines and disconnects (gRPC and HTTP) while
  requests stream;
- overload at 4x what the queue admits: refusals are RESOURCE_EXHAUSTED
  (HTTP 429), what is admitted is right;
- SIGTERM and SIGKILL of the engine process under load: in-flight requests
  fail at once with a clear status, health goes NOT_SERVING, new requests
  are refused, nothing hangs.
"""

import concurrent.futures
import contextlib
import http.client
import json
import logging
import os
import random
import signal
import socket
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from serving import engine as E
from serving.client import Client
from serving.proto import generate_pb2 as pb
from serving.service import Server

from tests.serving.conftest import wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_ENDS = (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, pb.FINISH_REASON_EOS)


def _expected(last: str, n: int) -> str:
  return "".join(chr(ord(last) + 1 + i) for i in range(n))


def _fds() -> int:
  return len(os.listdir("/proc/self/fd"))


def _fd_names() -> dict[str, str]:
  out = {}
  for f in os.listdir("/proc/self/fd"):
    with contextlib.suppress(OSError):
      out[f] = os.readlink(f"/proc/self/fd/{f}")
  return out


def _ours(t: threading.Thread) -> bool:
  """Threads a scenario may leave: not the gRPC server's worker pool, which
  keeps up to its max_workers idle threads by design (counted apart)."""
  return not t.name.startswith("rpc")


class Baseline:
  """Threads and file descriptors of this process before a scenario."""

  def __init__(self, server: Server):
    self.server = server
    self.threads = {t for t in threading.enumerate() if _ours(t)}
    self.pool = {t for t in threading.enumerate() if not _ours(t)}
    self.fds = _fds()

  def leaks(self) -> str:
    threads = [t.name for t in threading.enumerate() if _ours(t) and t not in self.threads]
    fds = _fds() - self.fds
    return f"threads {threads}, {fds} more fds" if threads or fds > 0 else ""

  def no_leaks(self, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while self.leaks() and time.monotonic() < end:
      time.sleep(0.05)
    assert not self.leaks(), self.leaks()

  def recovered(self, client: Client) -> None:
    engine = self.server.engine
    wait_for(lambda: engine.stats().running + engine.stats().waiting == 0, timeout=10,
             what="no request left running or waiting")
    r = client.generate("hello a", max_tokens=5, timeout=10)
    assert r.text == "bcdef" and r.finish_reason == pb.FINISH_REASON_LENGTH
    wait_for(lambda: engine.stats().pages_in_use == 0, timeout=10, what="pages back to 0")
    if hasattr(engine, "alloc"):
      engine.alloc.check()
    assert engine.error is None and client.health() == SERVING
    pool = [t for t in threading.enumerate() if not _ours(t) and t not in self.pool]
    assert len(pool) + 1 <= self.server._grpc_workers, len(pool)  # (1 made before)
    self.no_leaks()


@contextlib.contextmanager
def serving(engine, **server_kw):
  """A server on loopback with its client; the baseline is taken once it
  has answered one request (the lazily made threads and sockets made)."""
  server = Server(engine, host="127.0.0.1", port=0, **server_kw).start()
  client = Client(server.address)
  try:
    assert client.generate("a", max_tokens=2, timeout=30).text == "bc"
    yield server, client, Baseline(server)
  finally:
    client.close()
    server.stop(grace=0.5)


@pytest.fixture(scope="module")
def fuzzed():
  engine = E.tiny_engine(max_batch=4, max_waiting=4, default_max_tokens=12)
  with serving(engine, http_port=0) as sc:
    yield sc


# -- fuzzing ---------------------------------------------------------------------

_TRICKY_REGEX = ["a{1000000}", "(a|b)*c", "[^\\x00]{0,3}", "(ab", "\\p{L}+", "", ".*", "x{2,1}"]
_f32 = st.one_of(st.none(), st.floats(width=32), st.sampled_from([0.0, 1.0, -0.0, 1e-30]))


@st.composite
def _requests(draw):
  sp = {}
  for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty"):
    v = draw(_f32)
    if v is not None:
      sp[f] = v
  for f, lo, hi in (("max_tokens", -2, 12), ("min_tokens", -1, 14), ("n", -1, 10),
                    ("top_k", -1, 400), ("top_logprobs", -1, 7), ("prompt_logprobs", -1, 7),
                    ("truncate_prompt_tokens", -1, 2000)):
    v = draw(st.one_of(st.none(), st.integers(lo, hi), st.integers(-2**31, 2**31 - 1)))
    if v is not None:
      sp[f] = v
  if draw(st.booleans()):
    sp["seed"] = draw(st.integers(0, 2**64 - 1))
  sp["stop"] = draw(st.lists(st.text(max_size=3), max_size=17))
  sp["stop_token_ids"] = draw(st.lists(st.integers(-3, 300), max_size=3))
  sp["logit_bias"] = draw(st.dictionaries(st.integers(-3, 300),
                                          st.floats(-150, 150, width=32), max_size=3))
  sp["allowed_token_ids"] = draw(st.lists(st.integers(-3, 300), max_size=4))
  for f in ("logprobs", "ignore_eos", "include_stop_str_in_output"):
    sp[f] = draw(st.booleans())
  kind = draw(st.sampled_from([None, None, "regex", "choice", "json", "grammar", "json_object"]))
  if kind == "regex":
    sp["structured_outputs"] = pb.StructuredOutputs(regex=draw(st.one_of(
        st.sampled_from(_TRICKY_REGEX), st.text("ab|*+?(){}[]^$.\\1", max_size=8))))
  elif kind == "choice":
    sp["structured_outputs"] = pb.StructuredOutputs(choice=pb.Choices(
        choices=draw(st.lists(st.text(max_size=4), max_size=3))))
  elif kind == "json_object":
    sp["structured_outputs"] = pb.StructuredOutputs(json_object=draw(st.booleans()))
  elif kind is not None:
    sp["structured_outputs"] = pb.StructuredOutputs(**{kind: draw(st.text(max_size=12))})
  prompt = draw(st.one_of(
      st.text(max_size=16).map(lambda t: dict(text=t)),
      st.just(dict(text="\U0001f600" * 3000)),  # past the context
      st.lists(st.integers(-3, 300), max_size=16).map(
          lambda i: dict(token_ids=pb.TokenIds(ids=i))),
      st.lists(st.tuples(st.sampled_from(["user", "system", "", "tool"]), st.text(max_size=8)),
               max_size=3).map(lambda ms: dict(chat=pb.Chat(
                   messages=[pb.ChatMessage(role=r, content=t) for r, t in ms]))),
      st.just({})))
  return pb.GenerateRequest(request_id=draw(st.text(max_size=6)), sampling=pb.SamplingParams(**sp),
                            priority=draw(st.sampled_from([0, 0, 1, -2**31])), **prompt)


def _check_response(req: pb.GenerateRequest, completions) -> None:
  """What a successful answer must satisfy, whatever the request."""
  s = req.sampling
  n = s.n if s.HasField("n") else 1
  assert len(completions) == n
  for c in completions:
    assert c.finish_reason in _ENDS, c
    # The EOS or stop token id that ended a completion is counted but not
    # listed (a stop token id is, with include_stop_str_in_output).
    ended_on_token = c.finish_reason == pb.FINISH_REASON_EOS or (
        c.WhichOneof("stop_reason") == "stop_token_id" and not s.include_stop_str_in_output)
    assert c.usage.completion_tokens == len(c.token_ids) + ended_on_token
    if s.HasField("max_tokens"):
      assert len(c.token_ids) <= s.max_tokens
    if s.structured_outputs.WhichOneof("kind") == "choice" and (
        c.finish_reason == pb.FINISH_REASON_STOP):
      assert c.text in s.structured_outputs.choice.choices


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=_requests(), stream=st.booleans(), timeout=st.sampled_from([10.0, 10.0, 0.02]))
# A completion that only its stop token id can end, at once (found by the fuzzer).
@example(req=pb.GenerateRequest(text="", sampling=pb.SamplingParams(
    stop_token_ids=[0], allowed_token_ids=[0])), stream=False, timeout=10.0)
@example(req=pb.GenerateRequest(text="", sampling=pb.SamplingParams(
    stop_token_ids=[0], allowed_token_ids=[0])), stream=True, timeout=10.0)
def test_fuzzed_requests_get_a_status_or_a_consistent_answer(fuzzed, req, stream, timeout):
  _fuzz_one(*fuzzed[:2], req, stream, timeout)


@pytest.fixture
def fuzzed_multi_step():
  """The toy model with 4 decode steps a call: a request can end (stop
  string, stop token, length) anywhere inside a call. For one test (all its
  examples): gone before the next test checks for leaked threads."""
  engine = E.toy_engine(max_batch=4, max_waiting=4, default_max_tokens=12, num_pages=200,
                        page_size=8, batch_buckets=(1, 4), prefill_rows=4, min_chunk=16,
                        prefill_chunk=64, max_seq_len=256, warmup=False, decode_steps=4)
  server = Server(engine, host="127.0.0.1", port=0).start()
  client = Client(server.address)
  try:
    yield server, client
  finally:
    client.close()
    server.stop(grace=0.5)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=_requests(), stream=st.booleans(), timeout=st.just(10.0))
def test_fuzzed_requests_on_multi_step_calls_get_a_status_or_a_consistent_answer(
    fuzzed_multi_step, req, stream, timeout):
  _fuzz_one(*fuzzed_multi_step, req, stream, timeout)


def _fuzz_one(server, c, req, stream, timeout):
  try:
    if stream:
      chunks = list(c.stub.GenerateStream(req, timeout=timeout))
      by_index: dict[int, pb.Completion] = {}
      for ch in chunks:
        comp = by_index.setdefault(ch.index, pb.Completion(index=ch.index))
        comp.text += ch.text
        comp.token_ids.extend(ch.token_ids)
        if ch.HasField("final"):
          comp.finish_reason = ch.final.finish_reason
          comp.usage.CopyFrom(ch.final.usage)
          if ch.final.WhichOneof("stop_reason") == "stop_token_id":
            comp.stop_token_id = ch.final.stop_token_id
      _check_response(req, [by_index[i] for i in sorted(by_index)])
    else:
      r = c.stub.Generate(req, timeout=timeout)
      _check_response(req, list(r.completions) or [r])
  except grpc.RpcError as e:
    allowed = {grpc.StatusCode.INVALID_ARGUMENT}
    if timeout < 1:
      allowed.add(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert e.code() in allowed, (e.code(), e.details(), req)
  assert server.engine.error is None
  wait_for(lambda: server.engine.stats().running + server.engine.stats().waiting == 0,
           timeout=10, what="the request ended")


_VALID = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(
    max_tokens=3, stop=["zz"], structured_outputs=pb.StructuredOutputs(regex="[a-z]+"))
).SerializeToString()


@st.composite
def _wire_bytes(draw):
  if draw(st.booleans()):
    return draw(st.binary(max_size=48))
  data = bytearray(_VALID)
  for _ in range(draw(st.integers(1, 4))):
    i = draw(st.integers(0, len(data) - 1))
    data[i] = draw(st.integers(0, 255))
  return bytes(data[:draw(st.integers(0, len(data)))])


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=_wire_bytes(), method=st.sampled_from(["Generate", "GenerateStream", "Tokenize",
                                                   "Detokenize"]))
def test_raw_bytes_on_the_wire_get_a_status_never_internal(fuzzed, data, method):
  server, c, _ = fuzzed
  kind = "unary_stream" if method == "GenerateStream" else "unary_unary"
  call = getattr(c.channel, kind)(f"/mosaic.serving.v1.TextGeneration/{method}",
                                  request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
  message = {"Tokenize": pb.TokenizeRequest, "Detokenize": pb.DetokenizeRequest}.get(
      method, pb.GenerateRequest)
  try:
    message.FromString(data)
    decodes = True
  except Exception:  # noqa: BLE001
    decodes = False
  try:
    out = call(data, timeout=10)
    if method == "GenerateStream":
      list(out)
    assert decodes
  except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), data)
    assert decodes or "does not decode" in e.details()
  assert server.engine.error is None


def test_after_the_fuzzing_the_server_is_whole(fuzzed):
  server, c, baseline = fuzzed
  baseline.recovered(c)


# -- storms ------------------------------------------------------------------------

def _http_stream(port: int, max_tokens: int, read_events: int, close: bool):
  """An HTTP completion stream: reads ``read_events`` events, then closes the
  socket (a client gone) or reads to the end; returns the events read."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
  conn.request("POST", "/v1/completions", body=json.dumps(
      {"prompt": "a", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
       "temperature": 0}))
  sock = conn.sock
  r = conn.getresponse()
  assert r.status == 200
  events = []
  try:
    while not close or len(events) < read_events:
      line = r.readline()  # (the body's chunks decoded)
      if not line:
        break
      if line.startswith(b"data: "):
        events.append(line[6:].strip())
  finally:
    if close:
      sock.shutdown(socket.SHUT_RDWR)
    r.close()
    conn.close()
  return events


def test_cancel_deadline_and_disconnect_storms_while_streaming():
  """40 calls at once, each ended its own way mid-stream: a client cancel,
  a deadline, a closed channel, an HTTP socket closed mid-stream, n = 3 with
  a deadline; a quarter run to the end and must be right."""
  # Room for all 50 requests at once (5 of the calls are n = 3): on a loaded
  # machine none may have ended before the last arrives.
  engine = E.tiny_engine(max_batch=8, max_waiting=64, step_delay=0.002, num_pages=256)
  with serving(engine, http_port=0) as (server, c, baseline):
    port = server.openai_http.server_port
    rng = random.Random(53)

    def one(i):
      kind = ["cancel", "deadline", "disconnect", "http-gone", "n-deadline", "whole",
              "http-whole", "deadline-unary"][i % 8]
      k = rng.randint(1, 6)
      if kind == "cancel":
        s = c.stream("a", max_tokens=400, ignore_eos=True)
        for _ in range(k):
          next(s)
        s.cancel()
      elif kind in ("deadline", "n-deadline"):
        with pytest.raises(grpc.RpcError) as e:
          list(c.stream("a", max_tokens=400, ignore_eos=True, timeout=0.05 * k,
                        n=3 if kind == "n-deadline" else 1))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
      elif kind == "deadline-unary":
        with pytest.raises(grpc.RpcError) as e:
          c.generate("a", max_tokens=400, ignore_eos=True, timeout=0.05 * k)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
      elif kind == "disconnect":
        own = Client(server.address)
        s = own.stream("a", max_tokens=400, ignore_eos=True)
        for _ in range(k):
          next(s)
        own.close()
      elif kind == "http-gone":
        _http_stream(port, 400, k, close=True)
      elif kind == "whole":
        text = "".join(ch.text for ch in c.stream("k", max_tokens=8))
        assert text == _expected("k", 8)
      else:
        events = _http_stream(port, 8, 0, close=False)
        assert events[-1] == b"[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "bcdefghi"
      return kind

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
      kinds = list(pool.map(one, range(40)))
    assert len(kinds) == 40
    baseline.recovered(c)


def test_overload_at_four_times_the_queue():
  """32 calls at once (gRPC and HTTP) on a server that admits 8 (4 running
  + 4 waiting): the admitted ones get their known text, the others
  RESOURCE_EXHAUSTED / 429 with the reason; then it serves as before."""
  engine = E.tiny_engine(max_batch=4, max_waiting=4, step_delay=0.002)
  with serving(engine, http_port=0) as (server, c, baseline):
    port = server.openai_http.server_port
    barrier = threading.Barrier(32)

    def one(i):
      barrier.wait()
      if i % 4 == 3:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "!", "max_tokens": 60, "temperature": 0, "ignore_eos": True}))
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        if r.status == 200:
          assert body["choices"][0]["text"] == _expected("!", 60)
          return "ok"
        assert r.status == 429 and "full" in body["error"]["message"], body
        return "refused"
      try:
        r = c.generate("!", max_tokens=60, ignore_eos=True, timeout=30)
        assert r.text == _expected("!", 60)
        return "ok"
      except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
        # The engine's queue refuses ("full"), or, when more calls are in flight
        # than the server has handler threads for, gRPC's own limit does.
        assert "full" in e.details() or "Concurrent RPC limit" in e.details(), e.details()
        return "refused"

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
      outcomes = list(pool.map(one, range(32)))
    assert 8 <= outcomes.count("ok") < 32 and outcomes.count("refused") > 0, outcomes
    baseline.recovered(c)


# -- the engine process dies -------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_engine_process_dying_under_load_fails_its_requests_and_health(sig, caplog):
  """The engine process killed while 6 streams run: each ends at once with
  INTERNAL naming the engine's exit, health is NOT_SERVING, new calls are
  refused at once (no hang), the death is logged, and once the server stops
  nothing of it is left (threads, descriptors, the child)."""
  from multiprocessing import resource_tracker

  from serving.engine.process import ProcessEngine

  resource_tracker.ensure_running()  # (once a process: its pipe is no leak)
  # gRPC's own pollers live while any gRPC object does: one held throughout.
  anchor = grpc.insecure_channel("127.0.0.1:9")
  # (the HTTP side's first start makes a pipe that lives as long as the process)
  with serving(E.tiny_engine(), http_port=0):
    pass
  before_threads = {t for t in threading.enumerate() if _ours(t)}
  before_fds = _fds()
  names = _fd_names()
  engine = ProcessEngine(E.tiny_engine, max_batch=8, step_delay=0.01)
  server = Server(engine, host="127.0.0.1", port=0, http_port=0).start()
  c = Client(server.address)
  try:
    assert c.generate("a", max_tokens=2, timeout=30).text == "bc"
    streams = [c.stream("a", max_tokens=1000, ignore_eos=True, timeout=30) for _ in range(6)]
    for s in streams:  # all running (250 tokens each, the cache's room, take 2.5 s)
      next(s)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="serving"):
      os.kill(engine._proc.pid, sig)
      for s in streams:
        with pytest.raises(grpc.RpcError) as e:
          list(s)
        assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
        assert "engine process exited" in e.value.details(), e.value.details()
        assert signal.Signals(sig).name in e.value.details()
      assert time.monotonic() - t0 < 5.0
      assert c.health() == NOT_SERVING
      # The metrics still export, the failures counted, the dead engine's gauges left out.
      assert server.metrics.sample("requests_finished_total", reason="error") >= 6
      assert "kv_pages_total" not in server.metrics.render()
      t1 = time.monotonic()
      with pytest.raises(grpc.RpcError) as e:
        c.generate("a", max_tokens=2, timeout=10)
      assert e.value.code() == grpc.StatusCode.INTERNAL and "exited" in e.value.details()
      status, _ = _get(server.openai_http.server_port, "/health")
      assert status == 503 and time.monotonic() - t1 < 2.0
    assert any("engine process exited" in r.getMessage() for r in caplog.records)
  finally:
    c.close()
    t2 = time.monotonic()
    server.stop(grace=0.5)
    assert time.monotonic() - t2 < 5.0
  assert engine.exitcode == -sig
  end = time.monotonic() + 10
  while time.monotonic() < end:
    left = [t.name for t in threading.enumerate() if _ours(t) and t not in before_threads]
    if not left and _fds() <= before_fds:
      break
    time.sleep(0.05)
  assert not left and _fds() <= before_fds, (left, str(sorted(
      (f, v) for f, v in _fd_names().items() if names.get(f) != v)))
  anchor.close()


def _get(port: int, path: str):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
  conn.request("GET", path)
  r = conn.getresponse()
  out = r.status, r.read()
  conn.close()
  return out
