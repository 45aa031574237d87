"""OpenAI-compatible HTTP endpoints over the same engine, beside gRPC.

``openai_http(engine, servicer, host, port)`` answers what vLLM's and
SGLang's OpenAI servers answer: ``POST /v1/completions``,
``POST /v1/chat/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models`` (and ``/v1/models/{model}``), ``POST /tokenize``,
``POST /detokenize``, ``GET /health`` and ``GET /metrics``. The app is FastAPI's (routing, 405 for a wrong method);
request and response bodies are pydantic models; uvicorn serves it (HTTP/1.1
over h11, connections kept alive, HTTPS with the server's TLS certificate).

A request's JSON becomes engine requests as a gRPC call's does (n
completions, each seed derived from the request's; vLLM's extra sampling
fields and structured outputs, OpenAI's ``response_format``), and their
events become OpenAI objects. A field this server does not honour is refused
with its name, never ignored. Errors are OpenAI error objects
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad request
(a lone surrogate in the JSON among them), 401 without the bearer token
(``WWW-Authenticate: Bearer``), 404 for another model, 405 for a wrong
method, 408 for a body that stops arriving (READ_TIMEOUT_S), 413 for one over
MAX_BODY, 415 for a body that is not ``application/json`` (a body without a
Content-Type is taken as JSON), 429 when the queue is full, 503 while
draining, 500 when the engine failed. A prompt over the gRPC service's
limit (serving.calls.MAX_PROMPT_CHARS) is refused before it is tokenized.

The event loop only moves bytes: a generation call runs on a thread of its
own (parsing, tokenizing, submitting, following the engine's events,
building the JSON), which lives as long as the call; /tokenize, /detokenize,
/health and /metrics run on the worker threads of anyio. A client that goes
away (its connection closed, streaming or not) cancels its requests. Calls
count as in progress for the server's drain, like gRPC calls; a drain that
times out ends a stream with an error event and ``[DONE]``. A connection that
sends no request for READ_TIMEOUT_S is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import pathlib
import queue
import re
import socket
import tempfile
import threading
import time
import uuid

import fastapi
import uvicorn
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.calls import MAX_PROMPT_CHARS, Events, completion_params
from serving.engine import api
from serving.openai_protocol import (
    APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
    ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessage,
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, ContentLogprob,
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, PromptLogprob, ResponseBody,
    TokenizeRequest, TokenizeResponse, TopLogprob, Usage, is_ids, parse)

log = logging.getLogger("serving.openai")

MAX_BODY = 1 << 24
# A request's body must arrive within this (else 408), and a connection that
# sends no request head for this long (new, or idle between requests) is closed.
READ_TIMEOUT_S = 30.0
# How long a stopping server waits for responses still being sent.
SHUTDOWN_GRACE_S = 2.0
MAX_COMPLETIONS = 256  # prompts x n in one call
_POLL_S = 0.05  # how often a call waiting for events checks its client is still there
_FINISH = {api.FinishReason.LENGTH: "length", api.FinishReason.STOP: "stop",
           api.FinishReason.EOS: "stop"}
# OpenAI / vLLM request fields -> SamplingParams fields of the same meaning.
_SAME = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "seed", "min_tokens", "ignore_eos", "include_stop_str_in_output",
         "truncate_prompt_tokens", "prompt_logprobs")


class _ClientGone(Exception):
  """The client closed its connection: its requests were cancelled."""


# -- requests to the engine ------------------------------------------------------------

def _structured(req: CompletionRequest | ChatCompletionRequest) -> api.StructuredOutputs | None:
  """vLLM's structured_outputs / guided_* fields, or OpenAI's response_format."""
  so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True) if (
      req.structured_outputs is not None) else {}
  given = {k: "structured_outputs" for k in so}  # kind -> the field that set it

  def put(kind, value, field):
    if kind in so:  # (else one of the two would be dropped)
      raise APIError(400, f"{field} and {given[kind]} both give the output's {kind}: give one",
                     param=field)
    so[kind], given[kind] = value, field

  for k in ("json", "regex", "choice", "grammar"):
    if getattr(req, f"guided_{k}") is not None:
      put(k, getattr(req, f"guided_{k}"), f"guided_{k}")
  rf = req.response_format
  if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
    raise APIError(400, "response_format of type json_schema needs its json_schema "
                   "(name and schema)", param="response_format.json_schema")
  if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
    raise APIError(400, f"response_format.json_schema goes with type json_schema, not type "
                   f"{rf.type}", param="response_format.json_schema")
  if rf is not None and rf.type == "json_object":
    put("json_object", True, "response_format")
  elif rf is not None and rf.type == "json_schema":
    put("json", rf.json_schema.schema_, "response_format")
  if not so:
    if req.structured_outputs is not None:  # (given empty: no constraint would be applied)
      raise APIError(400, "structured_outputs must give one of json, regex, choice, grammar, "
                     "json_object", param="structured_outputs")
    return None
  if "json" in so and not isinstance(so["json"], str):
    so["json"] = json.dumps(so["json"])
  if "choice" in so:
    so["choice"] = tuple(so["choice"])
  return api.StructuredOutputs(**so)


def sampling_from_json(req: CompletionRequest | ChatCompletionRequest,
                       chat: bool) -> tuple[api.SamplingParams, int]:
  """(SamplingParams, n) from an OpenAI request body; OpenAI's defaults
  (temperature 1, 16 tokens for completions; chat without a limit gets the
  engine's, ``serve --default-max-tokens``)."""
  kw = {k: getattr(req, k) for k in _SAME if getattr(req, k) is not None}
  kw.setdefault("temperature", 1.0)
  max_tokens = req.max_completion_tokens if chat else None
  if max_tokens is not None and max_tokens < 1:  # (the error would name max_tokens)
    raise APIError(400, f"max_completion_tokens={max_tokens} must be >= 1",
                   param="max_completion_tokens")
  max_tokens = max_tokens if max_tokens is not None else req.max_tokens
  if max_tokens is None and not chat:
    max_tokens = 16  # OpenAI's completions default
  kw["max_tokens"] = max_tokens
  kw["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
  kw["stop_token_ids"] = tuple(req.stop_token_ids or ())
  if req.allowed_token_ids == []:  # (none allowed is no request; vLLM refuses it too)
    raise APIError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
  kw["allowed_token_ids"] = tuple(req.allowed_token_ids or ())
  kw["logit_bias"] = tuple(sorted((int(t), b) for t, b in (req.logit_bias or {}).items()))
  if chat:
    if req.top_logprobs is not None and not req.logprobs:
      raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.logprobs:
      kw["logprobs"], kw["top_logprobs"] = True, req.top_logprobs or 0
  elif req.logprobs is not None:  # completions: logprobs is the number of alternatives
    kw["logprobs"], kw["top_logprobs"] = True, req.logprobs
  kw["structured"] = _structured(req)
  try:
    return api.SamplingParams(**kw), req.n
  except api.InvalidRequest as e:
    raise refusal(e, req, chat) from None


def refusal(e: api.InvalidRequest, req: CompletionRequest | ChatCompletionRequest,
            chat: bool) -> APIError:
  """The engine's refusal as a 400 naming the body's field (``param``): the
  engine names its own (``e.field``), which the body may spell otherwise."""
  field, message = e.field, str(e)
  body_name = {"top_logprobs": "top_logprobs" if chat else "logprobs",
               "max_tokens": "max_completion_tokens" if chat and req.max_completion_tokens
               is not None else "max_tokens",
               "structured": None}.get(field, field)  # (several body fields set it)
  if field and body_name and body_name != field:
    message = re.sub(rf"\b{field}\b", body_name, message)
  return APIError(400, message, param=body_name if body_name in type(req).model_fields
                  else None)


def _max_model_len(info: api.EngineInfo) -> int:
  """Tokens a request can hold: the engine's capacity (at most the context),
  else the context."""
  return info.capacity or info.max_context


def _check_size(what: str, chars: int) -> None:
  """The gRPC service's rule, before anything is tokenized."""
  if chars > MAX_PROMPT_CHARS:
    raise APIError(400, f"{what} has {chars} chars; at most {MAX_PROMPT_CHARS}")


def _chat(messages: list[ChatMessage]) -> tuple[tuple[str, str], ...]:
  out = tuple((m.role, m.text()) for m in messages)
  _check_size("the chat", sum(len(r) + len(c) for r, c in out))
  return out


class _Call:
  """One HTTP call's engine requests and their merged events."""

  def __init__(self, engine, req: CompletionRequest | ChatCompletionRequest, chat: bool,
               token_gaps=None):
    self.engine, self.chat = engine, chat
    self.token_gaps = token_gaps  # () -> metrics.TokenGaps: the inter-token latency histogram
    if req.model not in (None, "", engine.info.model_name):
      raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                     f"{engine.info.model_name!r}", "not_found", "model")
    # What would change the output's meaning is refused, not ignored.
    if chat and (req.tools and req.tool_choice != "none" or req.functions):
      raise APIError(400, "tool and function calling are not supported", param="tools")
    if chat and req.tool_choice not in (None, "none") and not req.tools:  # (vLLM's rule)
      raise APIError(400, f"tool_choice={req.tool_choice!r} needs tools", param="tool_choice")
    if not chat and req.suffix:
      raise APIError(400, "suffix (insertion) is not supported", param="suffix")
    if not chat and req.best_of not in (None, 1, req.n):
      raise APIError(400, "best_of is not supported (n completions are returned as such)",
                     param="best_of")
    if req.stream_options is not None and not req.stream:
      raise APIError(400, "stream_options needs stream: true", param="stream_options")
    # Completions' echo with max_tokens 0 returns the prompt alone (OpenAI's
    # legacy way to score a text; vLLM's echo_without_generation): one token
    # is computed and dropped.
    self.echo_only = not chat and bool(req.echo) and req.max_tokens == 0
    if self.echo_only and (req.min_tokens or 0) > 0:
      raise APIError(400, f"min_tokens={req.min_tokens} must be <= max_tokens=0",
                     param="min_tokens")
    if self.echo_only:
      req = req.model_copy(update={"max_tokens": 1})
    sampling, self.per = sampling_from_json(req, chat)  # completions per prompt
    self.logprobs = sampling.logprobs
    self.prompt_logprobs = sampling.prompt_logprobs is not None  # asked for (not echo's)
    if chat:
      prompts = [{"messages": _chat(req.messages),
                  "add_generation_prompt": req.add_generation_prompt}]
    else:
      given = [req.prompt] if isinstance(req.prompt, str) or is_ids(req.prompt) else req.prompt
      prompts = []
      for i, p in enumerate(given):
        if isinstance(p, str):
          _check_size("the prompt text" if len(given) == 1 else f"prompt {i}", len(p))
          prompts.append({"prompt_text": p, "add_bos": req.add_special_tokens})
        else:
          prompts.append({"prompt_ids": p})
    self.n = len(prompts) * self.per  # choice i * per + j: prompt i's completion j
    if self.n > MAX_COMPLETIONS:
      raise APIError(400, f"{len(prompts)} prompts x n={self.per}: at most "
                     f"{MAX_COMPLETIONS} completions a call")
    # Completions' echo: the prompt before each completion's text; with
    # logprobs, its tokens' logprobs before the completion's (lm-eval's
    # loglikelihood requests), which needs the server's prompt logprobs.
    echo = not chat and req.echo
    if echo and sampling.logprobs and req.stream:  # (the echo goes out before they are known)
      raise APIError(400, "echo with logprobs is not streamed: the prompt's logprobs would be "
                     "missing", param="echo")
    cut = sampling.truncate_prompt_tokens
    echoed = [self._echo(p, cut) if echo else ("", None) for p in prompts]
    self.echo = [text for text, _ in echoed]
    self.echo_first = [first for _, first in echoed]
    if echo and sampling.logprobs and sampling.prompt_logprobs is None:  # (vLLM's way)
      sampling = dataclasses.replace(sampling, prompt_logprobs=sampling.top_logprobs)
    self.keys, requests = [], []
    for prompt in prompts:
      for j in range(self.per):
        self.keys.append(uuid.uuid4().hex)
        requests.append(api.Request(
            request_id=self.keys[-1], sampling=completion_params(sampling, j),
            priority=req.priority or 0, **prompt))
    # One admission decision for the call's completions: all or none.
    try:
      self.events = Events(self.engine.submit_all(requests))
    except api.InvalidRequest as e:
      if e.field == "prompt_logprobs" and not self.prompt_logprobs:  # asked for by echo
        raise APIError(400, f"echo with logprobs scores the prompt: {e}", param="echo") from None
      raise

  def _echo(self, prompt: dict, cut: int | None) -> tuple[str, int]:
    """The echoed prompt and its first token (which has no logprob: the
    engine's BOS rule): as given, or the tokens truncate_prompt_tokens keeps
    (what the model saw, as vLLM echoes it), tokenized once."""
    if "prompt_ids" in prompt:
      ids = prompt["prompt_ids"]
    else:
      ids = self.engine.tokenize(prompt["prompt_text"], add_bos=prompt["add_bos"])
      if not ids:
        raise APIError(400, "the prompt is empty")
    kept = ids[-cut:] if cut else ids
    if "prompt_text" in prompt and len(kept) == len(ids):
      return prompt["prompt_text"], kept[0]
    # Decoded whole: a character whose bytes span tokens has no piece of its own.
    return self.engine.detokenize(kept), kept[0]

  def prompt_of(self, i: int) -> int:
    return i // self.per

  def cancel(self) -> None:
    for k in self.keys:
      self.engine.cancel(k)

  def follow(self, gone):
    """(index, Delta | Final) until every completion's Final; ``gone()`` is
    asked every _POLL_S: True cancels the requests (_ClientGone)."""
    finals, check = 0, time.monotonic() + _POLL_S
    gaps = self.token_gaps() if self.token_gaps is not None else None
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
            raise APIError(400, ev.message)
          raise APIError(500, ev.message, "internal_error")
        if isinstance(ev, api.Final) and ev.reason == api.FinishReason.CANCELLED:
          # (the client's own going away ends the call above, _ClientGone)
          raise APIError(503, "the server shut down before the request finished "
                         f"({ev.completion_tokens} tokens generated)", "unavailable")
        if isinstance(ev, api.Final) and ev.reason not in _FINISH:
          raise APIError(500, f"the request ended: {ev.reason.name.lower()}", "internal_error")
        if isinstance(ev, api.Delta) and gaps is not None:
          gaps.arrived(i, len(ev.token_ids))
        yield i, ev
        finals += isinstance(ev, api.Final)
    finally:
      self.events.close()


def _logprobs(engine, lps: list[api.TokenLogprob] | None, chat: bool, offset: int = 0):
  """Logprobs in OpenAI's shapes (None: not asked for; asked for, they are
  there, empty for no tokens). Completions (the legacy format): each
  position's dict holds the sampled token and its ``logprobs`` likeliest (so
  up to logprobs + 1 entries, as OpenAI and vLLM give them), and
  ``text_offset`` is each token's offset in the choice's text, from
  ``offset`` (the text before these tokens)."""
  if lps is None:
    return None
  pieces = engine.token_pieces([x.token_id for x in lps] +
                               [t for x in lps for t, _ in x.top])
  names = iter(pieces[len(lps):])
  tops = [[(next(names), v) for _, v in x.top] for x in lps]
  if chat:
    raw = engine.token_bytes([x.token_id for x in lps] + [t for x in lps for t, _ in x.top])
    raw_top = iter(raw[len(lps):])
    return ChatLogprobs(content=[
        ContentLogprob(token=pieces[j], logprob=x.logprob, bytes=raw[j],
                       top_logprobs=[TopLogprob(token=t, logprob=v, bytes=next(raw_top))
                                     for t, v in tops[j]])
        for j, x in enumerate(lps)])
  return CompletionLogprobs(tokens=pieces[:len(lps)], token_logprobs=[x.logprob for x in lps],
                            top_logprobs=[{pieces[j]: x.logprob, **dict(tops[j])}
                                          for j, x in enumerate(lps)],
                            text_offset=_offsets(pieces[:len(lps)], offset))


def _offsets(pieces: list[str], start: int) -> list[int]:
  """Each piece's offset in the text, the first at ``start`` (vLLM's
  text_offset: the pieces' lengths, summed)."""
  out = []
  for p in pieces:
    out.append(start)
    start += len(p)
  return out


def _prompt_logprobs(engine, lps) -> list[dict[str, PromptLogprob] | None]:
  """A Final's prompt logprobs in vLLM's shape: None for the first token,
  then each token's {id: logprob} with its prompt_logprobs=k alternatives
  (rank: the place among them; the token's own is None outside them)."""
  ids = [i for x in lps for i in (x.token_id, *(t for t, _ in x.top))]
  pieces = iter(engine.token_pieces(ids))
  out: list[dict[str, PromptLogprob] | None] = [None]
  for x in lps:
    ranks = {t: r for r, (t, _) in enumerate(x.top, 1)}
    own = {str(x.token_id): PromptLogprob(logprob=x.logprob, rank=ranks.get(x.token_id),
                                          decoded_token=next(pieces))}
    out.append({**own, **{str(t): PromptLogprob(logprob=v, rank=r, decoded_token=next(pieces))
                          for r, (t, v) in enumerate(x.top, 1)}})
  return out


def _echo_logprobs(engine, first: int, scored,
                   completion: CompletionLogprobs | None) -> CompletionLogprobs:
  """Completions' logprobs with echo: the prompt's tokens first (the first
  one has none), then the completion's, as OpenAI's legacy API gives them."""
  ids = [first] + [x.token_id for x in scored]
  pieces = engine.token_pieces(ids + [t for x in scored for t, _ in x.top])
  names = iter(pieces[len(ids):])
  out = CompletionLogprobs(
      tokens=pieces[:len(ids)], token_logprobs=[None] + [x.logprob for x in scored],
      top_logprobs=[None] + [{pieces[j + 1]: x.logprob, **{next(names): v for _, v in x.top}}
                             for j, x in enumerate(scored)],
      text_offset=_offsets(pieces[:len(ids)], 0))
  if completion is not None:  # (None: the prompt alone, echo with max_tokens 0)
    out.tokens += completion.tokens
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    out.text_offset += completion.text_offset
  return out


def _usage(finals: list[api.Final], per: int) -> Usage:
  prompt = sum(f.prompt_tokens for f in finals[::per])  # each prompt once
  done = sum(f.completion_tokens for f in finals)
  return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def _sse(obj: ResponseBody | bytes) -> bytes:
  return b"data: " + (obj if isinstance(obj, bytes) else obj.json_bytes()) + b"\n\n"


_DONE = _sse(b"[DONE]")


# -- the app ---------------------------------------------------------------------------

def _is_json(content_type: str | None) -> bool:
  return content_type is None or content_type.split(";")[0].strip().lower() == "application/json"


async def _read_body(request: fastapi.Request) -> bytes:
  """The request's JSON body, at most MAX_BODY bytes, arriving within
  READ_TIMEOUT_S; APIError otherwise, _ClientGone if the client went away."""
  if not _is_json(request.headers.get("content-type")):
    raise APIError(415, f"the body must be application/json, not "
                   f"{request.headers['content-type']!r}", "unsupported_media_type")
  too_big = APIError(413, f"the body is over {MAX_BODY} bytes", "request_too_large")
  if int(request.headers.get("content-length") or 0) > MAX_BODY:  # (h11 checked it is a count)
    raise too_big
  parts, total = [], 0
  try:
    async with asyncio.timeout(READ_TIMEOUT_S):
      async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY:
          raise too_big
        parts.append(chunk)
  except TimeoutError:
    raise APIError(408, f"the body did not arrive within {READ_TIMEOUT_S:g} s",
                   "timeout") from None
  except ClientDisconnect:
    raise _ClientGone from None
  request.state.body_read = True
  if not total:
    raise APIError(400, f"the body must be JSON of 1..{MAX_BODY} bytes")
  return b"".join(parts)


async def _until_disconnect(request: fastapi.Request, gone: threading.Event) -> None:
  """Sets ``gone`` once the client closes its connection (after its body was read)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass
  gone.set()


def _error_response(request: fastapi.Request, e: APIError) -> Response:
  headers = dict(e.headers or {})
  # An answer given before the request's body was read ends the connection
  # (the client may still be sending it).
  if not getattr(request.state, "body_read", False) and (
      request.headers.get("content-length", "0") != "0"
      or "transfer-encoding" in request.headers):
    headers["Connection"] = "close"
  return Response(e.response().json_bytes(), status_code=e.status, headers=headers,
                  media_type="application/json")


class _OpenAI:
  """The routes' work, over one engine and the gRPC servicer (drain, metrics)."""

  def __init__(self, engine: api.Engine, servicer, auth_token: str | None):
    self.engine, self.servicer = engine, servicer
    self._token = auth_token.encode() if auth_token else None
    self.created = int(time.time())  # the model card's "created": when this server started

  async def authorize(self, request: fastapi.Request) -> None:
    """``Authorization: Bearer <token>`` (the scheme in any case). (async: FastAPI
    runs a plain function's dependency on a worker thread)"""
    if self._token is None:
      return
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode("utf-8", "surrogateescape"), self._token):
      raise APIError(401, "missing or wrong bearer token", "authentication_error",
                     headers={"WWW-Authenticate": "Bearer"})

  def _head(self, chat: bool) -> dict:
    return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()), "model": self.engine.info.model_name}

  # -- a generation call, on its own thread

  async def generate(self, request: fastapi.Request, chat: bool) -> Response:
    """The call's thread parses, submits and follows; the loop relays what it
    hands over: ("error", APIError) | ("json", bytes) | ("gone", None) |
    ("stream", None), then ("data", bytes)... and ("end", None) or ("error", e)."""
    in_progress = self.servicer.call_in_progress()
    in_progress.__enter__()  # (left by the call's thread, or here if it never starts)
    started = False
    try:
      raw = await _read_body(request)
      loop, relay, gone = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

      def put(item) -> None:
        try:
          loop.call_soon_threadsafe(relay.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
          gone.set()

      threading.Thread(target=self._run, args=(raw, chat, put, gone, in_progress),
                       name="openai-call", daemon=True).start()
      started = True
    finally:
      if not started:
        in_progress.__exit__(None, None, None)
    watch = asyncio.ensure_future(_until_disconnect(request, gone))
    streaming = False
    try:
      kind, item = await relay.get()
      if kind == "error":
        return _error_response(request, item)
      if kind == "json":
        return Response(item, media_type="application/json")
      if kind == "gone":
        return Response(status_code=499)  # (nobody reads it)
      streaming = True
      return StreamingResponse(self._relay(relay, gone, watch), headers={
          "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    finally:
      if not streaming:
        gone.set()  # (a call ended: no effect; a handler cancelled: its requests end)
        watch.cancel()

  @staticmethod
  async def _relay(relay: asyncio.Queue, gone: threading.Event, watch: asyncio.Future):
    """A stream's bytes as its thread hands them over; what is queued goes out at once."""
    try:
      while True:
        items = [await relay.get()]
        while not relay.empty():
          items.append(relay.get_nowait())
        data = b"".join(item for kind, item in items if kind == "data")
        kind, item = items[-1]
        if kind == "error":  # after the headers: an error event, then the stream's end
          data += _sse(item.response()) + _DONE
        if data:
          yield data
        if kind != "data":
          return
    finally:
      gone.set()  # (the client went away: the thread cancels its requests)
      watch.cancel()

  def _run(self, raw: bytes, chat: bool, put, gone: threading.Event, in_progress) -> None:
    try:
      try:
        call, req = self._submit(raw, chat)
      except APIError as e:
        put(("error", e))
        return
      if req.stream:
        put(("stream", None))
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        for data in self._stream(call, chat, include_usage, gone):
          put(("data", data))
        put(("end", None))
      else:
        put(("json", self._whole(call, chat, gone)))
    except _ClientGone:
      log.info("client went away: its requests were cancelled")
      put(("gone", None))
    except APIError as e:
      put(("error", e))
    except BaseException as e:  # our bug: the client gets a 500 (or an error event)
      log.exception("an OpenAI call failed")
      put(("error", APIError(500, f"internal error: {e!r}", "internal_error")))
    finally:
      in_progress.__exit__(None, None, None)

  def _submit(self, raw: bytes, chat: bool):
    """(the call, its request), its engine requests submitted; a refusal
    counts as a refused gRPC call does (requests_rejected_total)."""
    req = None
    try:
      try:
        req = parse(ChatCompletionRequest if chat else CompletionRequest, raw)
        return _Call(self.engine, req, chat, self.servicer.metrics.token_gaps), req
      except api.InvalidRequest as e:
        raise (refusal(e, req, chat) if req is not None else APIError(400, str(e))) from None
      except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field's wrong value
        raise APIError(400, f"bad request field: {e!r}") from None
      except api.QueueFull as e:
        raise APIError(429, str(e), "rate_limit_error") from None
      except api.Draining as e:
        raise APIError(503, str(e), "unavailable") from None
      except api.EngineFailed as e:
        raise APIError(500, str(e), "internal_error") from None
    except APIError as e:
      if e.status != 500 and (req is not None or e.param is not None):  # (not a body's JSON)
        self.servicer.metrics.rejected.inc()
      raise

  def _whole(self, call: _Call, chat: bool, gone: threading.Event) -> bytes:
    engine = self.engine
    text = [[] for _ in range(call.n)]
    lps = [[] for _ in range(call.n)]
    finals: list[api.Final | None] = [None] * call.n
    try:
      for i, ev in call.follow(gone.is_set):
        if isinstance(ev, api.Delta):
          text[i].append(ev.text)
          lps[i] += ev.logprobs
        else:
          finals[i] = ev
    except BaseException:
      call.cancel()
      raise
    if call.echo_only:  # the prompt alone: the token computed is dropped
      text, lps = [[] for _ in text], [[] for _ in lps]
      finals = [dataclasses.replace(f, reason=api.FinishReason.LENGTH, completion_tokens=0,
                                    stop_reason=None) for f in finals]
    choices = []
    for i, f in enumerate(finals):
      p = call.prompt_of(i)
      c = {"index": i, "logprobs": _logprobs(engine, lps[i] if call.logprobs else None, chat,
                                             len(call.echo[p])),
           "finish_reason": _FINISH[f.reason], "stop_reason": f.stop_reason}
      if chat:
        c["message"] = AssistantMessage(role="assistant", content="".join(text[i]))
      else:
        c["text"] = call.echo[p] + "".join(text[i])
        scored = finals[p * call.per].prompt_logprobs  # the prompt's completion 0 has them
        if call.echo_first[p] is not None and call.logprobs:  # (a 1-token prompt: none scored)
          c["logprobs"] = _echo_logprobs(engine, call.echo_first[p], scored, c["logprobs"])
      if call.prompt_logprobs and not chat:  # every choice of the prompt (vLLM)
        c["prompt_logprobs"] = _prompt_logprobs(engine, finals[p * call.per].prompt_logprobs)
      choices.append((ChatChoice if chat else CompletionChoice)(**c))
    usage = _usage(finals, call.per)
    if chat:
      extra = ({"prompt_logprobs": _prompt_logprobs(engine, finals[0].prompt_logprobs)}
               if call.prompt_logprobs else {})
      return ChatCompletionResponse(**self._head(chat), object="chat.completion",
                                    choices=choices, usage=usage, **extra).json_bytes()
    return CompletionResponse(**self._head(chat), object="text_completion", choices=choices,
                              usage=usage).json_bytes()

  def _stream(self, call: _Call, chat: bool, include_usage: bool, gone: threading.Event):
    """The stream's events as bytes: an APIError after the start is an
    error event, then [DONE]."""
    engine, head = self.engine, self._head(chat)

    def chunk(choice=None, usage=None) -> bytes:
      choices = [] if choice is None else [choice]
      if chat:
        out = ChatCompletionChunk(**head, object="chat.completion.chunk", choices=choices)
      else:
        out = CompletionResponse(**head, object="text_completion", choices=choices)
      if usage is not None:
        out.usage = usage
      return _sse(out)

    def choice(i, **kw):
      return ChatChunkChoice(index=i, **kw) if chat else CompletionChoice(index=i, **kw)

    finals: list[api.Final | None] = [None] * call.n
    sent = [len(call.echo[call.prompt_of(i)]) for i in range(call.n)]  # text so far (offsets)
    try:
      for i in range(call.n):  # chat: the role first; completions: the echo, if asked
        if chat:
          yield chunk(choice(i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                             finish_reason=None))
        elif call.echo[call.prompt_of(i)]:
          yield chunk(choice(i, text=call.echo[call.prompt_of(i)], logprobs=None,
                             finish_reason=None))
      for i, ev in call.follow(gone.is_set):
        if isinstance(ev, api.Final) and call.echo_only:  # the prompt alone (above)
          ev = dataclasses.replace(ev, reason=api.FinishReason.LENGTH, completion_tokens=0,
                                   stop_reason=None)
        if isinstance(ev, api.Delta):
          if call.echo_only:
            continue
          lp = _logprobs(engine, list(ev.logprobs) if call.logprobs else None, chat, sent[i])
          sent[i] += len(ev.text)
          c = (choice(i, delta=ChatDelta(content=ev.text), logprobs=lp, finish_reason=None)
               if chat else choice(i, text=ev.text, logprobs=lp, finish_reason=None))
        else:
          finals[i] = ev
          end = {"logprobs": None, "finish_reason": _FINISH[ev.reason],
                 "stop_reason": ev.stop_reason}
          if i % call.per == 0 and call.prompt_logprobs:  # (the prompt's first choice)
            end["prompt_logprobs"] = _prompt_logprobs(engine, ev.prompt_logprobs)
          c = choice(i, delta=ChatDelta(), **end) if chat else choice(i, text="", **end)
        yield chunk(c)
      if include_usage:
        yield chunk(usage=_usage(finals, call.per))
      yield _DONE
    except APIError as e:
      call.cancel()  # (the call's other completions)
      yield _sse(e.response()) + _DONE
    except BaseException:
      call.cancel()
      raise

  # -- the other routes (on anyio's worker threads)

  def tokenize(self, raw: bytes) -> bytes:
    """vLLM's /tokenize: a prompt's tokens, or a chat's as a chat prompt has them."""
    req = parse(TokenizeRequest, raw)
    self._check_model(req.model)
    try:
      if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give a prompt (string) or messages, one of them")
      if req.messages is not None:
        if req.add_special_tokens:
          raise APIError(400, "add_special_tokens applies to a prompt: a chat's special "
                         "tokens are its template's", param="add_special_tokens")
        _, ids = self.engine.render_chat(
            _chat(req.messages),
            req.add_generation_prompt if req.add_generation_prompt is not None else True)
      else:
        if req.add_generation_prompt is not None:
          raise APIError(400, "add_generation_prompt applies to messages",
                         param="add_generation_prompt")
        _check_size("the text", len(req.prompt))
        add = req.add_special_tokens if req.add_special_tokens is not None else True
        ids = self.engine.tokenize(req.prompt, add_bos=add)
    except api.InvalidRequest as e:
      raise APIError(400, str(e)) from None
    except api.EngineFailed as e:  # (an engine process that died)
      raise APIError(500, str(e), "internal_error") from None
    return TokenizeResponse(count=len(ids), max_model_len=_max_model_len(self.engine.info),
                            tokens=ids).json_bytes()

  def detokenize(self, raw: bytes) -> bytes:
    """vLLM's /detokenize: the text of a list of token ids."""
    req = parse(DetokenizeRequest, raw)
    self._check_model(req.model)
    _check_size(f"{len(req.tokens)} token ids", len(req.tokens))
    try:
      return DetokenizeResponse(prompt=self.engine.detokenize(req.tokens)).json_bytes()
    except api.InvalidRequest as e:
      raise APIError(400, str(e)) from None
    except api.EngineFailed as e:
      raise APIError(500, str(e), "internal_error") from None

  def _check_model(self, model: str | None) -> None:
    if model not in (None, "", self.engine.info.model_name):
      raise APIError(404, f"the model {model!r} does not exist; this server serves "
                     f"{self.engine.info.model_name!r}", "not_found", "model")

  def health(self) -> tuple[int, dict]:
    ok = getattr(self.engine, "error", None) is None and not self.engine.stats().draining
    return (200, {"status": "ok"}) if ok else (503, {"status": "unavailable"})

  def _card(self) -> ModelCard:
    i = self.engine.info
    return ModelCard(id=i.model_name, object="model", created=self.created,
                     owned_by="mosaic-serve", max_model_len=_max_model_len(i))

  def models(self) -> bytes:
    return ModelList(object="list", data=[self._card()]).json_bytes()

  def model(self, model_id: str) -> bytes:
    """OpenAI's GET /v1/models/{model}: the served model's card, else 404."""
    self._check_model(model_id)
    return self._card().json_bytes()


def app(engine: api.Engine, servicer, auth_token: str | None = None) -> fastapi.FastAPI:
  """The OpenAI routes as a FastAPI app (ASGI)."""
  o = _OpenAI(engine, servicer, auth_token)
  # (no /docs or /openapi.json: the routes below are all it serves)
  a = fastapi.FastAPI(title="mosaic-serve", docs_url=None, redoc_url=None, openapi_url=None,
                      redirect_slashes=False)
  auth = [fastapi.Depends(o.authorize)]

  @a.exception_handler(APIError)
  async def _http_error(request: fastapi.Request, e: APIError):
    return _error_response(request, e)

  @a.exception_handler(_ClientGone)
  async def _gone(request: fastapi.Request, e: _ClientGone):
    return Response(status_code=499)  # (nobody reads it)

  @a.exception_handler(StarletteHTTPException)
  async def _routing_error(request: fastapi.Request, e: StarletteHTTPException):
    if e.status_code == 404:
      message, kind = f"no route {request.url.path}", "not_found"
    elif e.status_code == 405:
      message = (f"{request.method} is not allowed on {request.url.path} (allowed: "
                 f"{(e.headers or {}).get('Allow', '')})")
      kind = "method_not_allowed"
    else:
      message, kind = str(e.detail), "invalid_request_error"
    return _error_response(request, APIError(e.status_code, message, kind, headers=e.headers))

  @a.exception_handler(Exception)
  async def _bug(request: fastapi.Request, e: Exception):  # (uvicorn logs the traceback)
    return _error_response(request, APIError(500, f"internal error: {e!r}", "internal_error"))

  @a.post("/v1/completions", dependencies=auth, response_model=CompletionResponse)
  async def completions(request: fastapi.Request):
    return await o.generate(request, chat=False)

  @a.post("/v1/chat/completions", dependencies=auth, response_model=ChatCompletionResponse)
  async def chat_completions(request: fastapi.Request):
    return await o.generate(request, chat=True)

  @a.post("/tokenize", dependencies=auth, response_model=TokenizeResponse)
  async def tokenize(request: fastapi.Request):
    raw = await _read_body(request)
    return Response(await run_in_threadpool(o.tokenize, raw), media_type="application/json")

  @a.post("/detokenize", dependencies=auth, response_model=DetokenizeResponse)
  async def detokenize(request: fastapi.Request):
    raw = await _read_body(request)
    return Response(await run_in_threadpool(o.detokenize, raw), media_type="application/json")

  @a.get("/v1/models", dependencies=auth, response_model=ModelList)
  async def models():
    return Response(o.models(), media_type="application/json")

  @a.get("/v1/models/{model_id:path}", dependencies=auth, response_model=ModelCard)
  async def model(model_id: str):  # (:path: a name like org/model holds a slash)
    return Response(o.model(model_id), media_type="application/json")

  @a.get("/health")
  async def health():
    status, body = await run_in_threadpool(o.health)
    return JSONResponse(body, status_code=status)

  @a.get("/metrics")
  async def metrics():
    body, content_type = await run_in_threadpool(servicer.metrics.exposition)
    return Response(body, headers={"Content-Type": content_type})

  return a


# -- the server ------------------------------------------------------------------------

class _Protocol(H11Protocol):
  """uvicorn's h11 protocol, where a connection's next request head must
  arrive within READ_TIMEOUT_S: one that sends none (or part of one) is
  closed, as uvicorn closes one idle between requests. (uvicorn lifts that
  timer at any byte; here once a request head is read.)"""

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self.timeout_keep_alive = READ_TIMEOUT_S
    self.timeout_keep_alive_task = self.loop.call_later(
        READ_TIMEOUT_S, self.timeout_keep_alive_handler)

  def data_received(self, data: bytes) -> None:
    self.conn.receive_data(data)
    self.handle_events()


class OpenAIServer:
  """The app on a socket bound at construction, served by uvicorn:
  ``serve_forever`` (until ``shutdown``), ``shutdown``, ``server_close`` and
  ``server_port``, as the standard library's servers have them."""

  def __init__(self, asgi_app, sock: socket.socket, tls: tuple[bytes, bytes] | None = None):
    self.socket, self.server_port = sock, sock.getsockname()[1]
    kw = dict(http=_Protocol, ws="none", lifespan="off", log_config=None, log_level="warning",
              access_log=False, backlog=1024, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
              proxy_headers=False)
    with tempfile.TemporaryDirectory() as d:  # (a directory only its owner reads)
      if tls is not None:
        kw["ssl_certfile"], kw["ssl_keyfile"] = pathlib.Path(d, "cert.pem"), pathlib.Path(
            d, "key.pem")
        kw["ssl_certfile"].write_bytes(tls[0])
        kw["ssl_keyfile"].write_bytes(tls[1])
      config = uvicorn.Config(asgi_app, **kw)
      config.load()  # (the TLS context reads the files here)
    self._server = uvicorn.Server(config)
    self._lock = threading.Lock()
    self._running = self._shut = False
    self._done = threading.Event()

  def serve_forever(self) -> None:
    with self._lock:
      if self._shut:
        return
      self._running = True
    try:
      self._server.run(sockets=[self.socket])
    finally:
      self._done.set()

  def shutdown(self) -> None:
    """Stops serving: no new connections; responses under way get
    SHUTDOWN_GRACE_S to finish. Returns once ``serve_forever`` has."""
    with self._lock:
      self._shut = True
      running = self._running
    self._server.should_exit = True
    if running:
      self._done.wait()

  def server_close(self) -> None:
    self.socket.close()


def openai_http(engine: api.Engine, servicer, host: str, port: int,
                auth_token: str | None = None,
                tls: tuple[bytes, bytes] | None = None) -> OpenAIServer:
  """The OpenAI endpoints bound to ``host:port`` (OSError if taken); the
  caller runs ``serve_forever``. ``tls``: (certificate, key) in PEM, as the
  gRPC server takes them."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.create_server((host, port), family=family, backlog=1024)
  try:
    return OpenAIServer(app(engine, servicer, auth_token), sock, tls)
  except BaseException:
    sock.close()
    raise
