"""The gRPC service against the counting engine, whose output is known."""

import threading
import time

import grpc
from grpc_health.v1 import health_pb2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serving import engine as E
from serving.proto import generate_pb2 as pb

from tests.serving.conftest import running, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _expected(last: str, n: int) -> str:
  return "".join(chr(ord(last) + 1 + i) for i in range(n))


def test_generate_and_stream_give_the_known_continuation(counting):
  server, c = counting
  r = c.generate("hello a", max_tokens=7, request_id="r1")
  assert r.text == _expected("a", 7) and r.request_id == "r1"
  assert list(r.token_ids) == [ord(ch) for ch in r.text]
  assert r.finish_reason == pb.FINISH_REASON_LENGTH
  assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 7  # BOS + 7 bytes
  assert 0 <= r.timings.queue_s <= r.timings.first_token_s <= r.timings.total_s
  chunks = list(c.stream("x" * 3 + "k", max_tokens=5))
  assert "".join(ch.text for ch in chunks) == _expected("k", 5)
  assert [i for ch in chunks for i in ch.token_ids] == [ord(x) for x in _expected("k", 5)]
  assert chunks[-1].HasField("final") and not any(ch.HasField("final") for ch in chunks[:-1])
  assert chunks[-1].final.finish_reason == pb.FINISH_REASON_LENGTH


def test_token_id_prompts_stops_and_logprobs(counting):
  _, c = counting
  r = c.generate([ord("a")], max_tokens=20, stop=["ef"])
  assert r.text == "bcd" and r.finish_reason == pb.FINISH_REASON_STOP
  assert list(r.token_ids) == [ord(x) for x in "bcdef"]  # the ids that made the stop
  assert r.WhichOneof("stop_reason") == "stop_string" and r.stop_string == "ef"
  for stream in (False, True):  # the stop string kept, and nothing after it
    kw = dict(max_tokens=20, stop=["xyz", "ef"], include_stop_str_in_output=True)
    text = ("".join(ch.text for ch in c.stream([ord("a")], **kw)) if stream
            else c.generate([ord("a")], **kw).text)
    assert text == "bcdef", stream
  r = c.generate([ord("a")], max_tokens=20, stop_token_ids=[ord("e")])
  assert r.text == "bcd" and r.finish_reason == pb.FINISH_REASON_STOP
  assert r.WhichOneof("stop_reason") == "stop_token_id" and r.stop_token_id == ord("e")
  for stream in (False, True):  # the stop token's text kept (vLLM's include_stop_str_in_output)
    kw = dict(max_tokens=20, stop_token_ids=[ord("e")], include_stop_str_in_output=True)
    text = ("".join(ch.text for ch in c.stream([ord("a")], **kw)) if stream
            else c.generate([ord("a")], **kw).text)
    assert text == "bcde", stream
  final = list(c.stream([ord("a")], max_tokens=20, stop=["zz", "de"]))[-1].final
  assert final.stop_string == "de" and final.finish_reason == pb.FINISH_REASON_STOP
  assert c.generate([ord("a")], max_tokens=2).WhichOneof("stop_reason") is None  # LENGTH
  # A stop token ends it while text is held back for a stop string that never came.
  r = c.generate([ord("a")], max_tokens=20, stop=["xyz"], stop_token_ids=[ord("e")])
  assert r.text == "bcd" and r.finish_reason == pb.FINISH_REASON_STOP
  r = c.generate([ord("a")], max_tokens=3, logprobs=True, top_logprobs=2)
  assert len(r.logprobs) == 3
  for lp, tid in zip(r.logprobs, r.token_ids):
    assert lp.token_id == tid and -1e-3 < lp.logprob <= 0 and len(lp.top) == 2
    assert lp.top[0].token_id == tid


def test_truncate_prompt_tokens_keeps_the_prompts_end(counting):
  """truncate_prompt_tokens=k: the prompt's last k tokens only, so a prompt
  longer than the context (1,024) and the KV cache (252) runs instead of
  being refused."""
  _, c = counting
  long = [ord("a") + i % 20 for i in range(1500)]  # ends in ..."s", "t"
  with pytest.raises(grpc.RpcError) as e:
    c.generate(long, max_tokens=3)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  r = c.generate(long, max_tokens=3, truncate_prompt_tokens=10)
  assert r.text == "uvw" and r.usage.prompt_tokens == 10
  r = c.generate("hello", max_tokens=2, truncate_prompt_tokens=100)  # shorter: as is
  assert r.usage.prompt_tokens == c.generate("hello", max_tokens=2).usage.prompt_tokens


def test_eos_and_ignore_eos(counting):
  _, c = counting
  r = c.generate("x", max_tokens=20)  # the counting model says EOS after "~"
  assert r.text == "yz{|}~" and r.finish_reason == pb.FINISH_REASON_EOS
  assert r.usage.completion_tokens == 7 and list(r.token_ids) == [ord(x) for x in "yz{|}~"]
  r = c.generate("x", max_tokens=9, ignore_eos=True)
  assert list(r.token_ids) == [ord(x) for x in "yz{|}~"] + [257, 2, 3]
  assert r.finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(decode_steps):
  """Before its min_tokens-th token a request samples no EOS or stop token id
  (the counting model's argmax after them is byte 0) and no stop string ends
  it; from there on they do. The bans hold within a multi-step call too."""
  ids = lambda text: [ord(x) for x in text]  # noqa: E731
  engine = E.tiny_engine(max_batch=8, decode_steps=decode_steps, default_max_tokens=16)
  with running(engine) as (server, c):
    for min_tokens, want, reason in ((6, ids("yz{|}~"), pb.FINISH_REASON_EOS),
                                     (7, ids("yz{|}~") + [0, 1, 2], pb.FINISH_REASON_LENGTH)):
      r = c.generate("x", max_tokens=9, min_tokens=min_tokens)
      assert (list(r.token_ids), r.finish_reason) == (want, reason), min_tokens
    for min_tokens, want, reason in ((2, ids("yz"), pb.FINISH_REASON_STOP),
                                     (3, ids("yz") + [0, 1, 2], pb.FINISH_REASON_LENGTH)):
      r = c.generate("x", max_tokens=5, min_tokens=min_tokens, stop_token_ids=[ord("{")])
      assert (list(r.token_ids), r.finish_reason) == (want, reason), min_tokens
    for min_tokens, text, reason in ((0, "y", pb.FINISH_REASON_STOP),
                                     (4, "yz{|}~", pb.FINISH_REASON_EOS)):
      r = c.generate("x", max_tokens=20, min_tokens=min_tokens, stop=["z{"])
      assert (r.text, r.finish_reason) == (text, reason), min_tokens
    # Without max_tokens a request may generate min_tokens, past the default.
    r = c.generate("x", min_tokens=40)
    assert r.usage.completion_tokens == 40 and r.finish_reason == pb.FINISH_REASON_LENGTH
    assert 257 not in r.token_ids
    wait_for(lambda: server.engine.stats().pages_in_use == 0, what="pages freed")


def test_logit_bias_moves_greedy_and_sampled_picks(counting):
  """+100 on "c" makes the counting model say "c" over its own next byte; -100
  on its next byte leaves the runner-up (byte 0: the others tie), greedy or
  seeded top-k sampling."""
  _, c = counting
  for kw in ({}, dict(temperature=1.0, top_k=1, seed=3)):
    r = c.generate("a", max_tokens=4, logit_bias={ord("c"): 100.0}, **kw)
    assert r.text == "cccc", kw
    r = c.generate("a", max_tokens=3, logit_bias={ord("b"): -100.0}, **kw)
    assert list(r.token_ids) == [0, 1, 2], kw
  # Only "x" and "y" allowed: the counting model's "b" is not, so the tie of
  # the rest goes to the lower id ("x"); after "x" its own "y" is allowed.
  for kw in ({}, dict(temperature=1.0, top_k=1, seed=3)):
    r = c.generate("a", max_tokens=4, allowed_token_ids=[ord("y"), ord("x")], **kw)
    assert r.text == "xyxy", kw
  # The slot's bias does not linger (sequential requests reuse one slot).
  assert c.generate("a", max_tokens=3, temperature=1.0, top_k=1, seed=1).text == "bcd"
  assert c.generate("a", max_tokens=3).text == "bcd"


def test_tokenize_model_info_health(counting):
  server, c = counting
  t = c.tokenize("hé", add_bos=True)
  assert list(t.token_ids) == [256, 104, 0xC3, 0xA9]
  # Decoded whole: "é" is two byte tokens, neither a character of its own.
  assert c.detokenize(t.token_ids[1:]) == "hé" and c.detokenize([]) == ""
  with pytest.raises(grpc.RpcError) as e:
    c.detokenize([104, 258])
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "[258] are outside the vocabulary" in e.value.details()
  info = c.model_info()
  assert info.model_name == "counting" and info.vocab_size == 258 and info.max_batch == 8
  assert info.tensor_parallel_size == 1
  assert c.health() == SERVING and c.health("mosaic.serving.v1.TextGeneration") == SERVING
  with pytest.raises(grpc.RpcError) as e:
    c.health("nope")
  assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_and_reflection_through_the_grpc_libraries():
  """grpc.health.v1 through grpcio-health-checking's stubs: Check and List,
  the server as a whole and the generate service, SERVING once warm; Watch
  streams NOT_SERVING as the drain begins (a stream still running). The
  services and their methods through grpcio-reflection's descriptor
  database, as grpcurl would see them."""
  from google.protobuf import descriptor_pool
  from grpc_health.v1 import health_pb2_grpc
  from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
      ProtoReflectionDescriptorDatabase)

  from serving.service import SERVICE_NAME

  engine = E.tiny_engine(max_batch=2, step_delay=0.01)
  with running(engine) as (server, c):
    health = health_pb2_grpc.HealthStub(c.channel)
    check = lambda service: health.Check(  # noqa: E731
        health_pb2.HealthCheckRequest(service=service), timeout=10).status
    assert check("") == check(SERVICE_NAME) == SERVING
    with pytest.raises(grpc.RpcError) as e:
      check("nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses
    assert {k: v.status for k, v in listed.items()} == {"": SERVING, SERVICE_NAME: SERVING}
    watches = {s: health.Watch(health_pb2.HealthCheckRequest(service=s), timeout=60)
               for s in ("", SERVICE_NAME, "nope")}
    assert [next(w).status for w in watches.values()] == [
        SERVING, SERVING, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]

    db = ProtoReflectionDescriptorDatabase(c.channel)
    services = db.get_services()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services, services
    assert "grpc.reflection.v1alpha.ServerReflection" in services, services
    svc = descriptor_pool.DescriptorPool(db).FindServiceByName(SERVICE_NAME)
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"Generate", "GenerateStream", "Tokenize", "Detokenize", "ModelInfo"}
    stream = methods["GenerateStream"]
    assert stream.server_streaming and not stream.client_streaming
    assert stream.input_type.full_name == "mosaic.serving.v1.GenerateRequest"
    assert stream.output_type.full_name == "mosaic.serving.v1.GenerateStreamChunk"
    assert "sampling" in stream.input_type.fields_by_name  # message types resolve too

    s = c.stream("a", max_tokens=100, ignore_eos=True)  # 1 s at 0.01 s a step
    next(s)
    t = threading.Thread(target=server.drain_and_stop, args=(30,))
    t.start()
    assert next(watches[""]).status == next(watches[SERVICE_NAME]).status == NOT_SERVING
    assert check("") == check(SERVICE_NAME) == NOT_SERVING  # while the stream still runs
    assert list(s)[-1].final.usage.completion_tokens == 100
    t.join(10)
    assert not t.is_alive()


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=5000), "exceeds the context"), (dict(top_logprobs=21), "top_logprobs"),
    (dict(stop_token_ids=[999]), "outside the vocabulary"),
    (dict(min_tokens=4, max_tokens=3), "min_tokens=4 must be <= max_tokens"),
    (dict(min_tokens=5000), "min_tokens (5000) exceeds the context"),
    (dict(min_tokens=300), "exceeds the 252 tokens the KV cache holds"),
    (dict(logit_bias={999: 1.0}), "logit_bias [999] are outside the vocabulary"),
    (dict(logit_bias={5: 101.0}), "logit_bias[5]=101.0 must be in [-100, 100]"),
    (dict(logit_bias={5: float("nan")}), "must be in [-100, 100]"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
    (dict(priority=3), "priority=3 needs priority scheduling"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens=0 must be >= 1"),
    (dict(allowed_token_ids=[5, 999]), "allowed_token_ids [999] are outside the vocabulary"),
    (dict(allowed_token_ids=[257], min_tokens=1), "every allowed token id ends the request"),
])
def test_bad_parameters_are_invalid_argument(counting, kw, match):
  _, c = counting
  with pytest.raises(grpc.RpcError) as e:
    c.generate("a", **kw)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert match in e.value.details()


def test_bad_prompts_are_invalid_argument(counting):
  _, c = counting
  for req in (pb.GenerateRequest(), pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])),
              pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])),
              pb.GenerateRequest(text="a" * 2000)):  # longer than the 1024 context
    with pytest.raises(grpc.RpcError) as e:
      c.stub.Generate(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.none())
_ints = st.one_of(st.integers(-2**31, 2**31 - 1), st.none())


@st.composite
def _requests(draw):
  sp = {}
  for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty"):
    v = draw(_floats)
    if v is not None:
      sp[f] = v
  counts = ("max_tokens", "min_tokens", "n", "prompt_logprobs", "truncate_prompt_tokens")
  for f in ("top_k", "top_logprobs") + counts:
    v = draw(_ints)
    if v is not None:  # counts: in range half the time
      mod = {"n": 4, "prompt_logprobs": 6}.get(f, 64)
      sp[f] = v % mod if f in counts and draw(st.booleans()) else v
  sp["seed"] = draw(st.integers(0, 2**64 - 1))
  sp["stop"] = draw(st.lists(st.text(max_size=4), max_size=3))
  sp["stop_token_ids"] = draw(st.lists(st.integers(-2**31, 2**31 - 1), max_size=3))
  sp["logit_bias"] = draw(st.dictionaries(st.integers(-5, 300), st.floats(width=32), max_size=3))
  sp["allowed_token_ids"] = draw(st.lists(st.integers(-5, 300), max_size=3))
  sp["logprobs"] = draw(st.booleans())
  sp["ignore_eos"] = draw(st.booleans())
  sp["include_stop_str_in_output"] = draw(st.booleans())
  kind = draw(st.sampled_from([None, "json", "regex", "grammar", "choice", "json_object"]))
  if kind == "choice":
    sp["structured_outputs"] = pb.StructuredOutputs(choice=pb.Choices(
        choices=draw(st.lists(st.text(max_size=4), max_size=3))))
  elif kind == "json_object":
    sp["structured_outputs"] = pb.StructuredOutputs(json_object=draw(st.booleans()))
  elif kind is not None:
    sp["structured_outputs"] = pb.StructuredOutputs(**{kind: draw(st.text(max_size=8))})
  prompt = draw(st.one_of(
      st.text(max_size=20).map(lambda t: dict(text=t)),
      st.lists(st.integers(-5, 300), max_size=20).map(lambda i: dict(token_ids=pb.TokenIds(ids=i))),
      st.lists(st.tuples(st.text(max_size=6), st.text(max_size=12)), max_size=3).map(
          lambda ms: dict(chat=pb.Chat(messages=[pb.ChatMessage(role=r, content=t)
                                                 for r, t in ms]))),
      st.just({})))
  return pb.GenerateRequest(request_id=draw(st.text(max_size=8)), sampling=pb.SamplingParams(**sp),
                            **prompt)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=_requests(), stream=st.booleans())
def test_malformed_requests_never_crash_the_server(counting, req, stream):
  server, c = counting
  try:
    if stream:
      list(c.stub.GenerateStream(req, timeout=20))
    else:
      c.stub.Generate(req, timeout=20)
  except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
  assert c.health() == SERVING
  assert server.engine.error is None


def test_raw_garbage_bytes_get_a_status_not_a_crash(counting, caplog):
  """Corrupt protobuf and invalid UTF-8 in a string field are INVALID_ARGUMENT
  with one log line each, no traceback (grpc's own answer was INTERNAL
  "Exception deserializing request!" and a traceback per request: a log
  flood any client could cause); on unary, streaming and reflection calls."""
  import logging

  server, c = counting
  raw = lambda kind, method: getattr(c.channel, kind)(  # noqa: E731
      method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
  generate = raw("unary_unary", "/mosaic.serving.v1.TextGeneration/Generate")
  stream = raw("unary_stream", "/mosaic.serving.v1.TextGeneration/GenerateStream")
  reflect = raw("stream_stream", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
  # b"\xff\xfe" as the request's text (field 2), as reflection's host (field 1)
  calls = [(lambda j: generate(j, timeout=10), b"\x12\x02\xff\xfe"),
           (lambda j: list(stream(j, timeout=10)), b"\x12\x02\xff\xfe"),
           (lambda j: list(reflect(iter([j]), timeout=10)), b"\x0a\x02\xff\xfe")]
  caplog.clear()
  with caplog.at_level(logging.INFO):
    for call, bad_utf8 in calls:
      for junk in (b"\xff\xff\xff", b"\x12\x05abc", b"\x1a\x02\x08", bad_utf8):
        with pytest.raises(grpc.RpcError) as e:
          call(junk)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "does not decode" in e.value.details()
  assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
  undecodable = [r for r in caplog.records if "undecodable" in r.getMessage()]
  assert len(undecodable) == 12 and all("\n" not in r.getMessage() for r in undecodable)
  assert "bad UTF-8" in undecodable[-1].getMessage()
  assert c.generate("a", max_tokens=2).text == "bc"


def test_full_queue_is_resource_exhausted():
  engine = E.tiny_engine(max_batch=1, max_waiting=2, step_delay=0.02)
  with running(engine) as (server, c):
    streams = [c.stream("a", max_tokens=1000, ignore_eos=True)]
    assert next(streams[0]).text == "b"  # it runs; the next two wait
    streams += [c.stream("a", max_tokens=1000, ignore_eos=True) for _ in range(2)]
    wait_for(lambda: engine.stats().waiting == 2, what="2 waiting")
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for s in streams:
      s.cancel()
    wait_for(lambda: engine.stats().running + engine.stats().waiting == 0, what="idle")
    assert engine.stats().pages_in_use == 0
    assert c.generate("a", max_tokens=2).text == "bc"


def test_cancel_and_deadline_free_all_pages():
  engine = E.tiny_engine(max_batch=4, step_delay=0.01)
  with running(engine) as (server, c):
    streams = [c.stream("abc" * 10, max_tokens=500, ignore_eos=True) for _ in range(6)]
    for s in streams[:4]:
      next(s)
    assert engine.stats().pages_in_use > 0
    t0 = time.monotonic()
    for s in streams:
      s.cancel()
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")
    assert time.monotonic() - t0 < 2.0
    assert engine.stats().running == engine.stats().waiting == 0
    with pytest.raises(grpc.RpcError) as e:
      c.generate("abc", max_tokens=500, timeout=0.3, ignore_eos=True)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as e:
      list(c.stream("abc", max_tokens=500, timeout=0.3, ignore_eos=True))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for call in (c.generate, lambda *a, **k: list(c.stream(*a, **k))):  # n = 3: all of them
      with pytest.raises(grpc.RpcError) as e:
        call("abc", max_tokens=500, timeout=0.3, ignore_eos=True, n=3)
      assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: engine.stats().pages_in_use == 0 and engine.stats().running == 0,
             what="pages freed after deadlines")
    engine.alloc.check()
    # The 8 expired calls' requests end as DEADLINE (their calls' own cancel
    # counted them as cancelled, a queued one always).
    wait_for(lambda: 'requests_finished_total{reason="deadline"} 8.0' in server.metrics.render(),
             what="8 deadlines counted")


def test_bearer_token_is_required_when_set():
  with running(E.tiny_engine(), auth_token="s3cret") as (server, c):
    assert c.generate("a", max_tokens=2).text == "bc"
    c.metadata = ()
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
      list(c.stream("a", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    c.metadata = (("authorization", "Bearer wrong"),)
    with pytest.raises(grpc.RpcError) as e:
      c.model_info()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert c.health() == SERVING  # probes need no token


def test_drain_refuses_new_requests_and_finishes_running():
  engine = E.tiny_engine(max_batch=2, step_delay=0.01)
  with running(engine) as (server, c):
    s = c.stream("a", max_tokens=60, ignore_eos=True)
    next(s)
    t = threading.Thread(target=server.drain_and_stop, args=(30,))
    t.start()
    wait_for(lambda: engine.stats().draining, what="draining")
    assert c.health() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(s)
    assert rest[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
    assert rest[-1].final.usage.completion_tokens == 60
    t.join(10)
    assert not t.is_alive()


def test_drain_waits_for_calls_still_sending():
  # The engine forgets a request once its last event is queued; a call that is
  # slow to send that event (a busy interpreter) must still deliver it.
  from serving.engine import api

  engine = E.tiny_engine(max_batch=2, step_delay=0.01)
  with running(engine) as (server, c):
    relay = server.servicer._events

    def slow_final(handle, context):
      for ev in relay(handle, context):
        if isinstance(ev, api.Final):
          time.sleep(1.5)  # longer than the gRPC grace the stop gives
        yield ev

    server.servicer._events = slow_final
    s = c.stream("a", max_tokens=20, ignore_eos=True)
    next(s)
    t = threading.Thread(target=server.drain_and_stop, args=(30,))
    t.start()
    rest = list(s)
    assert rest[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
    assert rest[-1].final.usage.completion_tokens == 20
    t.join(10)
    assert not t.is_alive()


def test_a_taken_http_port_fails_the_constructor_and_frees_the_other_ports():
  """Ports are bound before the warm-up; a taken one leaves none bound."""
  import socket

  from serving.service import Server

  def free_port():
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      return s.getsockname()[1]

  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    grpc_port, metrics_port = free_port(), free_port()
    with pytest.raises(OSError, match=f"cannot serve OpenAI HTTP on 127.0.0.1:{busy}"):
      Server(E.tiny_engine(), port=grpc_port, metrics_port=metrics_port, http_port=busy)
  for p in (grpc_port, metrics_port):
    with socket.socket() as s:
      s.bind(("127.0.0.1", p))  # OSError if the failed server kept it


def test_metrics_are_exposed():
  import urllib.request

  engine = E.tiny_engine()
  with running(engine, metrics_port=0) as (server, c):
    c.generate("a", max_tokens=4)
    c.generate("x", max_tokens=20)  # EOS after "~"
    engine.preemptions = 3  # (what the engine counts as it preempts)
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{server.metrics_http.server_port}/metrics").read().decode()
  for name in ("time_to_first_token_seconds_count 2", "generation_tokens_total 11.0",
               "kv_pages_total 63", "inter_token_latency_seconds_bucket",
               "queue_time_seconds_count 2", "request_latency_seconds_count 2",
               "time_per_output_token_seconds_count 2",
               'requests_finished_total{reason="eos"} 1.0',
               'requests_finished_total{reason="length"} 1.0', "preemptions_total 3.0",
               "requests_running 0", "requests_waiting 0", "kv_pages_in_use 0",
               "compiles_total "):
    assert "mosaic_serving_" + name in body, name


def test_an_engine_failure_fails_requests_and_health():
  engine = E.tiny_engine()

  def broken(*args):
    raise RuntimeError("device lost")

  engine.runner.decode = broken
  with running(engine) as (server, c):
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=5)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "device lost" in e.value.details()
    assert c.health() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=5)
    assert e.value.code() == grpc.StatusCode.INTERNAL


class _Aborted(Exception):
  pass


class _Context:
  """What the servicer uses of a grpc.ServicerContext; the deadline is the engine's."""

  def __init__(self, remaining):
    self.remaining, self.status = remaining, None

  def time_remaining(self):
    return self.remaining

  def is_active(self):
    return True

  def add_callback(self, fn):
    pass

  def abort(self, code, details):
    self.status = (code, details)
    raise _Aborted(details)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_deadline_is_the_call_status_not_a_response(stream):
  """The engine ending a request at its deadline aborts the call with
  DEADLINE_EXCEEDED even when the client's own timer has not fired yet."""
  from serving.metrics import Metrics
  from serving.service import TextGenerationServicer

  engine = E.tiny_engine(max_batch=2, step_delay=0.01)
  engine.start()
  try:
    svc = TextGenerationServicer(engine, Metrics(engine))
    req = pb.GenerateRequest(text="abc", sampling=pb.SamplingParams(max_tokens=200,
                                                                     ignore_eos=True))
    ctx = _Context(remaining=0.2)
    with pytest.raises(_Aborted):
      if stream:
        list(svc.GenerateStream(req, ctx))
      else:
        svc.Generate(req, ctx)
    assert ctx.status[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: engine.stats().pages_in_use == 0 and engine.stats().running == 0,
             what="pages freed after the deadline")
  finally:
    engine.stop()


def _engine_events(engine, request):
  """Runs ``request`` on an engine driven by ``step()`` here; its events in order."""
  from serving.engine import api

  handle = engine.submit(request)
  events = []
  while not events or not isinstance(events[-1], (api.Final, api.Failed)):
    engine.step()
    while not handle.events.empty():
      events.append(handle.events.get_nowait())
  return events


@pytest.mark.parametrize("decode_steps", [1, 3])
@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_groups_tokens_and_loses_none(interval, decode_steps):
  """The first token goes out at once, then at least ``interval`` tokens per
  event, a step's tokens together (``decode_steps`` of them); the Final comes
  after whatever was left, ids, text and logprobs all complete."""
  from serving.engine import api

  def run(max_tokens, **kw):
    engine = E.tiny_engine(max_batch=4, stream_interval=interval, decode_steps=decode_steps)
    req = api.Request("r", prompt_ids=[ord("a")], add_bos=False, sampling=api.SamplingParams(
        max_tokens=max_tokens, logprobs=True, top_logprobs=1, **kw))
    *deltas, final = _engine_events(engine, req)
    assert isinstance(final, api.Final) and all(isinstance(d, api.Delta) for d in deltas)
    return deltas, final

  deltas, final = run(10)
  sizes = [len(d.token_ids) for d in deltas]
  # 10 tokens: the prefill's, then steps of decode_steps tokens.
  assert sizes == {(1, 1): [1] * 10, (4, 1): [1, 4, 4, 1], (1, 3): [1, 3, 3, 3],
                   (4, 3): [1, 6, 3]}[interval, decode_steps], sizes
  assert [i for d in deltas for i in d.token_ids] == [ord(x) for x in _expected("a", 10)]
  assert "".join(d.text for d in deltas) == _expected("a", 10)
  assert [lp.token_id for d in deltas for lp in d.logprobs] == [ord(x) for x in _expected("a", 10)]
  assert final.reason == api.FinishReason.LENGTH and final.completion_tokens == 10
  # A stop string ends the request mid-interval: the text before it still arrives.
  deltas, final = run(30, stop=("hij",))
  assert "".join(d.text for d in deltas) == "bcdefg" and final.reason == api.FinishReason.STOP
  # EOS after "~": buffered tokens arrive before the Final, the EOS itself is not sent.
  engine = E.tiny_engine(max_batch=4, stream_interval=interval)
  *deltas, final = _engine_events(engine, api.Request("e", prompt_ids=[ord("x")], add_bos=False))
  assert "".join(d.text for d in deltas) == "yz{|}~" and final.reason == api.FinishReason.EOS


def test_stream_interval_over_grpc_gives_fewer_messages():
  """The engine emits [1, 8, 8]; a server thread that lags merges queued
  deltas, so messages may only end where an engine delta ended. The step
  delay (8 steps, 0.4 s, between deltas) keeps the later deltas apart on a
  busy machine, where the undelayed engine could finish before the first
  message was sent and arrive as one."""
  with running(E.tiny_engine(max_batch=8, stream_interval=8, step_delay=0.05)) as (_, c):
    chunks = [ch for ch in c.stream("a", max_tokens=17) if ch.token_ids]
  assert "".join(ch.text for ch in chunks) == _expected("a", 17)
  ends = np.cumsum([len(ch.token_ids) for ch in chunks]).tolist()
  assert set(ends) <= {1, 9, 17}, ends
  assert 2 <= len(chunks) <= 3, ends  # the first two may merge


def test_itl_counts_every_token_of_a_grouped_message():
  """With a stream interval of 4 the server's inter-token histogram still
  gets one sample per token of every message after the first (not one per
  message). A server thread that lags behind the engine merges what is
  queued, the first message's tokens included ([5, 4]: 4 samples)."""
  with running(E.tiny_engine(max_batch=4, stream_interval=4)) as (server, c):
    chunks = [ch for ch in c.stream("a", max_tokens=9) if ch.token_ids]
    later = sum(len(ch.token_ids) for ch in chunks[1:])
    samples = lambda: server.metrics.sample("inter_token_latency_seconds_count")  # noqa: E731
    wait_for(lambda: samples() == later, timeout=30, what=f"{later} ITL samples")
  assert [len(ch.token_ids) for ch in chunks] in ([1, 4, 4], [5, 4], [1, 8], [9])


def test_loadgen_splits_a_grouped_chunk_into_per_token_gaps():
  from serving import loadgen

  class Chunk:
    def __init__(self, k):
      self.token_ids = [7] * k

    def HasField(self, name):
      return False

  class FakeClient:
    def stream(self, prompt, **kw):
      for k in (1, 4, 4):  # 9 tokens, a chunk every 40 ms after the first
        time.sleep(0.04)
        yield Chunk(k)

  r = loadgen.run(FakeClient(), num_requests=1, input_len=2, output_len=9, concurrency=1)
  assert r["output_tokens"] == 9
  # 8 gaps of about 10 ms each (40 ms / 4 tokens), not 2 gaps of 40 ms.
  assert 8 <= r["itl_mean_ms"] <= 25, r
  assert abs(r["tpot_mean_ms"] - r["itl_mean_ms"]) < 5, r


def test_loadgen_counts_failed_and_short_requests_and_goes_on():
  """A refused request is counted with its status, the others are measured;
  outputs shorter than asked are reported (vLLM's benchmark_serving goes on
  past failures; the report said "N out" whatever came)."""
  from serving import loadgen

  class Chunk:
    token_ids = [7]

    def HasField(self, name):
      return False

  class Refused(grpc.RpcError):
    def code(self):
      return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
      return "the prompt is too long"

  class FakeClient:
    calls = 0

    def stream(self, prompt, *, max_tokens, **kw):
      FakeClient.calls += 1
      if FakeClient.calls % 3 == 0:
        raise Refused()
      yield from [Chunk()] * (max_tokens - 2)  # 2 short of what was asked

  r = loadgen.run(FakeClient(), num_requests=6, input_len=4, output_len=10, concurrency=1)
  assert (r["completed"], r["failed"]) == (4, 2), r
  assert r["errors"] == ["INVALID_ARGUMENT: the prompt is too long"]
  assert (r["output_tokens"], r["output_tokens_asked"]) == (32, 40)
  report = loadgen.format_report(r)
  assert "2 of 6 requests failed: INVALID_ARGUMENT" in report, report
  assert "32 output tokens, fewer than the 40 asked for" in report, report


def test_loadgen_range_ratio_draws_ragged_lengths():
  """range_ratio r: each request's prompt and output lengths drawn from
  [L(1-r), L(1+r)]; r = 0 sends every request at exactly L; r outside [0, 1)
  is refused."""
  from serving import loadgen

  class Chunk:
    token_ids = [7]

    def HasField(self, name):
      return False

  class FakeClient:
    def __init__(self):
      self.sent = []

    def stream(self, prompt, *, max_tokens, **kw):
      self.sent.append((len(prompt), max_tokens))
      for _ in range(max_tokens):
        yield Chunk()

  c = FakeClient()
  r = loadgen.run(c, num_requests=48, input_len=40, output_len=10, concurrency=8,
                  range_ratio=0.5)
  ins, outs = zip(*c.sent)
  assert all(20 <= n <= 60 for n in ins) and all(5 <= n <= 15 for n in outs), c.sent
  assert len(set(ins)) > 5 and len(set(outs)) > 3, c.sent  # drawn, not fixed
  assert r["output_tokens"] == sum(outs) and r["input_tokens"] == sum(ins)
  assert "x0.5..1.5" in loadgen.format_report(r)
  c = FakeClient()
  loadgen.run(c, num_requests=4, input_len=40, output_len=10, concurrency=2)
  assert c.sent == [(40, 10)] * 4
  for bad in (-0.1, 1.0):
    with pytest.raises(ValueError, match="range_ratio"):
      loadgen.run(c, num_requests=4, input_len=40, output_len=10, concurrency=2,
                  range_ratio=bad)


def test_loadgen_shared_prefixes_reach_the_prefix_cache(counting):
  """shared_prefix_len P, G groups: request i's prompt is group i % G's prefix
  and then its own tokens; the server computes each prefix once (the others
  read it from the prefix cache, 16 tokens = 4 pages of 4 each) and the
  report counts those tokens."""
  from serving import loadgen

  _, c = counting
  sent = []

  class Recording:
    def stream(self, prompt, **kw):
      sent.append(list(prompt))
      return c.stream(prompt, **kw)

  r = loadgen.run(Recording(), num_requests=8, input_len=5, output_len=3, concurrency=4,
                  vocab=256, seed=123, shared_prefix_len=16, prefix_groups=2)
  assert sorted(map(len, sent)) == [21] * 8 and len({tuple(p[:16]) for p in sent}) == 2
  assert len({tuple(p[16:]) for p in sent}) == 8
  assert r["input_tokens"] == 8 * 21 and r["cached_prompt_tokens"] == 6 * 16, r
  assert "2 shared prefix(es) of 16; 96 of 168 prompt tokens cached" in loadgen.format_report(r)


def test_loadgen_structured_requests_end_with_their_grammar(counting):
  """structured: every request carries it; with "[a-c]{2}" each ends after 2
  of its 8 tokens, and the report counts the tokens that came."""
  from serving import loadgen

  _, c = counting
  r = loadgen.run(c, num_requests=6, input_len=5, output_len=8, concurrency=3, vocab=256,
                  structured={"regex": "[a-c]{2}"})
  assert r["output_tokens"] == 12 and r["structured"] == {"regex": "[a-c]{2}"}, r


def test_step_times_split_out_the_launch_and_the_tokens():
  """step_times hold the time spent building inputs and dispatching the
  device calls, and on the tokens read back: a runner that takes 20 ms per
  call shows in the first, a slow flush in the second. Each record also says
  what it dispatched: prompt tokens, decode rows and steps."""
  import time

  from serving.engine import api

  engine = E.tiny_engine(max_batch=4, step_delay=0.02)
  flush = engine._flush_deferred
  engine._flush_deferred = lambda: (time.sleep(0.01), flush())[1]
  _engine_events(engine, api.Request("r", prompt_ids=[ord("a"), ord("b")], add_bos=False,
                                     sampling=api.SamplingParams(max_tokens=3)))
  launched = [t for t in engine.step_times if t.launched]
  assert launched and all(0.02 <= t.launch and 0.01 <= t.tokens
                          and t.launch + t.tokens <= t.wall - t.wait
                          for t in launched), list(engine.step_times)
  # The prompt's 2 tokens, then the 2 tokens after the first one decoded a step a call.
  assert [(t.prefill_tokens, t.decodes, t.steps) for t in launched] == [(2, 0, 0), (0, 1, 1),
                                                                         (0, 1, 1)]
  starts = [t.start for t in engine.step_times]
  assert starts == sorted(starts)


def test_mixed_steps_over_grpc_give_the_known_continuations():
  """Requests arriving while others decode share their steps (mixed_steps, a
  small decode_prefill_budget splits the prompts): every continuation is the
  known one, mixed steps did run, and every page comes back."""
  import concurrent.futures

  engine = E.tiny_engine(max_batch=8, num_pages=200, step_delay=0.002, mixed_steps=True,
                         decode_prefill_budget=8, min_chunk=4, prefill_chunk=32)
  prompts = [chr(ord("a") + i % 20) * (3 + 5 * i) for i in range(12)]
  with running(engine) as (_, c):
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
      texts = list(pool.map(lambda p: c.generate(p, max_tokens=9, ignore_eos=True).text,
                            prompts))
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")
  assert texts == [_expected(p[-1], 9) for p in prompts]
  assert engine.mixed_steps_run > 0


def test_n_completions_unary_and_streamed(counting):
  """n completions of one prompt: Generate returns them all (completion 0's
  fields at the top too), GenerateStream tags each chunk with its completion
  and ends each with its own final chunk."""
  server, c = counting
  r = c.generate("x", max_tokens=4, n=3, logprobs=True)
  assert [x.index for x in r.completions] == [0, 1, 2]
  for x in r.completions:
    assert x.text == "yz{|" and list(x.token_ids) == [ord(ch) for ch in "yz{|"]
    assert x.finish_reason == pb.FINISH_REASON_LENGTH and x.usage.completion_tokens == 4
    assert len(x.logprobs) == 4
  assert r.text == "yz{|" and r.usage.completion_tokens == 4 and len(r.logprobs) == 4
  assert not c.generate("x", max_tokens=4).completions  # n = 1: the top-level fields only
  chunks = list(c.stream("x", max_tokens=9, n=3))  # 3 stop at EOS after "~"
  assert sorted({ch.index for ch in chunks}) == [0, 1, 2]
  for i in range(3):
    mine = [ch for ch in chunks if ch.index == i]
    assert "".join(ch.text for ch in mine) == "yz{|}~"
    assert [ch.HasField("final") for ch in mine] == [False] * (len(mine) - 1) + [True]
    assert mine[-1].final.finish_reason == pb.FINISH_REASON_EOS
  assert chunks[-1].HasField("final")
  wait_for(lambda: server.engine.stats().pages_in_use == 0, what="pages freed")


@pytest.mark.parametrize("n", [0, 65])
def test_bad_n_is_invalid_argument(counting, n):
  _, c = counting
  with pytest.raises(grpc.RpcError) as e:
    c.generate("a", n=n)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n=" in e.value.details()


def test_n_completions_are_accepted_all_or_none_and_cancelled_together():
  """A call for n completions that the queue cannot take whole is refused and
  leaves nothing queued; cancelling a call ends all of its completions."""
  engine = E.tiny_engine(max_batch=1, max_waiting=2, step_delay=0.02)
  with running(engine) as (server, c):
    s = c.stream("a", max_tokens=1000, ignore_eos=True)
    assert next(s).text == "b"  # it runs: the queue has room for 2
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=2, n=3)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    wait_for(lambda: engine.stats().waiting == 0, what="the refused call's requests gone")
    s.cancel()
    many = c.stream("a", max_tokens=1000, ignore_eos=True, n=2)
    assert next(many).token_ids
    assert engine.stats().running + engine.stats().waiting == 2
    many.cancel()
    wait_for(lambda: engine.stats().running + engine.stats().waiting == 0, what="idle")
    assert engine.stats().pages_in_use == 0
    r = c.generate("a", max_tokens=2, n=2)
    assert [x.text for x in r.completions] == ["bc", "bc"]


def test_an_unexpected_submit_failure_admits_none_of_the_calls_completions():
  """n = 3 where the third completion's checks raise something the service
  does not map to a status: the call fails and none of its requests runs
  (one admission decision); Engine.submit_all's default, for engines that
  only submit one by one, ends the ones accepted before it."""
  from serving.engine import api

  engine = E.tiny_engine(max_batch=4, step_delay=0.01)
  prepare, calls = engine._prepare, []

  def flaky(req):
    calls.append(req.request_id)
    if len(calls) == 3:
      raise RuntimeError("submit broke")
    return prepare(req)

  engine._prepare = flaky
  with running(engine) as (server, c):
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=1000, ignore_eos=True, n=3)
    assert e.value.code() == grpc.StatusCode.UNKNOWN
    assert engine.stats().running + engine.stats().waiting == 0 and engine.steps == 0
    engine._prepare, calls[:] = prepare, []
    submit = engine.submit

    def flaky_submit(req):
      calls.append(req.request_id)
      if len(calls) == 3:
        raise RuntimeError("submit broke")
      return submit(req)

    engine.submit = flaky_submit
    reqs = [api.Request(f"r{i}", prompt_ids=[97], add_bos=False,
                        sampling=api.SamplingParams(max_tokens=1000, ignore_eos=True))
            for i in range(3)]
    with pytest.raises(RuntimeError, match="submit broke"):
      api.Engine.submit_all(engine, reqs)
    # Within a few steps, not the ~10 s that 1000 tokens of 10 ms steps take.
    wait_for(lambda: engine.stats().running + engine.stats().waiting == 0, timeout=3.0,
             what="the accepted completions cancelled")
    assert engine.stats().pages_in_use == 0


def test_prompt_logprobs_unary_streamed_and_refused_unless_enabled():
  """The counting model puts logit 10 on the next byte and -10 elsewhere, so a
  prompt byte that follows its predecessor has logprob ~0 and one that does
  not ~-20. Unary and streamed calls carry them (streamed: in the final
  chunk); with n = 2 completion 0 alone does. A server not started with
  --enable-prompt-logprobs refuses the field, and so does a bad value."""
  with running(E.tiny_engine(max_batch=2)) as (_, plain):
    with pytest.raises(grpc.RpcError) as e:
      plain.generate("ab", prompt_logprobs=1)
  assert (e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
          and "--enable-prompt-logprobs" in e.value.details())
  lz = np.log(np.exp(10.0) + 257 * np.exp(-10.0))  # the log partition of a position

  def check(lps, k):
    assert [x.token_id for x in lps] == [98, 100, 101]  # "b", "d", "e" after "a"
    np.testing.assert_allclose([x.logprob for x in lps], [10 - lz, -10 - lz, 10 - lz],
                               atol=1e-5)
    # The likeliest after "a", "b", "d" are "b", "c", "e"; then the lowest id of the rest.
    assert [[t.token_id for t in x.top] for x in lps] == [[98, 0][:k], [99, 0][:k],
                                                          [101, 0][:k]]

  with running(E.tiny_engine(max_batch=4, prompt_logprobs=True)) as (server, c):
    r = c.generate([97, 98, 100, 101], max_tokens=3, prompt_logprobs=2)
    check(r.prompt_logprobs, 2)
    assert r.text == "fgh" and r.usage.cached_prompt_tokens == 0
    chunks = list(c.stream([97, 98, 100, 101], max_tokens=3, prompt_logprobs=0))
    assert all(not ch.final.prompt_logprobs for ch in chunks[:-1])
    check(chunks[-1].final.prompt_logprobs, 0)
    r = c.generate([97, 98, 100, 101], max_tokens=3, n=2, prompt_logprobs=1)
    check(r.completions[0].prompt_logprobs, 1)
    check(r.prompt_logprobs, 1)
    assert not r.completions[1].prompt_logprobs
    assert not c.generate([97, 98], max_tokens=2).prompt_logprobs  # not asked for
    for bad in (-1, 21):
      with pytest.raises(grpc.RpcError) as e:
        c.generate("ab", prompt_logprobs=bad)
      assert (e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
              and "prompt_logprobs=" in e.value.details())
    wait_for(lambda: server.engine.stats().pages_in_use == 0, what="pages freed")


def test_chat_messages_go_through_the_chat_template(counting):
  """A chat prompt is the template's text ("role: content" lines, then
  "assistant: " for the counting model's byte tokenizer), tokenized without
  BOS: the same tokens as that text sent as ids."""
  _, c = counting
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
  rendered = list(b"system: be brief\nuser: hi\nassistant: ")
  r = c.generate(msgs, max_tokens=5)
  assert r.text == '!"#$%' and r.usage.prompt_tokens == len(rendered)  # after " "
  assert list(c.generate(rendered, max_tokens=5).token_ids) == list(r.token_ids)
  chunks = list(c.stream(msgs, max_tokens=5))
  assert "".join(ch.text for ch in chunks) == '!"#$%'
  t = c.tokenize(msgs)  # the tokens a Generate call gets, and the template's text
  assert list(t.token_ids) == rendered and t.prompt == bytes(rendered).decode()
  assert list(c.tokenize(msgs, add_generation_prompt=False).token_ids) == rendered[:-11]
  r = c.generate(msgs[1:], max_tokens=3, add_generation_prompt=False)  # ends in "\n"
  assert list(r.token_ids) == [11, 12, 13] and r.usage.prompt_tokens == len("user: hi\n")
  for call, req in ((c.stub.Generate, pb.GenerateRequest(chat=pb.Chat())),
                    (c.stub.Tokenize, pb.TokenizeRequest(chat=pb.Chat()))):
    with pytest.raises(grpc.RpcError) as e:
      call(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the chat has no messages" in e.value.details()
  # What a chat's tokens do not depend on is refused, not dropped.
  chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
  for req, field in ((pb.TokenizeRequest(text="hi", chat=chat), "text"),
                     (pb.TokenizeRequest(add_bos=True, chat=chat), "add_bos")):
    with pytest.raises(grpc.RpcError) as e:
      c.stub.Tokenize(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"{field} does not go with chat: give text or a chat"
  with pytest.raises(ValueError, match="add_bos applies to text"):
    c.tokenize(msgs, add_bos=True)
  with pytest.raises(ValueError, match="add_generation_prompt applies to chat messages"):
    c.tokenize("hi", add_generation_prompt=False)
  with pytest.raises(ValueError, match="add_generation_prompt applies to chat messages"):
    c.generate("hi", add_generation_prompt=False)


def test_chat_templates_missing_refusing_or_writing_bos():
  """No template, or one that raises on the messages: INVALID_ARGUMENT's
  message says so. A template that writes BOS as text gets the BOS id once,
  for a Hugging Face tokenizer as for a sentencepiece one (which would spell
  "<s>" out)."""
  import tokenizers
  from tokenizers import models as tk_models, pre_tokenizers

  from models import tokenizer as tok_lib

  engine = E.tiny_engine()

  def ids(messages=(("user", "hi"),)):
    return engine._prompt_ids(E.Request("r", messages=messages))

  engine.tok = type(engine.tok)()
  engine.tok.chat_template = None
  with pytest.raises(E.InvalidRequest, match="has no chat template"):
    ids()
  engine.tok.chat_template = ("{% if messages[0]['role'] != 'system' %}"
                              "{{ raise_exception('start with a system message') }}{% endif %}")
  with pytest.raises(E.InvalidRequest, match="chat template: .*start with a system message"):
    ids()
  with pytest.raises(E.InvalidRequest, match="exactly one"):
    engine._prompt_ids(E.Request("r", prompt_text="a", messages=(("user", "hi"),)))
  template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
  vocab = {"<s>": 0, "</s>": 1, **{ch: 2 + i for i, ch in enumerate("[]hi<s>/")}}
  tk = tokenizers.Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
  tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  tk.add_special_tokens(["<s>", "</s>"])
  engine.tok = tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,), chat_template=template)
  assert ids() == [0] + [vocab[ch] for ch in "[hi]"]
  sp = object.__new__(tok_lib.SentencePieceTokenizer)  # encode: one id a char
  sp.bos_id, sp.bos_token, sp.chat_template = 7, "<s>", template
  sp.encode = lambda text: [ord(ch) for ch in text]
  engine.tok = sp
  assert ids() == [7] + [ord(ch) for ch in "[hi]"]


def test_text_prompt_gets_bos_only_where_the_tokenizer_adds_one():
  """A text prompt's special tokens are the tokenizer's (vLLM's
  add_special_tokens): BOS first where the model's tokenizer puts one before
  a plain prompt, none where it does not (SmolLM2's GGUF says
  tokenizer.ggml.add_bos_token = false: a BOS there is a prompt the model
  was not trained on), none when the request turns special tokens off."""
  import tokenizers
  from tokenizers import models as tk_models, pre_tokenizers

  from models import tokenizer as tok_lib

  engine = E.tiny_engine()
  vocab = {"<s>": 0, "</s>": 1, "h": 2, "i": 3}
  tk = tokenizers.Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
  tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  tk.add_special_tokens(["<s>", "</s>"])
  fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "</s>", "h", "i"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
  for add_bos_field, want in ((False, [2, 3]), (True, [0, 2, 3]), (None, [2, 3])):
    f = dict(fields) if add_bos_field is None else {
        **fields, "tokenizer.ggml.add_bos_token": add_bos_field}
    engine.tok = tok_lib.from_gguf_fields(f)
    assert engine.tok.encode("hi") == [2, 3]
    assert engine._prompt_ids(E.Request("r", prompt_text="hi")) == want, add_bos_field
    assert engine._prompt_ids(E.Request("r", prompt_text="hi", add_bos=False)) == [2, 3]
    assert engine.tokenize("hi", add_bos=True) == want
  # A Hugging Face tokenizer.json: BOS where its post-processor writes one.
  engine.tok = tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,))
  assert engine._prompt_ids(E.Request("r", prompt_text="hi")) == [2, 3]
  tk.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", 0)])
  engine.tok = tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,))
  assert engine._prompt_ids(E.Request("r", prompt_text="hi")) == [0, 2, 3]
  # EOS where the post-processor appends one ("<s> $A </s>"; GGUF's
  # add_eos_token), as the tokenizer's own encode(add_special_tokens=True).
  tk.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
  engine.tok = tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,))
  assert engine._prompt_ids(E.Request("r", prompt_text="hi")) == tk.encode("hi").ids == [0, 2, 3, 1]
  assert engine._prompt_ids(E.Request("r", prompt_text="hi", add_bos=False)) == [2, 3]
  tk.post_processor = tokenizers.processors.TemplateProcessing(
      single="$A </s>", special_tokens=[("</s>", 1)])
  engine.tok = tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,))
  assert engine._prompt_ids(E.Request("r", prompt_text="hi")) == [2, 3, 1]
  engine.tok = tok_lib.from_gguf_fields({**fields, "tokenizer.ggml.add_eos_token": True})
  assert engine._prompt_ids(E.Request("r", prompt_text="hi")) == [2, 3, 1]


def test_a_call_of_n_completions_is_one_admission_decision():
  """On an idle server with --max-waiting 2, n = 4 runs (its completions fill
  the batch), where each completion counted as one more waiting request
  ("2 requests are waiting already", RESOURCE_EXHAUSTED forever). A call that
  can never fit (n over max_batch + max_waiting) is INVALID_ARGUMENT naming
  the limits, not a retry; while the server is full, RESOURCE_EXHAUSTED says
  what holds it."""
  engine = E.tiny_engine(max_batch=4, max_waiting=2, step_delay=0.002)
  with running(engine) as (server, c):
    for n in (4, 6):
      r = c.generate("a", max_tokens=3, n=n)
      assert [x.text for x in r.completions] == ["bcd"] * n
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=3, n=7)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-batch" in e.value.details() and "--max-waiting" in e.value.details()
    s = c.stream("a", max_tokens=1000, ignore_eos=True, n=5)
    next(s)
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=3, n=2)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 requests running and 1 waiting" in e.value.details(), e.value.details()
    assert c.generate("a", max_tokens=3).text == "bcd"  # the one place left
    s.cancel()
    wait_for(lambda: engine.stats().pages_in_use == engine.stats().running == 0, what="idle")
    engine.alloc.check()


def test_a_burst_is_admitted_up_to_max_batch_plus_max_waiting():
  """12 calls at once on max_batch 4, max_waiting 2: 6 are admitted (4 run,
  2 wait), 6 refused, however fast they come (submissions not yet seen by
  the scheduler counted as waiting, so 3-4 were admitted)."""
  import concurrent.futures

  engine = E.tiny_engine(max_batch=4, max_waiting=2, step_delay=0.005)
  with running(engine) as (server, c):
    barrier = threading.Barrier(12)

    def call(_):
      barrier.wait()
      try:
        return c.generate("a", max_tokens=300, ignore_eos=True, timeout=20).finish_reason
      except grpc.RpcError as e:
        return e.code()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
      codes = list(pool.map(call, range(12)))
    assert codes.count(pb.FINISH_REASON_LENGTH) == 6, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6, codes
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")


def test_drain_cancels_at_its_timeout_and_streams_end_with_a_status():
  """A drain whose requests outlast its timeout cancels them at the timeout
  (within 0.5 s, and the server stops then), not 5 s later while they go
  on generating: the gRPC stream ends UNAVAILABLE, the HTTP stream with an
  error event and [DONE]."""
  import http.client
  import json

  engine = E.tiny_engine(max_batch=4, step_delay=0.01)
  with running(engine, http_port=0) as (server, c):
    stream = c.stream("a", max_tokens=1000, ignore_eos=True)
    next(stream)
    conn = http.client.HTTPConnection("127.0.0.1", server.openai_http.server_port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}))
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")  # (the chunks decoded)
    t0 = time.monotonic()
    drain = threading.Thread(target=server.drain_and_stop, args=(1.0,))
    drain.start()
    with pytest.raises(grpc.RpcError) as e:
      for _ in stream:
        pass
    ended = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert 1.0 <= ended < 2.0, ended  # (0.5 s target; room for a loaded CI machine)
    events = [x[len("data: "):] for x in r.read().decode().split("\n\n") if x.strip()]
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503, events[-2:]
    drain.join(5)
    assert not drain.is_alive() and time.monotonic() - t0 < 2.5
    assert engine.stats().pages_in_use == 0
