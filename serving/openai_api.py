"""OpenAI-compatible HTTP endpoints over the same engine, beside gRPC.

``openai_http(engine, servicer, host, port)`` answers what vLLM's and
SGLang's OpenAI servers answer: ``POST /v1/completions``,
``POST /v1/chat/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health`` and
``GET /metrics``. A request's JSON becomes engine requests as a gRPC call's does (n completions, each seed derived from the
request's; vLLM's extra sampling fields and structured outputs, OpenAI's
``response_format``), and their events become OpenAI objects. Errors are
OpenAI error objects: 400 for a bad request, 401 without the bearer token,
429 when the queue is full, 503 while draining, 500 when the engine failed.
With the server's TLS certificate, it speaks HTTPS only. Connections are
HTTP/1.1 and kept alive between calls (a stream ends its own); one that
sends nothing for READ_TIMEOUT_S is closed.
A client that goes away (its connection closed, streaming or not) cancels
its requests. Calls count as in progress for the server's drain, like gRPC
calls.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import pathlib
import queue
import select
import socket
import ssl
import tempfile
import time
import uuid

from serving.engine import api

log = logging.getLogger("serving.openai")

MAX_BODY = 1 << 24
# A client that stops sending its request (the request line, headers or a
# body short of its Content-Length) holds its connection's thread no longer
# than this at a time.
READ_TIMEOUT_S = 30.0
MAX_COMPLETIONS = 256  # prompts x n in one call
_POLL_S = 0.05  # how often a call waiting for events checks its client is still there
_FINISH = {api.FinishReason.LENGTH: "length", api.FinishReason.STOP: "stop",
           api.FinishReason.EOS: "stop"}
# OpenAI / vLLM request fields -> SamplingParams fields of the same meaning.
_SAME = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "seed", "min_tokens", "ignore_eos", "include_stop_str_in_output",
         "truncate_prompt_tokens", "prompt_logprobs")


_INTS = ("top_k", "seed", "min_tokens", "truncate_prompt_tokens", "prompt_logprobs",
         "max_tokens", "max_completion_tokens", "n", "top_logprobs", "priority")
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "echo", "stream",
          "add_generation_prompt", "add_special_tokens")


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is no count


def _check_types(body: dict, chat: bool) -> None:
  """JSON types of the known fields, checked before anything uses them: the
  engine's own checks assume the types a proto guarantees."""
  def bad(name, what):
    raise _HTTPError(400, f"{name}={body[name]!r} must be {what}")

  for k in _INTS + (() if chat else ("logprobs",)):
    if body.get(k) is not None and not _is_int(body[k]):
      bad(k, "an integer")
  for k in _FLOATS:
    if body.get(k) is not None and not (_is_int(body[k]) or isinstance(body[k], float)):
      bad(k, "a number")
  for k in _BOOLS + (("logprobs",) if chat else ()):
    if body.get(k) is not None and not isinstance(body[k], bool):
      bad(k, "true or false")
  stop = body.get("stop")
  if stop is not None and not isinstance(stop, str) and not (
      isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
    bad("stop", "a string or a list of strings")
  for k in ("stop_token_ids", "allowed_token_ids"):
    v = body.get(k)
    if v is not None and not (isinstance(v, list) and all(_is_int(t) for t in v)):
      bad(k, "a list of integers")
  lb = body.get("logit_bias")
  if lb is not None and not (isinstance(lb, dict) and all(
      isinstance(t, str) and t.lstrip("-").isdigit() and (_is_int(b) or isinstance(b, float))
      for t, b in lb.items())):
    bad("logit_bias", "an object of token id -> number")


class _ClientGone(Exception):
  """The client closed its connection: its requests were cancelled."""


class _HTTPError(Exception):

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.kind = status, kind


def _structured(body: dict) -> api.StructuredOutputs | None:
  """vLLM's structured_outputs / guided_* fields, or OpenAI's response_format."""
  so = dict(body.get("structured_outputs") or {})
  for k in ("json", "regex", "choice", "grammar"):
    if body.get(f"guided_{k}") is not None:
      so[k] = body[f"guided_{k}"]
  rf = body.get("response_format") or {}
  if rf.get("type") == "json_object":
    so["json_object"] = True
  elif rf.get("type") == "json_schema":
    so["json"] = (rf.get("json_schema") or {}).get("schema", {})
  elif rf.get("type") not in (None, "text"):
    raise _HTTPError(400, f"response_format type {rf.get('type')!r}: one of text, "
                     "json_object, json_schema")
  if not so:
    return None
  if "json" in so and not isinstance(so["json"], str):
    so["json"] = json.dumps(so["json"])
  if "choice" in so:
    so["choice"] = tuple(so["choice"])
  unknown = set(so) - {"json", "regex", "choice", "grammar", "json_object"}
  if unknown:
    raise _HTTPError(400, f"structured_outputs: unknown fields {sorted(unknown)}")
  return api.StructuredOutputs(**so)


def sampling_from_json(body: dict, chat: bool) -> tuple[api.SamplingParams, int]:
  """(SamplingParams, n) from an OpenAI request body; OpenAI's defaults
  (temperature 1, 16 tokens for completions, the context for chat)."""
  _check_types(body, chat)
  kw = {k: body[k] for k in _SAME if body.get(k) is not None}
  kw.setdefault("temperature", 1.0)
  max_tokens = body.get("max_completion_tokens") if chat else None
  max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
  if max_tokens is None and not chat:
    max_tokens = 16  # OpenAI's completions default
  kw["max_tokens"] = max_tokens
  stop = body.get("stop")
  kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
  kw["stop_token_ids"] = tuple(body.get("stop_token_ids") or ())
  kw["allowed_token_ids"] = tuple(body.get("allowed_token_ids") or ())
  kw["logit_bias"] = tuple(sorted((int(t), b) for t, b in (body.get("logit_bias") or {}).items()))
  lp = body.get("logprobs")
  if chat:
    if lp:
      kw["logprobs"], kw["top_logprobs"] = True, int(body.get("top_logprobs") or 0)
  elif lp is not None:  # completions: logprobs is the number of alternatives
    kw["logprobs"], kw["top_logprobs"] = True, int(lp)
  kw["structured"] = _structured(body)
  n = body.get("n", 1)
  if not isinstance(n, int) or not 1 <= n <= 64:
    raise _HTTPError(400, f"n={n!r} must be an integer in [1, 64]")
  return api.SamplingParams(**kw), n


class _Call:
  """One HTTP call's engine requests and their merged events."""

  def __init__(self, engine, body: dict, chat: bool):
    from serving.service import Events, completion_params

    self.engine, self.chat = engine, chat
    model = body.get("model")
    if model not in (None, "", engine.info.model_name):
      raise _HTTPError(404, f"the model {model!r} does not exist; this server serves "
                       f"{engine.info.model_name!r}", "not_found")
    # What would change the output's meaning is refused, not ignored.
    if body.get("tools") and body.get("tool_choice") != "none" or body.get("functions"):
      raise _HTTPError(400, "tool and function calling are not supported")
    if body.get("suffix"):
      raise _HTTPError(400, "suffix (insertion) is not supported")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
      raise _HTTPError(400, "best_of is not supported (n completions are returned as such)")
    sampling, self.per = sampling_from_json(body, chat)  # completions per prompt
    if chat:
      msgs = body.get("messages")
      if not isinstance(msgs, list) or not msgs:
        raise _HTTPError(400, "messages: a non-empty list of {role, content}")
      prompts = [{"messages": tuple((m["role"], _content(m.get("content"))) for m in msgs),
                  "add_generation_prompt": bool(body.get("add_generation_prompt", True))}]
    else:
      prompts = [_prompt(p) for p in _prompt_list(body.get("prompt"))]
    self.n = len(prompts) * self.per  # choice i * per + j: prompt i's completion j
    if self.n > MAX_COMPLETIONS:
      raise _HTTPError(400, f"{len(prompts)} prompts x n={self.per}: at most "
                       f"{MAX_COMPLETIONS} completions a call")
    # Completions' echo: the prompt before each completion's text; with
    # logprobs, its tokens' logprobs before the completion's (lm-eval's
    # loglikelihood requests), which needs the server's prompt logprobs.
    echo = bool(body.get("echo")) and not chat
    self.echo = [self._text(p) if echo else "" for p in prompts]
    self.echo_first = [self._first_id(p) if echo else None for p in prompts]
    if echo and sampling.logprobs:
      sampling = dataclasses.replace(sampling, prompt_logprobs=sampling.top_logprobs)
    priority = int(body.get("priority") or 0)
    self.keys, requests = [], []
    for prompt in prompts:
      for j in range(self.per):
        self.keys.append(uuid.uuid4().hex)
        requests.append(api.Request(
            request_id=self.keys[-1], sampling=completion_params(sampling, j),
            priority=priority, **prompt))
    # One admission decision for the call's completions: all or none.
    self.events = Events(engine.submit_all(requests))

  def _text(self, prompt: dict) -> str:
    if "prompt_text" in prompt:
      return prompt["prompt_text"]
    # Decoded whole: a character whose bytes span tokens has no piece of its own.
    return self.engine.detokenize(prompt["prompt_ids"])

  def _first_id(self, prompt: dict) -> int:
    """The prompt's first token, which has no logprob (the engine's BOS rule)."""
    if "prompt_ids" in prompt:
      return prompt["prompt_ids"][0]
    return self.engine.tokenize(prompt["prompt_text"], add_bos=True)[0]

  def prompt_of(self, i: int) -> int:
    return i // self.per

  def cancel(self) -> None:
    for k in self.keys:
      self.engine.cancel(k)

  def follow(self, gone):
    """(index, Delta | Final) until every completion's Final; ``gone()`` is
    asked every _POLL_S: True cancels the requests (_ClientGone)."""
    finals, check = 0, time.monotonic() + _POLL_S
    try:
      while finals < self.n:
        try:
          i, ev = self.events.get(timeout=_POLL_S)
        except queue.Empty:
          i = ev = None
        if time.monotonic() >= check:
          check = time.monotonic() + _POLL_S
          if gone():
            self.cancel()
            raise _ClientGone
        if ev is None:
          continue
        if isinstance(ev, api.Failed):
          if ev.invalid:
            raise _HTTPError(400, ev.message)
          raise _HTTPError(500, ev.message, "internal_error")
        if isinstance(ev, api.Final) and ev.reason == api.FinishReason.CANCELLED:
          # (the client's own going away ends the call above, _ClientGone)
          raise _HTTPError(503, "the server shut down before the request finished "
                           f"({ev.completion_tokens} tokens generated)", "unavailable")
        if isinstance(ev, api.Final) and ev.reason not in _FINISH:
          raise _HTTPError(500, f"the request ended: {ev.reason.name.lower()}", "internal_error")
        yield i, ev
        finals += isinstance(ev, api.Final)
    finally:
      self.events.close()


_BAD_PROMPT = "prompt: a string, a list of token ids, or a list of either"


def _is_ids(p) -> bool:
  return isinstance(p, list) and bool(p) and all(_is_int(t) for t in p)


def _prompt_list(p) -> list:
  """OpenAI's prompt: a string, token ids, or a list of either."""
  if isinstance(p, str) or _is_ids(p):
    return [p]
  if isinstance(p, list) and p:
    return p
  raise _HTTPError(400, _BAD_PROMPT)


def _prompt(p) -> dict:
  if isinstance(p, str):
    return {"prompt_text": p}
  if _is_ids(p):
    return {"prompt_ids": p}
  raise _HTTPError(400, _BAD_PROMPT)


def _content(c) -> str:
  """A message's content: a string, or OpenAI's list of text parts."""
  if isinstance(c, str):
    return c
  if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
    return "".join(p.get("text", "") for p in c)
  raise _HTTPError(400, "message content: a string or a list of text parts")


def _logprobs(engine, lps: list[api.TokenLogprob], chat: bool):
  if not lps:
    return None
  pieces = engine.token_pieces([x.token_id for x in lps] +
                               [t for x in lps for t, _ in x.top])
  names = iter(pieces[len(lps):])
  tops = [[(next(names), v) for _, v in x.top] for x in lps]
  if chat:
    return {"content": [{"token": pieces[j], "logprob": x.logprob,
                         "bytes": list(pieces[j].encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                          for t, v in tops[j]]}
                        for j, x in enumerate(lps)]}
  return {"tokens": pieces[:len(lps)], "token_logprobs": [x.logprob for x in lps],
          "top_logprobs": [dict(t) for t in tops]}


def _echo_logprobs(engine, first: int, scored, completion: dict | None) -> dict:
  """Completions' logprobs with echo: the prompt's tokens first (the first
  one has none), then the completion's, as OpenAI's legacy API gives them."""
  ids = [first] + [x.token_id for x in scored]
  pieces = engine.token_pieces(ids + [t for x in scored for t, _ in x.top])
  names = iter(pieces[len(ids):])
  out = {"tokens": pieces[:len(ids)], "token_logprobs": [None] + [x.logprob for x in scored],
         "top_logprobs": [None] + [{next(names): v for _, v in x.top} for x in scored]}
  for k in out if completion else ():
    out[k] += completion[k]
  return out


def _usage(finals: list[api.Final], per: int) -> dict:
  prompt = sum(f.prompt_tokens for f in finals[::per])  # each prompt once
  done = sum(f.completion_tokens for f in finals)
  return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _choice_end(f: api.Final) -> dict:
  return {"finish_reason": _FINISH[f.reason], "stop_reason": f.stop_reason}


def _tls_context(cert: bytes, key: bytes) -> ssl.SSLContext:
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  with tempfile.TemporaryDirectory() as d:  # a directory only its owner reads
    c, k = pathlib.Path(d, "cert.pem"), pathlib.Path(d, "key.pem")
    c.write_bytes(cert)
    k.write_bytes(key)
    ctx.load_cert_chain(c, k)
  return ctx


def openai_http(engine: api.Engine, servicer, host: str, port: int,
                auth_token: str | None = None,
                tls: tuple[bytes, bytes] | None = None) -> http.server.ThreadingHTTPServer:
  """The OpenAI endpoints bound to ``host:port``; the caller runs
  ``serve_forever``. ``tls``: (certificate, key) in PEM, as the gRPC server
  takes them."""
  expected = f"Bearer {auth_token}" if auth_token else None

  class Handler(http.server.BaseHTTPRequestHandler):
    # Keep-alive: a client's next request reuses its connection (and its TLS
    # session). A stream ends its connection, as does an answer to a request
    # whose body was left unread (the next request would start inside it).
    protocol_version = "HTTP/1.1"

    def handle_one_request(self):
      # Until the request is read (_body lifts it): a connection that sends
      # nothing, or idles between requests, is closed (the base class's
      # TimeoutError path), not kept forever.
      self.connection.settimeout(READ_TIMEOUT_S)
      self._unread = False  # a body not read (yet): the answer closes the connection
      try:
        super().handle_one_request()
      except (ConnectionResetError, BrokenPipeError):  # the client went away: no traceback
        self.close_connection = True

    def end_headers(self):
      if self._unread:
        self.send_header("Connection", "close")
      super().end_headers()

    def _json(self, status: int, obj) -> None:
      body = json.dumps(obj).encode()
      try:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
      except (BrokenPipeError, ConnectionResetError):
        log.info("client went away before its response")

    def _error(self, e: _HTTPError) -> None:
      self._json(e.status, {"error": {"message": str(e), "type": e.kind, "code": e.status}})

    def _authorized(self) -> bool:
      if expected is None or self.headers.get("Authorization") == expected:
        return True
      self._error(_HTTPError(401, "missing or wrong bearer token", "authentication_error"))
      return False

    def do_GET(self):  # noqa: N802
      path = self.path.split("?")[0]
      self._unread = (self.headers.get("Content-Length", "0").strip() != "0"
                      or "Transfer-Encoding" in self.headers)
      if path == "/health":
        ok = getattr(engine, "error", None) is None and not engine.stats().draining
        self._json(200 if ok else 503, {"status": "ok" if ok else "unavailable"})
      elif path == "/metrics":
        text = servicer.metrics.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)
      elif path == "/v1/models":
        if self._authorized():
          i = engine.info
          self._json(200, {"object": "list", "data": [{
              "id": i.model_name, "object": "model", "created": 0, "owned_by": "mosaic-serve",
              "max_model_len": i.max_context}]})
      else:
        self._error(_HTTPError(404, f"no route {path}", "not_found"))

    def do_POST(self):  # noqa: N802
      path = self.path.split("?")[0]
      self._unread = True
      if path not in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        self._error(_HTTPError(404, f"no route {path}", "not_found"))
        return
      if not self._authorized():
        return
      if path in ("/tokenize", "/detokenize"):
        try:
          (self._tokenize if path == "/tokenize" else self._detokenize)(self._body())
        except _HTTPError as e:
          self._error(e)
        return
      with servicer.call_in_progress():
        try:
          body, chat = self._body(), path == "/v1/chat/completions"
          call = self._call(body, chat)
          if body.get("stream"):
            self._stream(call, chat, bool((body.get("stream_options") or {}).get(
                "include_usage")))
          else:
            self._whole(call, chat)
        except _HTTPError as e:
          self._error(e)

    def _tokenize(self, body: dict) -> None:
      """vLLM's /tokenize: a prompt's tokens, or a chat's as a chat prompt has them."""
      try:
        if body.get("messages") is not None:
          _, ids = engine.render_chat(
              tuple((m["role"], _content(m.get("content"))) for m in body["messages"]),
              bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
          ids = engine.tokenize(body["prompt"], add_bos=bool(body.get("add_special_tokens",
                                                                        True)))
        else:
          raise _HTTPError(400, "give a prompt (string) or messages")
      except api.InvalidRequest as e:
        raise _HTTPError(400, str(e)) from None
      except (TypeError, KeyError, AttributeError) as e:
        raise _HTTPError(400, f"bad request field: {e!r}") from None
      self._json(200, {"count": len(ids), "max_model_len": engine.info.max_context,
                       "tokens": ids})

    def _detokenize(self, body: dict) -> None:
      """vLLM's /detokenize: the text of a list of token ids."""
      ids = body.get("tokens")
      if not (isinstance(ids, list) and all(map(_is_int, ids))):
        raise _HTTPError(400, "tokens must be a list of token ids")
      try:
        self._json(200, {"prompt": engine.detokenize(ids)})
      except api.InvalidRequest as e:
        raise _HTTPError(400, str(e)) from None

    def _body(self) -> dict:
      try:
        data = self._read_body()
        self._unread = False
      except TimeoutError:
        raise _HTTPError(408, f"the body did not arrive within {READ_TIMEOUT_S:g} s",
                         "timeout") from None
      finally:
        self.connection.settimeout(None)
      try:
        body = json.loads(data)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _HTTPError(400, f"the body is not JSON: {e}") from None
      if not isinstance(body, dict):
        raise _HTTPError(400, "the body must be a JSON object")
      return body

    def _read_body(self) -> bytes:
      """The request's body: Content-Length bytes, or chunks (Transfer-Encoding:
      chunked, as uvicorn takes them), at most MAX_BODY."""
      too_big = _HTTPError(413, f"the body is over {MAX_BODY} bytes")
      if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
        parts, total = [], 0
        while True:
          line = self.rfile.readline(1024)
          try:
            size = int(line.split(b";")[0], 16)
            if size < 0:
              raise ValueError
          except ValueError:
            raise _HTTPError(400, f"a bad chunk size line {line[:40]!r}") from None
          if size == 0:
            while self.rfile.readline(1024).strip():  # trailers, then the blank line
              pass
            return b"".join(parts)
          total += size
          if total > MAX_BODY:
            raise too_big
          parts.append(self.rfile.read(size))
          if len(parts[-1]) < size or self.rfile.readline(3).strip():
            raise _HTTPError(400, "a chunk shorter than its size, or longer")
      raw = self.headers.get("Content-Length")
      try:
        length = int(raw or 0)
      except ValueError:
        raise _HTTPError(400, f"Content-Length {raw!r} is not a number") from None
      if length > MAX_BODY:
        raise too_big
      if length <= 0:
        raise _HTTPError(400, f"the body must be JSON of 1..{MAX_BODY} bytes")
      data = self.rfile.read(length)
      if len(data) < length:
        raise _HTTPError(400, f"the body ended after {len(data)} of its {length} bytes")
      return data

    def _call(self, body: dict, chat: bool) -> _Call:
      """The call's engine requests, submitted; a refusal counts as a refused
      gRPC call does (requests_rejected_total)."""
      try:
        try:
          return _Call(engine, body, chat)
        except api.InvalidRequest as e:
          raise _HTTPError(400, str(e)) from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field's wrong type
          raise _HTTPError(400, f"bad request field: {e!r}") from None
        except api.QueueFull as e:
          raise _HTTPError(429, str(e), "rate_limit_error") from None
        except api.Draining as e:
          raise _HTTPError(503, str(e), "unavailable") from None
        except api.EngineFailed as e:
          raise _HTTPError(500, str(e), "internal_error") from None
      except _HTTPError as e:
        if e.status != 500:
          servicer.metrics.rejected.inc()
        raise

    def _head(self, chat: bool) -> dict:
      return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
              "created": int(time.time()), "model": engine.info.model_name}

    def _client_gone(self) -> bool:
      """Whether the client closed its connection: readable, and nothing to
      read (the request was read whole). Not told apart over TLS."""
      sock = self.connection
      if isinstance(sock, ssl.SSLSocket):
        return False
      try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
      except OSError:
        return True

    def _whole(self, call: _Call, chat: bool) -> None:
      text = [[] for _ in range(call.n)]
      lps = [[] for _ in range(call.n)]
      finals: list[api.Final | None] = [None] * call.n
      try:
        for i, ev in call.follow(self._client_gone):
          if isinstance(ev, api.Delta):
            text[i].append(ev.text)
            lps[i] += ev.logprobs
          else:
            finals[i] = ev
      except _ClientGone:
        log.info("client went away: its requests were cancelled")
        return
      except BaseException:
        call.cancel()
        raise
      choices = []
      for i, f in enumerate(finals):
        p = call.prompt_of(i)
        c = {"index": i, "logprobs": _logprobs(engine, lps[i], chat), **_choice_end(f)}
        if chat:
          c["message"] = {"role": "assistant", "content": "".join(text[i])}
        else:
          c["text"] = call.echo[p] + "".join(text[i])
          scored = finals[p * call.per].prompt_logprobs  # the prompt's completion 0 has them
          if call.echo_first[p] is not None and scored:
            c["logprobs"] = _echo_logprobs(engine, call.echo_first[p], scored, c["logprobs"])
        if i % call.per == 0 and f.prompt_logprobs:
          c["prompt_logprobs"] = [{"token_id": x.token_id, "logprob": x.logprob}
                                  for x in f.prompt_logprobs]
        choices.append(c)
      self._json(200, {**self._head(chat), "object": "chat.completion" if chat else
                       "text_completion", "choices": choices,
                       "usage": _usage(finals, call.per)})

    def _stream(self, call: _Call, chat: bool, include_usage: bool) -> None:
      head = {**self._head(chat), "object": "chat.completion.chunk" if chat else
              "text_completion"}
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Connection", "close")  # the stream ends where the connection does
      self.end_headers()

      def send(obj) -> None:
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else
                                       json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

      finals: list[api.Final | None] = [None] * call.n
      try:
        for i in range(call.n):  # chat: the role first; completions: the echo, if asked
          if chat or call.echo[call.prompt_of(i)]:
            c = ({"delta": {"role": "assistant", "content": ""}} if chat else
                 {"text": call.echo[call.prompt_of(i)]})
            send({**head, "choices": [{"index": i, **c, "logprobs": None,
                                       "finish_reason": None}]})
        for i, ev in call.follow(self._client_gone):
          if isinstance(ev, api.Delta):
            c = {"index": i, "logprobs": _logprobs(engine, list(ev.logprobs), chat),
                 "finish_reason": None}
            c.update({"delta": {"content": ev.text}} if chat else {"text": ev.text})
          else:
            finals[i] = ev
            c = {"index": i, "logprobs": None, **_choice_end(ev)}
            c.update({"delta": {}} if chat else {"text": ""})
          send({**head, "choices": [c]})
        if include_usage:
          send({**head, "choices": [], "usage": _usage(finals, call.per)})
        send(b"[DONE]")
      except _HTTPError as e:  # after the headers: an error event, then the stream's end
        call.cancel()  # (the call's other completions)
        try:
          send({"error": {"message": str(e), "type": e.kind, "code": e.status}})
          send(b"[DONE]")
        except (BrokenPipeError, ConnectionResetError):
          pass
      except (BrokenPipeError, ConnectionResetError, _ClientGone):
        log.info("client went away mid-stream: cancelling its requests")
        call.cancel()
      except BaseException:
        call.cancel()
        raise

    def log_message(self, *args):
      pass

  class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # Connections waiting to be accepted (the default is 5): a load
    # generator's streams connect at once.
    request_queue_size = 1024

  srv = Server((host, port), Handler)
  if tls is not None:
    # The handshake happens on the handler's thread (its first read), not in
    # the accept loop, where a slow client would hold up every other.
    srv.socket = _tls_context(*tls).wrap_socket(srv.socket, server_side=True,
                                                do_handshake_on_connect=False)
  return srv
