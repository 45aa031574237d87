"""The gRPC server: text generation, health, reflection, auth, drain.

``Server(engine, ...)`` wires the ``TextGeneration`` servicer (proto in
serving/proto/generate.proto) to an ``Engine``: each RPC converts its request
to an engine ``Request`` (bad fields -> INVALID_ARGUMENT), submits it (full
queue -> RESOURCE_EXHAUSTED, draining -> UNAVAILABLE), then relays the
request's events as stream chunks (a call for n completions submits n
requests and relays their events merged). The client's deadline becomes the
request's deadline (the engine ends it within one step: DEADLINE_EXCEEDED);
a client that goes away cancels its request through the RPC's done callback,
which frees its pages at the next step. ``drain`` flips health to
NOT_SERVING, refuses new requests and lets the running ones finish.

Every port (gRPC, metrics, OpenAI HTTP) is bound when the ``Server`` is built,
so a taken one fails before the warm-up's minutes, not after; ``start``
warms the engine up, then serves the HTTP ports (connections made
meanwhile wait in the listen queue).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import signal
import threading
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.calls import MAX_PROMPT_CHARS, Events, completion_params
from serving.engine import api
from serving.metrics import Metrics, metrics_http
from serving.openai_api import openai_http
from serving.proto import generate_pb2 as pb
from serving.proto import generate_pb2_grpc as pb_grpc

log = logging.getLogger("serving.service")

SERVICE_NAME = "mosaic.serving.v1.TextGeneration"
MAX_N = 64  # completions per call
_POLL_S = 0.05  # how often a call waiting for events checks its client is still there
# After a drain's timeout the requests still running are cancelled: their
# calls get this long to send the end of their streams before the server stops.
_DRAIN_SLACK_S = 0.3
# A call that ends this close to its deadline ends at the deadline (_release).
_DEADLINE_SLACK_S = 0.25


def sampling_from_proto(s: pb.SamplingParams) -> api.SamplingParams:
  kw = {}
  for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "top_logprobs",
            "ignore_eos", "prompt_logprobs", "include_stop_str_in_output",
            "truncate_prompt_tokens"):
    if s.HasField(f):
      kw[f] = getattr(s, f)
  kw["stop"] = tuple(s.stop)
  kw["stop_token_ids"] = tuple(s.stop_token_ids)
  kw["logit_bias"] = tuple(sorted(s.logit_bias.items()))
  kw["allowed_token_ids"] = tuple(s.allowed_token_ids)
  if s.HasField("structured_outputs"):
    kw["structured"] = structured_from_proto(s.structured_outputs)
  return api.SamplingParams(**kw)


def structured_from_proto(o: pb.StructuredOutputs) -> api.StructuredOutputs:
  kind = o.WhichOneof("kind")
  if kind == "choice":
    return api.StructuredOutputs(choice=tuple(o.choice.choices))
  return api.StructuredOutputs(**({kind: getattr(o, kind)} if kind else {}))


def _chat_messages(chat: pb.Chat) -> tuple[tuple[str, str], ...]:
  messages = tuple((m.role, m.content) for m in chat.messages)
  chars = sum(len(r) + len(c) for r, c in messages)
  if chars > MAX_PROMPT_CHARS:
    raise api.InvalidRequest(f"the chat has {chars} chars; at most {MAX_PROMPT_CHARS}")
  return messages


def _generation_prompt(chat: pb.Chat) -> bool:
  return chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True


def _final_proto(f: api.Final) -> tuple[pb.Usage, pb.Timings]:
  return (pb.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                   cached_prompt_tokens=f.cached_prompt_tokens),
          pb.Timings(queue_s=f.queue_s, first_token_s=f.first_token_s, total_s=f.total_s))


def _stop_reason(f: api.Final) -> dict:
  """The proto's stop_reason oneof of a Final, as keyword arguments."""
  if isinstance(f.stop_reason, str):
    return {"stop_string": f.stop_reason}
  return {} if f.stop_reason is None else {"stop_token_id": f.stop_reason}


def _fill_logprobs(field, lps) -> None:
  """Appends ``lps`` (TokenLogprobs, or a PromptLogprobs' arrays) to a repeated
  TokenLogprob field in place: messages built apart and passed to a
  constructor are copied, a third of the time for a long prompt's."""
  if isinstance(lps, api.PromptLogprobs):
    rows = zip(lps.token_ids.tolist(), lps.logprobs.tolist(), lps.top_ids.tolist(),
               lps.top_logprobs.tolist())
  else:
    rows = ((lp.token_id, lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])
            for lp in lps)
  for t, v, top_ids, top_lps in rows:
    top = field.add(token_id=t, logprob=v).top
    for a, b in zip(top_ids, top_lps):
      top.add(token_id=a, logprob=b)


class TextGenerationServicer(pb_grpc.TextGenerationServicer):

  def __init__(self, engine: api.Engine, metrics: Metrics):
    self.engine = engine
    self.metrics = metrics
    # Generation calls still relaying events: a drain waits for them, since the
    # engine forgets a request when its last event is queued, not when sent.
    self._active = 0
    self._idle = threading.Condition()
    # Set once the server cancels what still runs (a drain's timeout, a stop):
    # a cancelled request is then UNAVAILABLE (retry elsewhere), not CANCELLED.
    self.stopping = False

  @contextlib.contextmanager
  def call_in_progress(self):
    with self._idle:
      self._active += 1
    try:
      yield
    finally:
      with self._idle:
        self._active -= 1
        self._idle.notify_all()

  def wait_idle(self, timeout: float) -> bool:
    """True once no generation call is in progress, False after ``timeout`` s."""
    with self._idle:
      return self._idle.wait_for(lambda: self._active == 0, timeout=max(0.0, timeout))

  def _submit(self, request: pb.GenerateRequest, context):
    """(request id, engine-side keys, handles): one engine request per
    completion, all submitted or none (a refusal cancels those before it)."""
    rid = request.request_id or uuid.uuid4().hex
    keys: list[str] = []  # engine-side ids: clients may reuse theirs
    handles: list[api.RequestHandle] = []
    try:
      which = request.WhichOneof("prompt")
      if which is None:
        raise api.InvalidRequest("the request has no prompt: set text, token_ids or chat")
      if which == "text" and len(request.text) > MAX_PROMPT_CHARS:
        raise api.InvalidRequest(f"the prompt text has {len(request.text)} chars; at most "
                                 f"{MAX_PROMPT_CHARS}")
      messages = _chat_messages(request.chat) if which == "chat" else None
      n = request.sampling.n if request.sampling.HasField("n") else 1
      if not 1 <= n <= MAX_N:
        raise api.InvalidRequest(f"n={n} must be in [1, {MAX_N}]")
      sampling = sampling_from_proto(request.sampling)
      remaining = context.time_remaining()
      prompt_ids = list(request.token_ids.ids) if which == "token_ids" else None
      requests = []
      for i in range(n):
        keys.append(uuid.uuid4().hex)
        requests.append(api.Request(
            request_id=keys[-1],
            prompt_text=request.text if which == "text" else None,
            prompt_ids=prompt_ids, messages=messages,
            add_generation_prompt=_generation_prompt(request.chat),
            sampling=completion_params(sampling, i), priority=request.priority,
            deadline=None if remaining is None else time.monotonic() + remaining))
      # One admission decision for the call's n completions: all or none.
      handles = self.engine.submit_all(requests)
    except (api.InvalidRequest, api.QueueFull, api.Draining, api.EngineFailed) as e:
      for key in keys[:len(handles)]:
        self.engine.cancel(key)
      if isinstance(e, api.EngineFailed):
        context.abort(grpc.StatusCode.INTERNAL, str(e))
      self.metrics.rejected.inc()
      context.abort(grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, api.InvalidRequest) else
                    grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, api.QueueFull) else
                    grpc.StatusCode.UNAVAILABLE, str(e))
    except BaseException:  # an unexpected failure: none of the call's requests runs on
      for key in keys[:len(handles)]:
        self.engine.cancel(key)
      raise
    context.add_callback(lambda: self._release(keys, context))
    return rid, keys, Events(handles)

  def _release(self, keys, context) -> None:
    """Cancels a call's requests that still run once the call is over. At
    its deadline the engine ends them itself, so they count as DEADLINE, not
    CANCELLED: also where the call ends just before it (the client's own
    deadline cancels the call as it passes, which reaches this side early)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= _DEADLINE_SLACK_S:
      return
    for key in keys:
      self.engine.cancel(key)

  def _events(self, events: Events, context):
    """(completion index, event) until every completion's Final; Deltas of a
    completion that queued up meanwhile are merged into one."""
    gaps = self.metrics.token_gaps()
    finals = 0
    follow = None  # an event read while merging, handled next
    while True:
      if follow is not None:
        (i, ev), follow = follow, None
      else:
        try:
          i, ev = events.get(timeout=_POLL_S)
        except queue.Empty:
          if not context.is_active():
            return
          continue
      if isinstance(ev, api.Delta):
        # Fewer, larger messages when many streams compete for the interpreter.
        while True:
          try:
            nxt = events.get_nowait()
          except queue.Empty:
            break
          if nxt[0] != i or not isinstance(nxt[1], api.Delta):
            follow = nxt
            break
          d = nxt[1]
          ev = api.Delta(ev.token_ids + d.token_ids, ev.text + d.text, ev.logprobs + d.logprobs)
        gaps.arrived(i, len(ev.token_ids))
      # An ended deadline or cancel is the call's status, not a response:
      # abort before handing the Final on (Generate returns on the last Final).
      if isinstance(ev, api.Failed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT if ev.invalid else
                      grpc.StatusCode.INTERNAL, ev.message)
      if isinstance(ev, api.Final) and ev.reason == api.FinishReason.DEADLINE:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"deadline exceeded after {ev.completion_tokens} tokens")
      if isinstance(ev, api.Final) and ev.reason == api.FinishReason.CANCELLED:
        if self.stopping:
          context.abort(grpc.StatusCode.UNAVAILABLE, "the server shut down before the request "
                        f"finished ({ev.completion_tokens} tokens generated)")
        context.abort(grpc.StatusCode.CANCELLED, "the request was cancelled")
      yield i, ev
      if isinstance(ev, api.Final):
        finals += 1
        if finals == events.n:
          return

  def GenerateStream(self, request, context):
    with self.call_in_progress():
      yield from self._generate_stream(request, context)

  def _generate_stream(self, request, context):
    rid, keys, events = self._submit(request, context)
    try:
      for i, ev in self._events(events, context):
        if isinstance(ev, api.Delta):
          chunk = pb.GenerateStreamChunk(request_id=rid, index=i, token_ids=ev.token_ids,
                                         text=ev.text)
          _fill_logprobs(chunk.logprobs, ev.logprobs)
          yield chunk
        elif isinstance(ev, api.Final):
          usage, timings = _final_proto(ev)
          chunk = pb.GenerateStreamChunk(request_id=rid, index=i, final=pb.FinalInfo(
              finish_reason=int(ev.reason), usage=usage, timings=timings, **_stop_reason(ev)))
          _fill_logprobs(chunk.final.prompt_logprobs, ev.prompt_logprobs)
          yield chunk
    finally:
      events.close()
      self._release(keys, context)

  def Generate(self, request, context):
    with self.call_in_progress():
      return self._generate(request, context)

  def _generate(self, request, context):
    rid, keys, events = self._submit(request, context)
    finals: list[api.Final | None] = [None] * events.n
    ids, text, lps = ([[] for _ in range(events.n)] for _ in range(3))
    try:
      for i, ev in self._events(events, context):
        if isinstance(ev, api.Delta):
          ids[i] += ev.token_ids
          text[i].append(ev.text)
          lps[i] += ev.logprobs
        elif isinstance(ev, api.Final):
          finals[i] = ev
    finally:
      events.close()
      self._release(keys, context)
    if any(f is None for f in finals):
      context.abort(grpc.StatusCode.CANCELLED, "the request was cancelled")

    def fill(msg, i):  # a Completion, or the response's own fields (completion 0's)
      f = finals[i]
      usage, timings = _final_proto(f)
      msg.text, msg.finish_reason = "".join(text[i]), int(f.reason)
      msg.token_ids.extend(ids[i])
      msg.usage.CopyFrom(usage)
      msg.timings.CopyFrom(timings)
      for name, value in _stop_reason(f).items():
        setattr(msg, name, value)
      _fill_logprobs(msg.logprobs, lps[i])
      _fill_logprobs(msg.prompt_logprobs, f.prompt_logprobs)

    response = pb.GenerateResponse(request_id=rid)
    fill(response, 0)
    if events.n > 1:
      for i in range(events.n):
        fill(response.completions.add(index=i), i)
    return response

  def Tokenize(self, request, context):
    prompt = ""
    try:
      if request.HasField("chat"):
        for field, given in (("text", request.text), ("add_bos", request.add_bos)):
          if given:  # (else it would be dropped: a chat's tokens are its template's)
            raise api.InvalidRequest(f"{field} does not go with chat: give text or a chat")
        messages = _chat_messages(request.chat)
        prompt, ids = self.engine.render_chat(messages, _generation_prompt(request.chat))
      else:
        if len(request.text) > MAX_PROMPT_CHARS:
          raise api.InvalidRequest(f"the text has {len(request.text)} chars; at most "
                                   f"{MAX_PROMPT_CHARS}")
        ids = self.engine.tokenize(request.text, add_bos=request.add_bos)
      pieces = self.engine.token_pieces(ids)
    except api.InvalidRequest as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except api.EngineFailed as e:  # (an engine process that died: Generate's status)
      context.abort(grpc.StatusCode.INTERNAL, str(e))
    return pb.TokenizeResponse(token_ids=ids, pieces=pieces, prompt=prompt)

  def Detokenize(self, request, context):
    try:
      if len(request.token_ids) > MAX_PROMPT_CHARS:
        raise api.InvalidRequest(f"{len(request.token_ids)} token ids; at most "
                                 f"{MAX_PROMPT_CHARS}")
      text = self.engine.detokenize(list(request.token_ids))
    except api.InvalidRequest as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except api.EngineFailed as e:
      context.abort(grpc.StatusCode.INTERNAL, str(e))
    return pb.DetokenizeResponse(text=text)

  def ModelInfo(self, request, context):
    i = self.engine.info
    return pb.ModelInfoResponse(
        model_name=i.model_name, vocab_size=i.vocab_size, max_context=i.max_context,
        eos_token_id=i.eos_token_id, bos_token_id=i.bos_token_id, max_batch=i.max_batch,
        page_size=i.page_size, num_pages=i.num_pages, backends=i.backends, dtype=i.dtype,
        tensor_parallel_size=i.tensor_parallel_size)


class HealthServicer(health.HealthServicer):
  """grpc.health.v1 from grpcio-health-checking: "" is the server as a whole,
  ``SERVICE_NAME`` the generate service. A failed engine makes every status
  NOT_SERVING for good (found at the next Check, which Watch then sees), and
  ``List`` answers from the same statuses."""

  Status = health_pb2.HealthCheckResponse.ServingStatus

  def __init__(self, alive=lambda: True):
    super().__init__()
    self._alive = alive  # False once the engine has failed

  def Check(self, request, context):
    if not self._alive():
      self.enter_graceful_shutdown()
    return super().Check(request, context)

  def List(self, request, context):
    with self._lock:  # (grpcio-health-checking's lock and statuses)
      return health_pb2.HealthListResponse(statuses={
          k: health_pb2.HealthCheckResponse(status=v) for k, v in self._server_status.items()})


class _BearerAuth(grpc.ServerInterceptor):
  """Requires ``authorization: Bearer <token>``; health checks are exempt."""

  def __init__(self, token: str):
    self._expected = f"Bearer {token}"

  def intercept_service(self, continuation, details):
    handler = continuation(details)
    if details.method.startswith("/grpc.health.v1.Health/") or handler is None:
      return handler
    md = dict(details.invocation_metadata or ())
    if md.get("authorization") == self._expected:
      return handler

    def deny(request, context):
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    if handler.response_streaming:
      def deny_stream(request, context):
        deny(request, context)
        yield  # pragma: no cover
      make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
              else grpc.unary_stream_rpc_method_handler)
      return make(deny_stream, handler.request_deserializer, handler.response_serializer)
    make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
            else grpc.unary_unary_rpc_method_handler)
    return make(deny, handler.request_deserializer, handler.response_serializer)


class _Undecodable:
  """What the deserializer hands on for bytes that are no valid message."""

  def __init__(self, error: Exception):
    self.error = error


def _safe_deserializer(deserialize):
  if deserialize is None:
    return None

  def safe(data: bytes):
    try:
      return deserialize(data)
    except Exception as e:  # noqa: BLE001 - corrupt wire bytes, bad UTF-8 in a string field
      return _Undecodable(e)

  return safe


class _DecodeErrors(grpc.ServerInterceptor):
  """A request whose bytes do not decode (corrupt protobuf, invalid UTF-8 in
  a string field) is INVALID_ARGUMENT with one log line, where grpc would
  answer INTERNAL and log a traceback for each (a flood any client can cause)."""

  def intercept_service(self, continuation, details):
    handler = continuation(details)
    if handler is None:
      return None
    method = details.method

    def refuse(bad: _Undecodable, context):
      reason = str(bad.error).strip().splitlines()[0] if str(bad.error).strip() else repr(
          bad.error)
      log.warning("%s: an undecodable request from %s: %s", method, context.peer(), reason)
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not decode: {reason}")

    if handler.request_streaming:
      inner = handler.stream_stream or handler.stream_unary

      def behavior(requests, context):
        def checked():
          for r in requests:
            if isinstance(r, _Undecodable):
              refuse(r, context)
            yield r
        return inner(checked(), context)
    else:
      inner = handler.unary_unary or handler.unary_stream

      def behavior(request, context):
        if isinstance(request, _Undecodable):
          refuse(request, context)
        return inner(request, context)

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[
                (handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=_safe_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer)


class Server:
  """The engine behind gRPC; ``start`` returns once both are ready."""

  def __init__(self, engine: api.Engine, *, host: str = "127.0.0.1", port: int = 0,
               auth_token: str | None = None, tls: tuple[bytes, bytes] | None = None,
               metrics_port: int | None = None, max_workers: int | None = None,
               http_port: int | None = None):
    for name, p in (("port", port), ("metrics_port", metrics_port), ("http_port", http_port)):
      if p is not None and not 0 <= p <= 65535:  # (gRPC would bind port % 65536)
        raise ValueError(f"{name}={p} must be in 0..65535 (0 picks a free port)")
    self.engine = engine
    self.host, self.port = host, port
    self.metrics = Metrics(engine)
    if hasattr(engine, "observer"):
      engine.observer = self.metrics
    info = engine.info
    waiting = getattr(getattr(engine, "config", None), "max_waiting", 256)
    workers = max_workers or info.max_batch + waiting + 16
    self._grpc_workers = workers
    self._grpc = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        # (decoding innermost: every handler, the refusals of auth too, decodes safely)
        interceptors=([_BearerAuth(auth_token)] if auth_token else []) + [_DecodeErrors()],
        maximum_concurrent_rpcs=workers - 4,
        options=[("grpc.so_reuseport", 0)])
    self.servicer = TextGenerationServicer(engine, self.metrics)
    pb_grpc.add_TextGenerationServicer_to_server(self.servicer, self._grpc)
    self.health = HealthServicer(lambda: getattr(engine, "error", None) is None)
    health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
    addr = f"{host}:{port}"
    try:
      if tls:
        creds = grpc.ssl_server_credentials([(tls[1], tls[0])])  # (key, cert)
        self.port = self._grpc.add_secure_port(addr, creds)
      else:
        self.port = self._grpc.add_insecure_port(addr)
    except RuntimeError as e:  # (grpcio raises "Failed to bind ..."; it once returned 0)
      raise OSError(f"cannot serve gRPC on {addr}: {e} (is the port taken?)") from None
    if not self.port:
      raise OSError(f"cannot serve gRPC on {addr} (is the port taken?)")
    self.metrics_http = self.openai_http = None  # bound here, served by start()
    try:
      if metrics_port is not None:
        what = f"metrics on {host}:{metrics_port}"
        self.metrics_http = metrics_http(self.metrics, host, metrics_port)
      if http_port is not None:
        what = f"OpenAI HTTP on {host}:{http_port}"
        self.openai_http = openai_http(engine, self.servicer, host, http_port, auth_token, tls)
    except OSError as e:  # a port taken (gRPC's among them): nothing stays bound
      # A gRPC server that never started keeps its port until the process
      # ends; started and stopped, it lets go.
      self._grpc.start()
      self._grpc.stop(0).wait()
      self._close_http()
      raise OSError(f"cannot serve {what}: {e.strerror or e}") from e
    self._http_serving = False  # (shutdown waits for a serve_forever that ran)
    self._stopped = threading.Event()
    self._drain_lock = threading.Lock()

  @property
  def address(self) -> str:
    return f"{self.host}:{self.port}"

  def start(self) -> "Server":
    for s in ("", SERVICE_NAME):
      self.health.set(s, HealthServicer.Status.NOT_SERVING)
    self._grpc.start()
    self.engine.start()  # warm-up compiles here: health says NOT_SERVING meanwhile
    for name, srv in (("metrics", self.metrics_http), ("openai-http", self.openai_http)):
      if srv is not None:
        threading.Thread(target=srv.serve_forever, name=name, daemon=True).start()
    self._http_serving = True
    for s in ("", SERVICE_NAME):
      self.health.set(s, HealthServicer.Status.SERVING)
    log.info("serving %s on %s", self.engine.info.model_name, self.address)
    return self

  def drain_and_stop(self, timeout: float = 30.0) -> None:
    """Health NOT_SERVING, no new requests, running ones finish, then stop.
    Requests still running at ``timeout`` are cancelled then (their calls end
    UNAVAILABLE; an HTTP stream with an error event and [DONE]), and the
    server stops within _DRAIN_SLACK_S and a step more."""
    with self._drain_lock:
      if self._stopped.is_set():
        return
      self.health.enter_graceful_shutdown()  # every status NOT_SERVING, for good
      end = time.monotonic() + timeout
      try:
        finished = self.engine.drain(timeout)
      except api.EngineFailed as e:  # (an engine process that died: nothing left to drain)
        log.warning("drain: %s; stopping", e)
        finished = True
      if not finished:
        log.warning("drain timed out after %g s; cancelling the requests still running",
                    timeout)
        self.servicer.stopping = True
        self.engine.stop()  # cancels every request within a step
      # The engine is done with every request; their calls may still be
      # sending the last events (a stream's end).
      if not self.servicer.wait_idle(max(end - time.monotonic(), 0.0) + _DRAIN_SLACK_S):
        log.warning("calls still sending after the drain; stopping")
      self.stop(grace=_DRAIN_SLACK_S)

  def stop(self, grace: float | None = 1.0) -> None:
    self.health.enter_graceful_shutdown()
    self.servicer.stopping = True
    self.engine.stop()
    self._grpc.stop(grace).wait()
    if self._http_serving:
      for srv in (self.metrics_http, self.openai_http):
        if srv is not None:
          srv.shutdown()
    self._close_http()
    self._stopped.set()

  def _close_http(self) -> None:
    for srv in (self.metrics_http, self.openai_http):
      if srv is not None:
        srv.server_close()

  def wait(self) -> None:
    # The kernel may hand SIGTERM to any thread, and Python runs its handler
    # (the drain) only when the main thread is back in the interpreter: an
    # untimed wait here could sleep through it, so wake up now and then.
    while not self._stopped.wait(timeout=0.05):
      pass

  def handle_signals(self, drain_timeout: float = 30.0) -> None:
    """SIGTERM / SIGINT start a drain in a background thread (main thread only)."""
    def on_signal(signum, frame):
      del frame
      log.info("signal %d: draining", signum)
      threading.Thread(target=self.drain_and_stop, args=(drain_timeout,), daemon=True).start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
