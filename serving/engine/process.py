"""The engine in a process of its own, behind the same ``api.Engine`` interface.

Behind gRPC each streaming call has a thread in the server's process, woken
for every message it sends. In one process those threads share the
interpreter with the engine's scheduler thread, which then waits for the GIL
each time it lets go of it (every device dispatch): at 64 streams its steps
took 5-10 times their own cost (bench/results/serving_contention_cpu/).
``ProcessEngine`` runs the engine in a spawned child process instead:

  server process                              engine process
  ProcessEngine.submit/cancel/stats/... --->  command loop -> BatchingEngine
  reader thread: events -> handles      <---  forwarder thread: every request's
                 step timings -> observer       events and each step's timings

Calls are request/reply over one pipe each way (replies matched by call id;
the engine's exceptions, e.g. QueueFull, are raised in the caller). Events
travel in batches: the engine thread pickles what a step produced, its events
and its timings, once at the step's end (``_Outbox``), and the forwarder thread
only writes the bytes. A forwarder that pickled each event as it came woke at
the step's first event and then held the interpreter while the engine thread
flushed the rest and launched the next step.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

from serving.engine import api

log = logging.getLogger("serving.engine")

# The forwarder's idle tick: events added outside a step (a failure, a stop)
# leave the engine process within two of them.
_IDLE_FLUSH_S = 0.01


class _Outbox:
  """The engine process's outgoing events and step records. The engine
  thread adds them as they come and, at the end of each step, pickles them
  into one message for the forwarder. Anything added outside a step (a
  failure, a stop) goes out on one of the forwarder's idle ticks."""

  def __init__(self):
    self._items: list = []
    self._flushes = 0
    self._lock = threading.Lock()
    self.ready: queue.SimpleQueue = queue.SimpleQueue()  # pickled ("batch", items); None: stop

  def add(self, item) -> None:
    with self._lock:
      self._items.append(item)

  def flush(self) -> None:
    with self._lock:  # held while queueing: batches leave in the order they were made
      if self._items:
        self.ready.put(bytes(reduction.ForkingPickler.dumps(("batch", self._items))))
        self._items = []
        self._flushes += 1

  def flush_stale(self, last):
    """An idle tick: flushes items that were waiting at the previous tick too
    (``last``: what that call returned), so never those of a step in progress."""
    with self._lock:
      now = self._flushes if self._items else None
    if now is not None and now == last:
      self.flush()
      return None
    return now


class _Forward:
  """A request's events queue in the engine process: tags and hands them on."""

  def __init__(self, request_id: str, outbox: _Outbox):
    self.request_id, self.outbox = request_id, outbox

  def put(self, event) -> None:
    self.outbox.add(("event", self.request_id, event))


class _StepObserver:
  """The engine's observer in the engine process. It records no metrics
  series: each step's record goes to the server's process, whose
  ``serving.metrics.Metrics`` (the ``ProcessEngine``'s observer) records it,
  as it does the requests' Final and Failed events."""

  def __init__(self, outbox: _Outbox):
    self.outbox = outbox

  def on_step(self, engine, record) -> None:
    del engine
    # Pickling the step's events is host time of this step, spent after the
    # engine timed it: added to its wall and token times here.
    t = time.perf_counter()
    self.outbox.flush()
    t = time.perf_counter() - t
    self.outbox.add(("step", record._replace(wall=record.wall + t, tokens=record.tokens + t)))
    self.outbox.flush()

  def on_final(self, final) -> None:  # the server process hears it from the Final event
    del final

  def on_failed(self, failed) -> None:  # (and from the Failed event)
    del failed


def _log_config() -> tuple[int, str | None, dict[str, int]]:
  """The server process's logging (root level, its first handler's format,
  levels set on named loggers), for the engine process to log as it does: a
  spawned child starts with logging unconfigured, and would drop the engine's
  INFO lines (KV cache size, warm-up times)."""
  root = logging.getLogger()
  fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
  named = {name: lg.level for name, lg in logging.Logger.manager.loggerDict.items()
           if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET}
  return root.level, fmt, named


def _serve(factory: Callable[..., Any], args: tuple, kwargs: dict, commands, results,
           log_config=None) -> None:
  """The engine process: builds the engine, then answers calls until 'stop'."""
  if log_config is not None:
    level, fmt, named = log_config
    logging.basicConfig(level=level, format=fmt)
    for name, lvl in named.items():
      logging.getLogger(name).setLevel(lvl)
  # The server process decides when to stop (SIGTERM drains there); a ^C to
  # the process group must not kill the engine under it.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  send_lock = threading.Lock()

  def send(msg) -> None:
    with send_lock:
      results.send(msg)

  try:
    engine = factory(*args, **kwargs)
    outbox = _Outbox()
    engine.make_events = lambda request_id: _Forward(request_id, outbox)
    engine.observer = _StepObserver(outbox)
  except BaseException as e:  # noqa: BLE001 - the server process reports it
    results.send(("failed", repr(e)))
    return
  config = getattr(engine, "config", None)
  send(("built", engine.info, getattr(config, "max_waiting", 256)))

  def forward() -> None:
    tick = None
    while True:
      try:
        data = outbox.ready.get(timeout=_IDLE_FLUSH_S)
      except queue.Empty:
        tick = outbox.flush_stale(tick)
        continue
      if data is None:
        return
      with send_lock:
        results.send_bytes(data)

  forwarder = threading.Thread(target=forward, name="engine-forward", daemon=True)
  forwarder.start()

  def run(call_id, name, a, kw):
    try:
      if name == "error":
        value = None if engine.error is None else repr(engine.error)
      else:
        value = getattr(engine, name)(*a, **kw)
        if name == "submit":  # the handle's queue stays here; the server builds its own
          value = (value.prompt_tokens, value.submitted)
        elif name == "submit_all":
          value = [(h.prompt_tokens, h.submitted) for h in value]
      return ("reply", call_id, True, value)
    except Exception as e:  # noqa: BLE001 - raised again in the caller
      try:
        pickle.dumps(e)
      except Exception:  # noqa: BLE001
        e = api.EngineFailed(repr(e))
      return ("reply", call_id, False, e)

  # Calls run on a pool: a drain that waits must not hold up health checks.
  pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="engine-call")
  while True:
    try:
      call_id, name, a, kw = commands.recv()
    except (EOFError, OSError):  # the server process is gone
      call_id, name, a, kw = None, "stop", (), {}
    if name == "stop":
      reply = run(call_id, name, a, kw)
      outbox.flush()
      outbox.ready.put(None)
      forwarder.join(timeout=10)
      if call_id is not None:
        send(reply)
      return
    pool.submit(lambda *c: send(run(*c)), call_id, name, a, kw)


class ProcessEngine(api.Engine):
  """``factory(*args, **kwargs)`` (picklable: a module-level function) builds
  the engine in a spawned process, here and now (its ``info`` is known on
  return); ``start`` warms it up there. This object stands for it in the
  server."""

  def __init__(self, factory: Callable[..., Any], *args, build_timeout: float = 600.0,
               **kwargs):
    self.observer = None
    self.step_times: list = []
    self._ids = itertools.count()
    self._handles: dict[str, api.RequestHandle] = {}
    self._replies: dict[int, list] = {}
    self._lock = threading.Lock()
    self._send_lock = threading.Lock()
    self._gone = False  # the engine process exited: calls fail at once
    self._why = "the engine process exited"
    self._stopping = False  # (its exit is then no news)
    self._closed = False  # stopped: the process object released (its descriptors closed)
    self.exitcode: int | None = None  # the engine process's, once it has exited
    ctx = multiprocessing.get_context("spawn")  # a forked child would share the CUDA context
    cmd_recv, self._cmd = ctx.Pipe(duplex=False)
    self._res, res_send = ctx.Pipe(duplex=False)
    self._proc = ctx.Process(target=_serve, name="engine",
                             args=(factory, args, kwargs, cmd_recv, res_send, _log_config()),
                             daemon=True)
    self._proc.start()
    cmd_recv.close()
    res_send.close()
    if not self._res.poll(build_timeout):
      self._proc.kill()
      raise api.EngineFailed(f"the engine process built no engine in {build_timeout} s")
    try:
      msg = self._res.recv()
    except EOFError:
      self._proc.join(timeout=10)
      msg = ("failed", f"it exited with code {self._proc.exitcode}")
    if msg[0] != "built":
      self._proc.join(timeout=10)
      raise api.EngineFailed(f"the engine process failed to build the engine: {msg[1]}")
    _, self.info, max_waiting = msg
    self.config = _Config(max_waiting)
    self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
    self._reader.start()

  def start(self) -> None:
    self._call("start")

  def _read(self) -> None:
    try:
      while True:
        msg = self._res.recv()
        if msg[0] == "reply":
          _, call_id, ok, value = msg
          with self._lock:
            slot = self._replies.get(call_id)
          if slot is not None:
            slot.append((ok, value))
            slot[0].set()
        else:
          self._dispatch(msg[1])
    except (EOFError, OSError):  # the engine process exited
      self._engine_gone()
    except Exception:  # noqa: BLE001 - a message this side cannot take: stop trusting the pipe
      self._proc.kill()
      self._engine_gone()
    finally:
      self._res.close()

  def _dispatch(self, batch) -> None:
    for item in batch:
      if item[0] == "event":
        _, rid, event = item
        with self._lock:
          handle = self._handles.get(rid)
          if isinstance(event, (api.Final, api.Failed)):
            self._handles.pop(rid, None)
        if isinstance(event, api.Final) and self.observer is not None:
          self.observer.on_final(event)  # what the engine's observer hears in-process
        if isinstance(event, api.Failed) and handle is not None:
          self._on_failed(event)
        if handle is not None:
          handle.events.put(event)
      elif item[0] == "step":
        _, record = item
        self.step_times.append(record)
        if self.observer is not None:
          self.observer.on_step(self, record)

  def _exit_status(self) -> str:
    """How the engine process ended ("killed by SIGKILL", "code 3"), once reaped."""
    self._proc.join(timeout=2.0)
    code = self._proc.exitcode
    if code is None:
      return "the engine process exited"
    if code < 0:
      try:
        return f"the engine process exited (killed by {signal.Signals(-code).name})"
      except ValueError:
        pass
    return f"the engine process exited (code {code})"

  def _engine_gone(self) -> None:
    why = self._exit_status()
    with self._lock:
      self._gone, self._why = True, why
      handles, self._handles = list(self._handles.values()), {}
      waiting = list(self._replies.values())
    if not self._stopping:
      log.error("%s; failing its %d requests", why, len(handles))
    for h in handles:
      failed = api.Failed(why)
      h.events.put(failed)
      self._on_failed(failed)
    for slot in waiting:
      slot.append((False, api.EngineFailed(why)))
      slot[0].set()

  def _on_failed(self, failed: api.Failed) -> None:
    on_failed = getattr(self.observer, "on_failed", None)
    if on_failed is not None:
      on_failed(failed)

  def _call(self, name: str, *args, **kwargs):
    call_id = next(self._ids)
    slot = [threading.Event()]
    with self._lock:
      if self._gone:
        raise api.EngineFailed(self._why)
      self._replies[call_id] = slot
    try:
      with self._send_lock:
        self._cmd.send((call_id, name, args, kwargs))
      slot[0].wait()
    except (BrokenPipeError, OSError) as e:
      raise api.EngineFailed(f"the engine process is gone: {e!r}") from None
    finally:
      with self._lock:
        self._replies.pop(call_id, None)
    ok, value = slot[1]
    if not ok:
      raise value
    return value

  # -- api.Engine

  def submit(self, request: api.Request) -> api.RequestHandle:
    return self.submit_all([request])[0]

  def submit_all(self, requests: Sequence[api.Request]) -> list[api.RequestHandle]:
    """The engine's one admission decision for the call's requests."""
    rids = [r.request_id for r in requests]
    with self._lock:
      if len(set(rids)) < len(rids):
        raise api.InvalidRequest("a call names a request_id twice")
      for rid in rids:
        if rid in self._handles:
          raise api.InvalidRequest(f"request_id {rid!r} is already running")
      # Registered before the call: their first events may arrive before the reply.
      handles = [api.RequestHandle(rid, 0, queue.SimpleQueue()) for rid in rids]
      self._handles.update(zip(rids, handles))
    try:
      made = self._call("submit_all", list(requests))
    except BaseException:
      with self._lock:
        for rid, handle in zip(rids, handles):
          if self._handles.get(rid) is handle:
            del self._handles[rid]
      raise
    for handle, (prompt_tokens, submitted) in zip(handles, made):
      handle.prompt_tokens, handle.submitted = prompt_tokens, submitted
    return handles

  def cancel(self, request_id: str) -> None:
    try:
      self._call("cancel", request_id)
    except api.EngineFailed:  # the engine process is gone: so is the request
      pass

  def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
    return self._call("tokenize", text, add_bos)

  def render_chat(self, messages, add_generation_prompt: bool = True):
    return self._call("render_chat", list(messages), add_generation_prompt)

  def token_pieces(self, ids: Sequence[int]) -> list[str]:
    return self._call("token_pieces", list(ids))

  def token_bytes(self, ids: Sequence[int]) -> list[list[int]]:
    return self._call("token_bytes", list(ids))

  def detokenize(self, ids: Sequence[int]) -> str:
    return self._call("detokenize", list(ids))

  def stats(self) -> api.EngineStats:
    return self._call("stats")

  def drain(self, timeout: float | None = None) -> bool:
    return self._call("drain", timeout)

  def counters(self) -> dict:
    return self._call("counters")

  def start_profile(self, log_dir: str) -> None:
    self._call("start_profile", log_dir)  # a trace of the engine's process

  def stop_profile(self) -> None:
    self._call("stop_profile")

  @property
  def error(self):
    if self._closed or not self._proc.is_alive():
      return self._why
    try:
      return self._call("error")
    except api.EngineFailed as e:
      return repr(e)

  def stop(self) -> None:
    if self._closed:
      return
    self._stopping = True
    if self._proc.is_alive():
      try:
        self._call("stop")
      except api.EngineFailed:
        pass
      self._proc.join(timeout=30)
      if self._proc.is_alive():
        self._proc.kill()
    self._proc.join(timeout=5)
    self._reader.join(timeout=5)  # it closes its end of the pipe as it leaves
    self._cmd.close()
    if not self._proc.is_alive() and not self._reader.is_alive():
      self.exitcode = self._proc.exitcode
      self._closed = True
      self._proc.close()  # (its sentinel descriptor)


class _Config:
  """What the server reads of the engine's config (it sizes its thread pool by it)."""

  def __init__(self, max_waiting: int):
    self.max_waiting = max_waiting
