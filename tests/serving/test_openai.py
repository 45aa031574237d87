"""The OpenAI-compatible HTTP endpoints (serving.openai_api) over the counting
engine, whose output is known, through the official openai client and a
plain HTTP client."""

import http.client
import json
import math
import socket
import time

import openai as sdk  # (the official client; the fixture below is named openai)
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serving import engine as E

from tests.serving.conftest import running, wait_for

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def openai():
  with running(E.tiny_engine(max_batch=8, max_waiting=64, prompt_logprobs=True),
               http_port=0) as (server, c):
    yield server, server.openai_http.server_port


def _post(port, path, body, token=None, raw=None):
  """(status, parsed JSON) or (status, [SSE events]) for a stream."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  headers = {"Content-Type": "application/json"}
  if token:
    headers["Authorization"] = f"Bearer {token}"
  conn.request("POST", path, body=raw if raw is not None else json.dumps(body), headers=headers)
  r = conn.getresponse()
  data = r.read().decode()
  conn.close()
  if r.getheader("Content-Type") == "text/event-stream":
    events = [e[len("data: "):] for e in data.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    return r.status, [json.loads(e) for e in events[:-1]]
  return r.status, json.loads(data)


def _http(port, method, path, body: bytes | None = None, headers=None):
  """(status, headers with lower-case names, parsed JSON) of one request."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  conn.request(method, path, body=body, headers=headers or {})
  r = conn.getresponse()
  out = r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
  conn.close()
  return out


def _client(port, key="none") -> sdk.OpenAI:
  return sdk.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0,
                    timeout=30)


def _get(port, path):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  conn.request("GET", path)
  r = conn.getresponse()
  out = r.status, json.loads(r.read())
  conn.close()
  return out


def test_models_health_and_completions(openai):
  """/v1/completions: the counting model's known text, OpenAI's object
  shape, usage (BOS + "a"), n completions, streamed text equal to unary."""
  _, port = openai
  assert _get(port, "/health") == (200, {"status": "ok"})
  status, models = _get(port, "/v1/models")
  assert status == 200 and models["data"][0]["id"] == "counting"
  assert abs(models["data"][0]["created"] - time.time()) < 3600  # the server's start
  # max_model_len: what one request can hold, here the KV cache's 252 tokens
  # (fewer than the 1,024 of the context), as the requests are refused.
  server, _ = openai
  assert models["data"][0]["max_model_len"] == server.engine.capacity < 1024
  assert _post(port, "/tokenize", {"prompt": "a"})[1]["max_model_len"] == server.engine.capacity
  assert _get(port, "/v1/models/counting") == (200, models["data"][0])
  status, r = _get(port, "/v1/models/org/other")
  assert status == 404 and "serves 'counting'" in r["error"]["message"], r
  status, r = _post(port, "/v1/completions",
                    {"model": "counting", "prompt": "a", "max_tokens": 5, "temperature": 0})
  assert status == 200 and r["object"] == "text_completion" and r["id"].startswith("cmpl-")
  assert r["choices"] == [{"index": 0, "text": "bcdef", "logprobs": None,
                           "finish_reason": "length", "stop_reason": None}]
  assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
  status, r = _post(port, "/v1/completions", {"prompt": [ord("k")], "max_tokens": 3,
                                              "temperature": 0, "n": 2, "stop": "m"})
  assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"])
          for c in r["choices"]] == [(0, "l", "stop", "m"), (1, "l", "stop", "m")]
  status, chunks = _post(port, "/v1/completions", {
      "prompt": "a", "max_tokens": 5, "temperature": 0, "stream": True,
      "stream_options": {"include_usage": True}})
  assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "bcdef"
  assert chunks[-2]["choices"][0]["finish_reason"] == "length"
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_chat_completions_unary_and_streamed(openai):
  """The messages go through the chat template (as over gRPC); the stream
  starts with the assistant role and ends with the finish reason."""
  _, port = openai
  status, r = _post(port, "/v1/chat/completions",
                    {"messages": CHAT, "max_tokens": 5, "temperature": 0})
  assert status == 200 and r["object"] == "chat.completion"
  assert r["choices"][0]["message"] == {"role": "assistant", "content": '!"#$%'}
  assert r["usage"]["prompt_tokens"] == len("system: be brief\nuser: hi\nassistant: ")
  status, chunks = _post(port, "/v1/chat/completions", {
      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
      "max_completion_tokens": 3, "temperature": 0, "stream": True})
  assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == '!"#'
  assert chunks[-1]["object"] == "chat.completion.chunk"
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_in_openai_shapes(openai):
  """Completions: logprobs=k gives tokens, their logprobs and k alternatives
  by text; chat: logprobs + top_logprobs per content token. The counting
  model's next byte has logprob ~0 (+10 against -10 for the rest)."""
  _, port = openai
  _, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 3, "temperature": 0,
                                          "logprobs": 2})
  lp = r["choices"][0]["logprobs"]
  assert lp["tokens"] == ["b", "c", "d"] and all(abs(v) < 1e-6 for v in lp["token_logprobs"])
  assert [len(t) for t in lp["top_logprobs"]] == [2, 2, 2] and "c" in lp["top_logprobs"][1]
  assert lp["text_offset"] == [0, 1, 2]
  # logprobs=0: each position's own token alone; streamed, the offsets run on
  # across chunks.
  _, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 3, "temperature": 0,
                                          "logprobs": 0})
  assert [list(t) for t in r["choices"][0]["logprobs"]["top_logprobs"]] == [["b"], ["c"], ["d"]]
  _, chunks = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 3, "temperature": 0,
                                               "logprobs": 0, "stream": True})
  offsets = [o for c in chunks if c["choices"][0]["logprobs"]
             for o in c["choices"][0]["logprobs"]["text_offset"]]
  assert offsets == [0, 1, 2], chunks
  _, r = _post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                               "temperature": 0, "logprobs": True,
                                               "top_logprobs": 1})
  content = r["choices"][0]["logprobs"]["content"]
  assert [x["token"] for x in content] == ["!", '"']
  assert content[0]["top_logprobs"][0]["token"] == "!" and content[0]["bytes"] == [33]
  assert all(math.isfinite(x["logprob"]) for x in content)
  # A token that is part of a character: its piece is U+FFFD, its bytes its own
  # (what OpenAI's bytes field is for: joined, they spell the character).
  server, _ = openai
  assert server.engine.token_pieces([0xC3]) == ["\ufffd"]
  assert server.engine.token_bytes([0xC3, 0xA9, ord("!")]) == [[0xC3], [0xA9], [33]]
  _, r = _post(port, "/v1/chat/completions", {
      "messages": [{"role": "user", "content": "\u00e9"}], "max_tokens": 1, "temperature": 0,
      "logprobs": True, "logit_bias": {"195": 100}})
  assert r["choices"][0]["logprobs"]["content"][0]["bytes"] == [195], r


def test_structured_outputs_and_response_format(openai):
  """vLLM's structured_outputs and guided_* fields, and OpenAI's
  response_format, constrain the output (the counting model's greedy text
  under each grammar is known)."""
  _, port = openai
  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
  for extra, want in [
      ({"structured_outputs": {"regex": "[b-d]+0"}}, "bcd0"),
      ({"guided_choice": ["xyz", "bcq"]}, "bcq"),
      ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                   "schema": schema}}},
       '{"ok":false}'),
  ]:
    _, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 20, "temperature": 0,
                                            **extra})
    assert r["choices"][0]["text"] == want, extra
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path, body, status, match", [
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": ["a", ["b"]]}, 400, "a list of either"),
    ("/v1/completions", {"prompt": []}, 400, "a list of either"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n=0"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "lots"}, 400, "must be an integer"),
    ("/v1/completions", {"prompt": "a", "stop": [["x"]]}, 400, "a list of strings"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 2.5}, 400, "an integer"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [1.5]}, 400, "integers"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "token id -> number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": 3}, 400, "true or false"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "(ab"}, 400, "unclosed group"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "yaml"}}, 400, "yaml"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/embeddings", {"input": "a"}, 404, "no route"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "serves 'counting'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, 400, "tool"),
    ("/v1/completions", {"prompt": "a", "suffix": "z"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens=0 must be >= 1"),
])
def test_bad_requests_get_openai_errors(openai, path, body, status, match):
  _, port = openai
  got, r = _post(port, path, body)
  assert got == status and r["error"]["code"] == status and match in r["error"]["message"], r


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs",
     "logprobs=21 must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "top_logprobs=21 must be in [0, 20]"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature", "temperature=-1"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}, "seed", f"seed={2**64}"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, "top_k", "top_k=-2"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids",
     "must not be empty"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens",
     "min_tokens=3 must be <= max_tokens=2"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2, "min_tokens": 3},
     "min_tokens", "min_tokens=3 must be <= max_tokens=2"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "response_format of type json_schema needs its json_schema"),
    # Refused by the engine at submit (it knows the context and the vocabulary).
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6},
     "max_completion_tokens", "+ max_completion_tokens (1000000) exceeds the context"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**6}, "max_tokens",
     "+ max_tokens (1000000) exceeds the context"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids",
     "stop_token_ids [1000000] are outside the vocabulary"),
])
def test_a_bad_value_names_the_body_field_it_came_in(openai, path, body, param, message):
  """The error's param and message name the field as the client sent it
  (completions' logprobs, not the engine's top_logprobs)."""
  _, port = openai
  got, r = _post(port, path, body)
  assert got == 400 and r["error"]["param"] == param and message in r["error"]["message"], r
  # Within the limit, the same fields run.
  if "logprobs" in body:
    ok = {**body, ("top_logprobs" if "messages" in body else "logprobs"): 20, "max_tokens": 1}
    got, r = _post(port, path, ok)
    assert got == 200, r


def test_a_body_that_is_not_json_is_400(openai):
  _, port = openai
  status, r = _post(port, "/v1/completions", None, raw=b"{not json")
  assert status == 400 and "not JSON" in r["error"]["message"]


def _raw_post(port, head: bytes, body: bytes) -> tuple[int, dict | str]:
  """POSTs /v1/completions with the header lines and body as given: (status,
  JSON), or (status, text) for an answer that is not JSON."""
  with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + body)
    r = http.client.HTTPResponse(s)
    r.begin()
    data = r.read()
    return r.status, (json.loads(data) if r.getheader("Content-Type") == "application/json"
                      else data.decode())


_BODY = json.dumps({"prompt": "a", "max_tokens": 3}).encode()


_BAD_FRAMING = "Invalid HTTP request received."  # (h11 refuses it; uvicorn's plain answer)


@pytest.mark.parametrize("head, body, status, match", [
    (b"Content-Length: abc\r\n", _BODY, 400, _BAD_FRAMING),
    (b"Content-Length: -5\r\n", _BODY, 400, _BAD_FRAMING),
    (b"Content-Length: 99999999999\r\n", _BODY, 413, "over 16777216 bytes"),
    (b"Transfer-Encoding: chunked\r\n", b"zz\r\n", 400, _BAD_FRAMING),
    (b"Transfer-Encoding: chunked\r\n", b"-5\r\n", 400, _BAD_FRAMING),
    (b"Transfer-Encoding: chunked\r\n", b"3\r\n" + _BODY + b"\r\n0\r\n\r\n", 400,
     _BAD_FRAMING),  # (a chunk shorter than its size, or longer)
    (b"Transfer-Encoding: chunked\r\n", b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        10, _BODY[:10], len(_BODY) - 10, _BODY[10:]), 200, "bcd"),
])
def test_content_length_and_chunked_bodies(openai, head, body, status, match):
  """A Content-Length that is not a count and a malformed chunk are 400 (the
  HTTP layer's: the app never sees them), a body over MAX_BODY 413 before it
  is read; chunked bodies are read."""
  _, port = openai
  got, r = _raw_post(port, head, body)
  assert got == status, r
  if got == 400:
    assert r == match
  else:
    assert match in (r["choices"][0]["text"] if got == 200 else r["error"]["message"]), r


def test_a_request_that_stops_arriving_is_408_or_closed(openai, monkeypatch):
  """Fewer bytes than the Content-Length: the server waits READ_TIMEOUT_S
  for the rest, then answers 408, and serves on; a connection that sends no
  request, or part of a request head, is closed after READ_TIMEOUT_S."""
  from serving import openai_api

  monkeypatch.setattr(openai_api, "READ_TIMEOUT_S", 0.3)
  _, port = openai
  got, r = _raw_post(port, b"Content-Length: %d\r\n" % (len(_BODY) + 5), _BODY)
  assert got == 408 and "did not arrive within 0.3 s" in r["error"]["message"], r
  assert _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 3})[1]["choices"][0][
      "text"] == "bcd"
  # A connection that sends nothing at all is closed after the timeout.
  with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    assert s.recv(100) == b""  # (the server's close; a kept thread would time this out)
  with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # (and no more)
    assert s.recv(100) == b""


def test_keep_alive_reuses_the_connection_and_closes_where_it_must(openai, monkeypatch):
  """HTTP/1.1: completions one after another on one connection, a stream
  among them (its chunked body ends it); an answer given before the body was
  read (a 404) closes it (the client then reconnects and is served); an idle
  kept connection is closed after READ_TIMEOUT_S."""
  from serving import openai_api

  _, port = openai
  # (under READ_TIMEOUT_S: a stream that left its connection open would
  # end only when the server gave up waiting for the next request)
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

  def post(path, body):
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r, r.read()

  one = {"prompt": "a", "max_tokens": 3}
  r, data = post("/v1/completions", one)
  sock = conn.sock
  assert r.status == 200 and json.loads(data)["choices"][0]["text"] == "bcd"
  assert r.version == 11 and not r.will_close
  r, data = post("/v1/completions", {"prompt": "x", "max_tokens": 2})
  assert conn.sock is sock and json.loads(data)["choices"][0]["text"] == "yz"
  r, _ = post("/v1/nothing", one)  # its body is never read: the connection ends
  assert r.status == 404 and r.will_close and conn.sock is None
  r, data = post("/v1/completions", one)
  assert r.status == 200 and json.loads(data)["choices"][0]["text"] == "bcd"
  sock = conn.sock
  r, data = post("/v1/completions", {**one, "stream": True})
  assert not r.will_close and data.endswith(b"data: [DONE]\n\n")
  r, data = post("/v1/completions", one)
  assert conn.sock is sock and r.status == 200 and json.loads(data)["choices"][0]["text"] == "bcd"
  conn.close()
  monkeypatch.setattr(openai_api, "READ_TIMEOUT_S", 0.3)  # (read as a connection is made)
  r, data = post("/v1/completions", one)
  assert r.status == 200 and not r.will_close
  conn.sock.settimeout(30)
  assert conn.sock.recv(1) == b""  # closed by the server after 0.3 s idle
  conn.close()


def test_bearer_token_and_a_client_gone_mid_stream():
  """With a token, a call without it (or with another) is 401 with
  WWW-Authenticate: Bearer (the client's AuthenticationError); the scheme's
  case does not matter. A stream whose client closes the connection after
  the first chunk cancels its request: its pages come back long before its
  500 tokens would have."""
  engine = E.tiny_engine(max_batch=4, step_delay=0.01, num_pages=200)  # 5 s for 500 tokens
  with running(engine, http_port=0, auth_token="s3cret") as (server, c):
    port = server.openai_http.server_port
    status, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 401 and r["error"]["type"] == "authentication_error"
    status, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 2,
                                                 "temperature": 0}, token="s3cret")
    assert status == 200 and r["choices"][0]["text"] == "bc"
    body = json.dumps({"prompt": "a", "max_tokens": 2, "temperature": 0}).encode()
    for auth, want in [("bearer s3cret", 200), ("BEARER s3cret", 200), ("Bearer s3cre", 401),
                       ("Basic s3cret", 401), ("s3cret", 401)]:
      status, headers, r = _http(port, "POST", "/v1/completions", body, {"Authorization": auth})
      assert status == want, (auth, r)
      assert (headers.get("www-authenticate") == "Bearer") == (want == 401), headers
    status, headers, _ = _http(port, "GET", "/v1/models")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    with pytest.raises(sdk.AuthenticationError) as e:
      _client(port, key="wrong").completions.create(model="counting", prompt="a", max_tokens=2)
    assert e.value.status_code == 401 and e.value.type == "authentication_error"
    assert _client(port, key="s3cret").completions.create(
        model="counting", prompt="a", max_tokens=2, temperature=0).choices[0].text == "bc"
    body = json.dumps({"prompt": "a", "max_tokens": 500, "ignore_eos": True, "stream": True})
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret"
                  f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    got = b""
    while b"data: " not in got:
      got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    wait_for(lambda: engine.stats().running == 1, what="the stream's request running")
    sock.close()
    wait_for(lambda: engine.stats().running == 0 and engine.stats().pages_in_use == 0,
             timeout=1.5, what="the request cancelled and its pages freed")
    # Unary too: a client that closes while waiting for the whole response.
    body = json.dumps({"prompt": "a", "max_tokens": 500, "ignore_eos": True})
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret"
                  f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    wait_for(lambda: engine.stats().running == 1, what="the unary request running")
    sock.close()
    wait_for(lambda: engine.stats().running == 0 and engine.stats().pages_in_use == 0,
             timeout=1.5, what="the unary request cancelled and its pages freed")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6)
_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
           "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs", "logit_bias",
           "stream", "stream_options", "response_format", "structured_outputs", "guided_regex",
           "guided_choice", "guided_json", "stop_token_ids", "allowed_token_ids",
           "prompt_logprobs", "ignore_eos", "min_tokens", "presence_penalty"]


@st.composite
def _bodies(draw, chat: bool):
  body = draw(st.dictionaries(st.sampled_from(_FIELDS), _json_values, max_size=6))
  if draw(st.booleans()):  # half of them with a well-formed prompt, to get past it
    body.pop("messages" if not chat else "prompt", None)  # (the other route's: refused)
    if chat:
      body["messages"] = [{"role": "user", "content": draw(st.text(max_size=8))}]
    else:
      body["prompt"] = draw(st.text(max_size=8))
  body.setdefault("max_tokens", 4)
  return body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), chat=st.booleans())
def test_malformed_json_bodies_get_a_status_never_a_crash(openai, data, chat):
  """Fields of any JSON type at the known names: each call answers 200 (a
  complete response or stream) or an OpenAI error with status 400, and the
  engine and server stay up."""
  server, port = openai
  body = data.draw(_bodies(chat))
  status, r = _post(port, "/v1/chat/completions" if chat else "/v1/completions", body)
  if status == 200:
    assert isinstance(r, list) or r["choices"], r
  else:
    assert status == 400 and r["error"]["message"], (status, r)
  assert server.engine.error is None and _get(port, "/health")[0] == 200


def test_echo_tokenize_metrics_and_priority(openai):
  """Completions' echo puts the prompt before the text (unary and streamed);
  /tokenize gives a prompt's or a chat's tokens as Generate gets them;
  /metrics is served here too; a priority needs priority scheduling."""
  server, port = openai
  _, r = _post(port, "/v1/completions", {"prompt": "xa", "max_tokens": 2, "temperature": 0,
                                          "echo": True})
  assert r["choices"][0]["text"] == "xabc"
  _, chunks = _post(port, "/v1/completions", {"prompt": "xa", "max_tokens": 2,
                                               "temperature": 0, "echo": True, "stream": True})
  assert "".join(c["choices"][0]["text"] for c in chunks) == "xabc"
  # A prompt of ids echoes their text: "é" is two byte tokens, no piece each.
  _, r = _post(port, "/v1/completions", {"prompt": list("xé".encode()), "max_tokens": 1,
                                          "temperature": 0, "echo": True})
  assert r["choices"][0]["text"].startswith("xé")
  status, t = _post(port, "/tokenize", {"prompt": "hi"})
  assert status == 200 and t["tokens"] == [256, ord("h"), ord("i")] and t["count"] == 3
  _, t = _post(port, "/tokenize", {"messages": CHAT})
  assert t["tokens"] == list(b"system: be brief\nuser: hi\nassistant: ")
  # Text parts one per line (vLLM's join), not run together.
  _, t = _post(port, "/tokenize", {"messages": [{"role": "user", "content": [
      {"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]}]})
  assert t["tokens"] == list(b"user: Hello\nWorld\nassistant: ")
  status, r = _post(port, "/tokenize", {"prompt": 3})
  assert status == 400 and "prompt" in r["error"]["message"]
  status, d = _post(port, "/detokenize", {"tokens": list(b"h\xc3\xa9 x")})
  assert status == 200 and d == {"prompt": "hé x"}
  assert _post(port, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
  for bad in ([1, 2, 10**6], [1, "2"], "hi", None):
    status, r = _post(port, "/detokenize", {"tokens": bad})
    assert status == 400, bad
  assert "outside the vocabulary" in _post(port, "/detokenize", {"tokens": [10**6]})[1][
      "error"]["message"]
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  conn.request("GET", "/metrics")
  text = conn.getresponse().read().decode()
  assert "time_to_first_token_seconds" in text and "requests_finished_total" in text
  status, r = _post(port, "/v1/completions", {"prompt": "a", "priority": 2})
  assert status == 400 and "priority scheduling" in r["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_http_tokens_count_in_the_inter_token_histogram(openai, stream):
  """The inter-token latency histogram counts HTTP calls' tokens as it does
  gRPC streams': one gap per token after a completion's first message, for
  each of n completions, streamed or not."""
  server, port = openai
  samples = lambda: server.metrics.sample("inter_token_latency_seconds_count") or 0  # noqa: E731
  before = samples()
  status, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 9, "n": 2,
                                              "temperature": 0, "stream": stream})
  assert status == 200
  # Deltas may come merged (a lagging reader), so between n * 1 and n * 8 gaps;
  # none at all is the bug (HTTP tokens were never counted).
  assert 2 <= samples() - before <= 16, (before, samples())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_come_with_their_alternatives_unary_and_streamed(openai, path):
  """prompt_logprobs=k gives each prompt token's logprob and the k likeliest
  tokens there, in a stream too (on the choice's last chunk)."""
  _, port = openai
  prompt = {"prompt": "ab"} if path == "/v1/completions" else {"messages": CHAT}
  got = []
  for stream in (False, True):
    status, r = _post(port, path, {**prompt, "max_tokens": 2, "temperature": 0,
                                   "prompt_logprobs": 2, "stream": stream})
    assert status == 200, r
    choices = [c for chunk in r for c in chunk["choices"]] if stream else r["choices"]
    got.append([c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c])
    if path == "/v1/chat/completions" and not stream:  # vLLM's place: the response's
      assert not got[-1]
      got[-1] = [r["prompt_logprobs"]]
  unary, streamed = got
  assert len(unary) == 1 and unary == streamed
  # vLLM's shape: None for the first token, then {id: {logprob, rank,
  # decoded_token}}: the prompt's own token and the 2 likeliest (ranks 1, 2).
  first, *rest = unary[0]
  assert first is None and rest, unary
  for entry in rest:
    assert 2 <= len(entry) <= 3, entry
    ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"])
    assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1], entry
    assert all(k.isdigit() and isinstance(v["decoded_token"], str) for k, v in entry.items())
  if path == "/v1/completions":  # BOS a b; the counting model: after "a", "b" is the likeliest
    assert len(rest) == 2 and rest[1][str(ord("b"))]["rank"] == 1, rest


def test_prompt_lists_and_echo_logprobs_for_scoring(openai):
  """A list of prompts gives prompt i's completion j at choice i * n + j, and
  usage counts each prompt once. echo with logprobs (lm-eval's loglikelihood
  request) gives the prompt's tokens and logprobs (none for the first) before
  the completion's: after "a" the counting model's "b" is ~0, "x" ~-20."""
  _, port = openai
  status, r = _post(port, "/v1/completions", {"prompt": ["a", [ord("k")]], "n": 2,
                                               "max_tokens": 2, "temperature": 0})
  assert status == 200 and [c["text"] for c in r["choices"]] == ["bc", "bc", "lm", "lm"]
  assert r["usage"]["prompt_tokens"] == 2 + 1 and r["usage"]["completion_tokens"] == 8
  _, r = _post(port, "/v1/completions", {"prompt": ["abx", "ab"], "max_tokens": 1,
                                          "temperature": 0, "echo": True, "logprobs": 1})
  first, second = (c["logprobs"] for c in r["choices"])
  assert [c["text"] for c in r["choices"]] == ["abxy", "abc"]
  assert first["tokens"][1:] == ["a", "b", "x", "y"] and first["token_logprobs"][0] is None
  got = first["token_logprobs"][1:]
  assert got[1] > -1e-3 and got[2] < -15 and got[3] > -1e-3, got  # b follows a; x not b
  # Each position's dict: its own token first, then the likeliest (OpenAI's
  # legacy format: up to logprobs + 1 entries); "y" after "x" is the likeliest.
  assert first["top_logprobs"][0] is None and list(first["top_logprobs"][3]) == ["x", "c"]
  assert list(first["top_logprobs"][4]) == ["y"]
  # text_offset: where each token starts in the choice's text (BOS has no
  # text, so it and "a" both start at 0).
  assert first["text_offset"] == [0, 0, 1, 2, 3], first
  assert len(second["tokens"]) == len(second["token_logprobs"]) == 4  # BOS a b + c
  # The prompt's alternatives: prompt_logprobs where given, else logprobs (vLLM's rule).
  _, r = _post(port, "/v1/completions", {"prompt": "abx", "max_tokens": 1, "temperature": 0,
                                          "echo": True, "logprobs": 1, "prompt_logprobs": 3})
  tops = r["choices"][0]["logprobs"]["top_logprobs"]
  # 3 each, plus the prompt's own token where it is not among them ("a" after
  # BOS, "x" after "b"); the completion's "y", logprobs=1, is its own likeliest.
  assert [len(t) for t in tops[1:]] == [4, 3, 4, 1], tops
  status, r = _post(port, "/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 1,
                                               "stream": True})
  assert status == 400 and r["error"]["param"] == "echo", r
  status, r = _post(port, "/v1/completions", {"prompt": ["a"] * 200, "n": 2})
  assert status == 400 and "at most 256 completions" in r["error"]["message"]


def test_64_concurrent_streams_get_what_64_sequential_calls_get(openai):
  """64 streams at once give the texts that calls one after another give
  (the gRPC service's done-criterion, over HTTP)."""
  import concurrent.futures

  _, port = openai
  prompts = [chr(ord("a") + i % 16) * (1 + i % 5) for i in range(64)]  # no "~": no EOS

  def stream(p):
    _, chunks = _post(port, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                 "stream": True})
    return "".join(c["choices"][0]["text"] for c in chunks)

  with concurrent.futures.ThreadPoolExecutor(64) as pool:
    together = list(pool.map(stream, prompts))
  alone = [_post(port, "/v1/completions", {"prompt": p, "max_tokens": 6,
                                            "temperature": 0})[1]["choices"][0]["text"]
           for p in prompts[:8]]
  assert together[:8] == alone and all(len(t) == 6 for t in together)
  assert together == ["".join(chr((ord(p[-1]) + 1 + k) % 256) for k in range(6))
                      for p in prompts]


def test_the_official_openai_client(openai):
  """The openai package against the server: completions and chat, unary and
  streamed, n > 1, logprobs, structured outputs (response_format
  json_schema), and a field this server does not honour refused by name."""
  _, port = openai
  c = _client(port)
  assert [m.id for m in c.models.list()] == ["counting"]
  assert c.models.retrieve("counting").id == "counting"
  r = c.completions.create(model="counting", prompt="a", max_tokens=5, temperature=0)
  assert r.choices[0].text == "bcdef" and r.choices[0].finish_reason == "length"
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 5)
  r = c.completions.create(model="counting", prompt=[ord("k")], max_tokens=3, temperature=0,
                           n=2, stop="m")
  assert [(x.index, x.text, x.finish_reason) for x in r.choices] == [(0, "l", "stop"),
                                                                      (1, "l", "stop")]
  r = c.completions.create(model="counting", prompt="k", max_tokens=2, temperature=0, n=2,
                           logprobs=2)
  assert r.choices[1].logprobs.tokens == ["l", "m"]
  assert [len(t) for t in r.choices[1].logprobs.top_logprobs] == [2, 2]
  chunks = list(c.completions.create(model="counting", prompt="a", max_tokens=5, temperature=0,
                                     stream=True, stream_options={"include_usage": True}))
  assert "".join(x.choices[0].text for x in chunks if x.choices) == "bcdef"
  assert chunks[-1].usage.completion_tokens == 5

  r = c.chat.completions.create(model="counting", messages=CHAT, max_tokens=5, temperature=0,
                                n=2, logprobs=True, top_logprobs=2)
  assert [x.message.content for x in r.choices] == ['!"#$%', '!"#$%']
  assert r.choices[0].message.role == "assistant" and r.choices[1].finish_reason == "length"
  content = r.choices[1].logprobs.content
  assert [x.token for x in content] == list('!"#$%') and abs(content[0].logprob) < 1e-6
  assert len(content[0].top_logprobs) == 2 and content[0].top_logprobs[0].token == "!"
  chunks = list(c.chat.completions.create(model="counting", messages=CHAT, max_tokens=3,
                                          temperature=0, n=2, stream=True))
  for i in range(2):
    mine = [x.choices[0] for x in chunks if x.choices[0].index == i]
    assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
    assert "".join(x.delta.content or "" for x in mine) == '!"#'

  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
  r = c.chat.completions.create(
      model="counting", messages=CHAT, max_tokens=30, temperature=0,
      response_format={"type": "json_schema",
                       "json_schema": {"name": "answer", "schema": schema, "strict": True}})
  assert r.choices[0].finish_reason == "stop"
  assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})
  r = c.completions.create(model="counting", prompt="a", max_tokens=20, temperature=0,
                           extra_body={"response_format": {
                               "type": "json_schema", "json_schema": {"schema": schema}}})
  assert r.choices[0].text == '{"ok":false}'

  with pytest.raises(sdk.BadRequestError) as e:
    c.chat.completions.create(model="counting", messages=CHAT, max_tokens=2,
                              parallel_tool_calls=False)
  assert e.value.param == "parallel_tool_calls" and "'parallel_tool_calls'" in e.value.message
  with pytest.raises(sdk.NotFoundError):
    c.completions.create(model="gpt-4", prompt="a", max_tokens=2)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "foo": 1}, "foo"),
    ("/v1/completions", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/v1/completions", {"prompt": "a", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "b",
                                                               "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "x"}]},
     "messages[0].name"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True,
                                                                   "x": 1}},
     "stream_options.x"),
    ("/tokenize", {"prompt": "a", "max_tokens": 3}, "max_tokens"),
])
def test_a_field_not_honoured_is_refused_by_name(openai, path, body, param):
  """A wrong answer with no error is the worst: an unknown field (or one of
  the other route's) is a 400 naming it, not ignored."""
  _, port = openai
  status, r = _post(port, path, body)
  assert status == 400 and r["error"]["param"] == param, r
  assert repr(param) in r["error"]["message"], r


@pytest.mark.parametrize("body, match", [
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "needs stream"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice='required' needs tools"),
    ({"messages": CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "needs tools"),
    ({"messages": CHAT, "response_format": {"type": "text", "json_schema": {"schema": {}}}},
     "json_schema goes with type json_schema"),
    ({"messages": CHAT, "response_format": {"type": "json_object",
                                            "json_schema": {"schema": {}}}},
     "json_schema goes with type json_schema"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format of type json_schema needs its json_schema"),
    # One kind from two fields: one of them would be dropped.
    ({"messages": CHAT, "structured_outputs": {"regex": "a"}, "guided_regex": "b"},
     "guided_regex and structured_outputs both give the output's regex"),
    ({"messages": CHAT, "guided_json": {"type": "string"},
      "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format and guided_json both give the output's json"),
])
def test_fields_that_mean_nothing_alone_are_refused(openai, body, match):
  _, port = openai
  status, r = _post(port, "/v1/chat/completions", body)
  assert status == 400 and match in r["error"]["message"], r
  # "none" without tools asks for what is done anyway (vLLM takes it too).
  status, r = _post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                    "tool_choice": "none"})
  assert status == 200, r


def test_methods_media_types_and_lone_surrogates(openai):
  """GET on a POST route is 405 (and POST on a GET route), with Allow; a
  body that is not application/json is 415 (one without a Content-Type is
  taken as JSON); a lone surrogate in the JSON is a 400 OpenAI error, never
  a 500, on every route that takes text."""
  _, port = openai
  for method, path, allow in [("GET", "/v1/completions", "POST"),
                              ("GET", "/v1/chat/completions", "POST"),
                              ("GET", "/tokenize", "POST"), ("POST", "/v1/models", "GET"),
                              ("POST", "/health", "GET")]:
    status, headers, r = _http(port, method, path, b"{}" if method == "POST" else None)
    assert status == 405 and r["error"]["code"] == 405, (method, path, r)
    assert allow in headers["allow"] and method in r["error"]["message"]
  one = json.dumps({"prompt": "a", "max_tokens": 2, "temperature": 0}).encode()
  for ctype in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]:
    status, _, r = _http(port, "POST", "/v1/completions", one, {"Content-Type": ctype})
    assert status == 415 and ctype in r["error"]["message"], r
  for ctype in ["application/json; charset=utf-8", "Application/JSON", None]:
    status, _, r = _http(port, "POST", "/v1/completions", one,
                         {"Content-Type": ctype} if ctype else {})
    assert status == 200 and r["choices"][0]["text"] == "bc", (ctype, r)
  for path, raw in [("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
                    ("/v1/completions", b'{"prompt": ["a", "b\\udfffc"]}'),
                    ("/v1/chat/completions",
                     b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}'),
                    ("/tokenize", b'{"prompt": "\\ud800"}'),
                    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}')]:  # (its UTF-8 form)
    status, _, r = _http(port, "POST", path, raw)
    assert status == 400 and r["error"]["type"] == "invalid_request_error", (raw, r)
    assert "not JSON" in r["error"]["message"], r
  assert _post(port, "/v1/completions", {"prompt": "\U0001F600", "max_tokens": 1})[0] == 200


def test_an_oversize_prompt_is_refused_before_it_is_tokenized(openai, monkeypatch):
  """The gRPC service's rule (MAX_PROMPT_CHARS): a prompt text, a chat or a
  /tokenize text over it is 400 with no call to the tokenizer (counted); one
  within it is tokenized, so the count would see it."""
  from serving.calls import MAX_PROMPT_CHARS

  server, port = openai
  tok, calls = server.engine.tok, []
  encode = tok.encode
  monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
  big = "a" * (MAX_PROMPT_CHARS + 1)
  for path, body in [
      ("/v1/completions", {"prompt": big}),
      ("/v1/completions", {"prompt": ["a", big], "echo": True}),  # (no echo of the first)
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": big[:-10]},
                                             {"role": "assistant", "content": "0123456789"}]}),
      ("/tokenize", {"prompt": big}),
      ("/tokenize", {"messages": [{"role": "user", "content": big}]}),
  ]:
    status, r = _post(port, path, body)
    assert status == 400 and f"at most {MAX_PROMPT_CHARS}" in r["error"]["message"], r
  assert calls == []
  status, r = _post(port, "/v1/completions", {"prompt": big[:100], "max_tokens": 1})
  assert status == 200 and calls, r


def test_echo_scores_a_prompt_alone_and_logprobs_are_there_when_asked(openai):
  """echo with max_tokens 0 returns the prompt and its logprobs alone (OpenAI's
  legacy scoring call; vLLM's echo_without_generation), streamed too; a
  one-token prompt's echo keeps its token (no logprob); logprobs asked for
  are an object even when no token has text (an output that is only EOS)."""
  server, port = openai
  body = {"prompt": "abx", "echo": True, "logprobs": 1, "max_tokens": 0}
  status, r = _post(port, "/v1/completions", body)
  assert status == 200, r
  (c,) = r["choices"]
  assert c["text"] == "abx" and c["finish_reason"] == "length", c
  assert c["logprobs"]["tokens"][1:] == ["a", "b", "x"] and c["logprobs"]["token_logprobs"][0] is None
  assert c["logprobs"]["token_logprobs"][3] < -15  # "x" does not follow "b"
  assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 4
  status, r = _post(port, "/v1/completions", {"prompt": "abx", "echo": True, "max_tokens": 0,
                                               "stream": True})
  assert status == 200 and "".join(c["text"] for x in r for c in x["choices"]) == "abx", r
  assert [c["finish_reason"] for x in r for c in x["choices"]][-1] == "length"
  status, r = _post(port, "/v1/completions", {"prompt": "a", "max_tokens": 0})
  assert status == 400 and r["error"]["param"] == "max_tokens", r  # (without echo)
  # One token: the prompt's own entry, then the completion's.
  _, r = _post(port, "/v1/completions", {"prompt": [ord("a")], "echo": True, "logprobs": 1,
                                          "max_tokens": 2, "temperature": 0})
  lp = r["choices"][0]["logprobs"]
  assert r["choices"][0]["text"] == "abc" and lp["tokens"] == ["a", "b", "c"], lp
  assert lp["token_logprobs"][0] is None and lp["text_offset"] == [0, 1, 2], lp
  # An output of EOS alone (forced by logit_bias) has no token with text, and
  # its logprobs are an empty object, not null.
  eos = {str(server.engine.info.eos_token_id): 100}
  for path, prompt in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions",
                                                             {"messages": CHAT})):
    extra = {"logprobs": True} if "chat" in path else {"logprobs": 0}
    status, r = _post(port, path, {**prompt, **extra, "max_tokens": 3, "temperature": 0,
                                   "logit_bias": eos})
    c = r["choices"][0]
    assert status == 200 and c["finish_reason"] == "stop", r
    assert c["logprobs"] in ({"content": []}, {"tokens": [], "token_logprobs": [],
                                               "top_logprobs": [], "text_offset": []}), c


def test_echo_logprobs_on_a_server_without_prompt_logprobs_names_echo():
  # The prompt's logprobs are asked for by echo, not by the client: the
  # refusal says so (it named prompt_logprobs, a field the client never sent).
  with running(E.tiny_engine(max_batch=2), http_port=0) as (server, _):
    status, r = _post(server.openai_http.server_port, "/v1/completions",
                      {"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 1})
  assert status == 400 and r["error"]["param"] == "echo", r
  assert "--enable-prompt-logprobs" in r["error"]["message"], r


def test_echo_of_a_truncated_prompt_is_what_the_model_saw(openai):
  """truncate_prompt_tokens with echo: the text, tokens, offsets and usage
  are the kept tokens' (vLLM echoes the truncated prompt), not the prompt as
  sent with its first token glued to the kept ones' logprobs."""
  _, port = openai
  status, r = _post(port, "/v1/completions", {
      "prompt": "abcdefgh", "echo": True, "logprobs": 0, "max_tokens": 0,
      "truncate_prompt_tokens": 3})
  assert status == 200, r
  (c,) = r["choices"]
  assert c["text"] == "fgh" and c["logprobs"]["tokens"] == ["f", "g", "h"], c
  assert c["logprobs"]["text_offset"] == [0, 1, 2] and r["usage"]["prompt_tokens"] == 3, r
  assert c["logprobs"]["token_logprobs"][0] is None, c
  # A cut longer than the prompt keeps it whole: the text as sent, BOS first.
  _, r = _post(port, "/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 0,
                                          "max_tokens": 1, "temperature": 0,
                                          "truncate_prompt_tokens": 50})
  assert r["choices"][0]["text"] == "abc" and r["usage"]["prompt_tokens"] == 3, r


@pytest.mark.parametrize("path,body,param", [
    # given empty, no constraint would apply: refused, not ignored
    ("/v1/completions", {"structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": None}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": ""}, None),
    # the grammar ends the output; min_tokens could not be met
    ("/v1/completions", {"guided_choice": ["abc"], "min_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "min_tokens": 2},
     "min_tokens"),
    # a JSON schema is an object here (true, "anything", would apply nothing)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": True}}}, "response_format.json_schema.schema"),
    # "²" is a digit to str.isdigit, no token id
    ("/v1/completions", {"logit_bias": {"²": 5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"--5": 5}}, "logit_bias"),
    # echo with max_tokens 0 generates nothing: the refusal says 0, as sent
    ("/v1/completions", {"echo": True, "max_tokens": 0, "min_tokens": 5}, "min_tokens"),
])
def test_unusable_fields_are_refused_by_name(openai, path, body, param):
  _, port = openai
  prompt = {"messages": CHAT} if "chat" in path else {"prompt": "ab"}
  status, r = _post(port, path, {**prompt, "max_tokens": 10, **body})
  assert status == 400, r
  assert r["error"]["param"] == param, r
  msg = r["error"]["message"]
  assert "Error(" not in msg and (param is None or param.split(".")[0] in msg), msg
  if "max_tokens" in body and body["max_tokens"] == 0:
    assert "max_tokens=0" in msg, msg


def test_null_means_the_default(openai):
  """OpenAI's spec makes these fields nullable and clients send an unset one
  as null: it means the default, as vLLM takes it."""
  _, port = openai
  base = {"prompt": "a", "max_tokens": 2, "temperature": 0}
  _, want = _post(port, "/v1/completions", base)
  nulls = {"n": None, "stream": None, "echo": None, "add_special_tokens": None,
           "stop": None, "logit_bias": None, "max_tokens": 2}
  status, r = _post(port, "/v1/completions", {**base, **nulls})
  assert status == 200 and r["choices"][0]["text"] == want["choices"][0]["text"] == "bc", r
  assert len(r["choices"]) == 1
  status, r = _post(port, "/v1/chat/completions", {
      "messages": CHAT, "max_tokens": 2, "temperature": 0, "n": None, "stream": None,
      "add_generation_prompt": None, "stream_options": None})
  assert status == 200 and r["object"] == "chat.completion", r
  # Required fields stay required.
  status, r = _post(port, "/v1/completions", {"prompt": None})
  assert status == 400 and r["error"]["param"] == "prompt", r
