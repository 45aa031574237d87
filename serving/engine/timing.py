"""What each engine iteration cost: its ``StepRecord`` (wall, device wait,
launch and token-handling time, what it dispatched) and the backend compiles
it paid for (``Compiles``), which a full warm-up leaves at zero."""

from __future__ import annotations

import threading
from typing import NamedTuple


class StepRecord(NamedTuple):
  """One engine iteration's timings (``BatchingEngine.step_times``). Host time
  is ``wall - wait``; ``launch`` and ``tokens`` are parts of it."""

  wall: float  # s, the iteration
  wait: float  # s blocked on the device's results
  decodes: int  # decode rows dispatched
  launched: bool  # pipelined: the device had this step queued while the host worked
  launch: float  # s building the inputs and dispatching the device calls
  tokens: float  # s on the tokens read back: accepting them, their text and events
  prefill_tokens: int = 0  # prompt tokens dispatched
  steps: int = 0  # decode steps in the decode call (0: none)
  start: float = 0.0  # time.perf_counter() at the iteration's start (this process's clock)
  compiles: int = 0  # backend compiles during the iteration (none after a full warm-up)


class Compiles:
  """Backend compiles per thread, heard through jax.monitoring (a listener
  runs in the thread that compiles): any compile in an engine's loop, so
  after its warm-up, shows in ``counters()`` and in the iteration that paid
  for it, whether of a model step, sampling or the engine's own jnp calls (a
  load from the persistent compilation cache counts too). Other threads of
  the process (a benchmark's reference, another engine) do not count."""

  _lock = threading.Lock()
  _by_thread: dict[int, list] = {}  # thread ident -> [compiles, seconds]
  _listening = False

  @classmethod
  def listen(cls) -> None:
    import jax  # here: a StepRecord unpickled in a server's process must not import jax

    with cls._lock:
      if not cls._listening:
        jax.monitoring.register_event_duration_secs_listener(cls._heard)
        cls._listening = True

  @classmethod
  def _heard(cls, event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      with cls._lock:
        c = cls._by_thread.setdefault(threading.get_ident(), [0, 0.0])
        c[0] += 1
        c[1] += seconds

  @classmethod
  def of(cls, ident: int | None) -> tuple[int, float]:
    with cls._lock:
      n, secs = cls._by_thread.get(ident, (0, 0.0))
    return n, secs

  @classmethod
  def reset(cls, ident: int) -> None:  # a thread's ident may be a dead thread's
    with cls._lock:
      cls._by_thread.pop(ident, None)
