"""The batching engine: one scheduler thread, one model step per iteration.

Each iteration (``step``):
1. takes new submissions and cancellations from the other threads; ends the
   requests that were cancelled or ran past their deadline (pages freed now);
2. gives every decoding request room for one more token, preempting the most
   recently admitted request (the least urgent one, under priority
   scheduling) when the allocator runs dry: its pages are freed, its tokens
   recomputed later;
3. spends the rest of the step's token budget on prefill chunks: first the
   requests already part-way through their prompt, then new ones admitted in
   arrival order (by priority, then arrival, with ``EngineConfig.scheduling =
   "priority"``) while their whole prompt fits in free pages and a batch slot
   is free; page-aligned prompt blocks seen before come from the prefix cache,
   and a prompt whose next block another request is computing waits for it;
4. dispatches the prefill chunk batch and the decode batch (shapes padded to
   the configured buckets, all compiled by ``warmup`` at start) and samples
   on the device; the decode inputs are the last token of each batch slot,
   kept on the device, so this step is queued before the host has read the
   previous step's tokens;
5. then reads the previous step's tokens and hands each request its tokens,
   text and final event while the device runs this step.

With ``EngineConfig.mixed_steps``, step 4's two calls are one when both have
work: the chunk's tokens join the decode batch's pass over the weights.

With ``EngineConfig.prefill_first``, step 4 dispatches no decodes while it
has prefill chunks: decoding requests keep their pages and wait.

A prefill batch goes to the device as one row of its chunks' tokens (segment
ids keep each chunk's attention to its own sequence) wherever the runner can
(``EngineConfig.packed_prefill``), else as one padded row each; a mixed
step's chunks too.

With ``EngineConfig.decode_steps`` = n > 1, an iteration with no prompt
waiting runs n decode steps in one device call (sampling on the device, each
step's token fed to the next), so the host dispatches and reads once per n
tokens; tokens computed past a request's end are dropped when read. Once no
request has more than n // 2 tokens left, it goes back to one step a call.

A request with structured outputs (``SamplingParams.structured``) decodes one
step a call, and the step after one of its tokens reads that token back
before dispatching: its grammar's allowed set for the next token goes into
its slot's allow bitmask first. It ends (STOP) when the grammar is complete.

With ``EngineConfig.prompt_logprobs``, a request that asks for its prompt's
logprobs has each of its prompt chunks dispatched in step 4 as a call of its
own that keeps every position's logits and scores the next prompt token; the
scores stay on the device until the request's final event carries them.

With ``EngineConfig.num_speculative_tokens`` = k > 0 (n-gram speculation),
an iteration of a few decoding requests first reads the previous step's
tokens, drafts up to k tokens per request from an earlier occurrence of its
last few tokens, and checks the drafts in one call over [last token, drafts]
(sampling.verify): each request keeps the drafts equal to what it would
have decoded there (greedy: its argmax; sampled: its draw with that step's
key) plus one token of the model's own. A structured request drafts only
what its grammar admits, and each position is checked under the grammar's
allowed set after the drafts before it.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import random
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import api, sampling
from serving.engine import warmup as warmup_lib
from serving.engine.config import SCHEDULING, EngineConfig, auto_compile_threads  # noqa: F401
from serving.engine.guided import Guided
from serving.engine.kv_cache import KVCacheManager
from serving.engine.outputs import Outputs
from serving.engine.scheduler import Scheduler, bucket, pow2_buckets
from serving.engine.sequence import Seq, State
from serving.engine.speculation import Speculator, ngram_draft  # noqa: F401

# The names benchmarks import from here.
_bucket, _pow2_buckets = bucket, pow2_buckets

log = logging.getLogger("serving.engine")


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


class _Compiles:
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


class BatchingEngine(api.Engine):

  def __init__(self, runner, config: EngineConfig = EngineConfig()):
    self.runner = runner
    self.config = config
    self.tok = runner.tokenizer
    self.page_size = runner.page_size
    self.max_seq_len = min(config.max_seq_len or runner.max_context, runner.max_context)
    self.max_pages = -(-self.max_seq_len // self.page_size)
    self.kv = KVCacheManager(runner.num_pages, runner.page_size, slots=config.max_batch,
                             max_pages=self.max_pages, prefix_caching=config.prefix_caching)
    self.alloc = self.kv.alloc
    # The whole cache may hold fewer tokens than the context: a request stops there.
    self.capacity = min(self.max_seq_len, self.alloc.usable * self.page_size)
    self.scheduler = Scheduler(config, self.kv, capacity=self.capacity,
                               on_admit=self._init_slot)
    s = self.scheduler
    self.batch_buckets, self.chunk_buckets, self.row_buckets = (
        s.batch_buckets, s.chunk_buckets, s.row_buckets)
    self.table_buckets, self.packed_buckets = s.table_buckets, s.packed_buckets
    for flag, on in (("prompt_logprobs", config.prompt_logprobs),
                     ("num_speculative_tokens", config.num_speculative_tokens)):
      if on and not getattr(runner, "supports_prompt_logprobs", False):
        raise ValueError(f"{flag}: runner {runner.name} does not keep every position's logits")
    self.packed = False
    if config.packed_prefill is not False:
      why = getattr(runner, "packed_why_not", f"runner {runner.name} has no packed prefill")
      if config.packed_prefill and why is not None:
        raise ValueError(f"packed_prefill: {why}")
      self.packed = why is None
    self.scheduler.packed = self.packed
    eos = tuple(getattr(self.tok, "eos_ids", ()) or ())
    bos = getattr(self.tok, "bos_id", None)
    self.eos_ids = frozenset(eos)
    self.info = api.EngineInfo(
        model_name=runner.name, vocab_size=runner.vocab_size, max_context=self.max_seq_len,
        eos_token_id=eos[0] if eos else -1, bos_token_id=-1 if bos is None else bos,
        max_batch=config.max_batch, page_size=self.page_size, num_pages=runner.num_pages,
        dtype=runner.dtype, backends=dict(runner.backends),
        tensor_parallel_size=getattr(runner, "tensor_parallel_size", 1))
    v = runner.vocab_size
    # Sampling state per slot, where the runner's steps put their outputs (on
    # every device of a tensor-parallel mesh), so that the warm-up's calls see
    # the inputs that steady state's will.
    place = functools.partial(jax.device_put, device=getattr(runner, "state_sharding", None))
    self._counts = place(jnp.zeros((config.max_batch, v), jnp.int32))
    self._slot_tokens = place(sampling.slot_tokens(config.max_batch, v))
    self._last_tok = place(jnp.zeros((config.max_batch,), jnp.int32))
    # Per batch slot, set at admission, so that building a step's inputs is
    # a gather rather than a loop over requests.
    self._slot_biased = np.zeros((config.max_batch,), bool)  # its bias or allow row is set
    self._slot_f = np.zeros((config.max_batch, sampling.F_COLS), np.float32)
    self._slot_i = np.zeros((config.max_batch, sampling.I_COLS), np.int64)
    self.guided = Guided(self)  # structured outputs' grammar state
    self._grammars = self.guided.grammars
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._inbox: list[Seq] = []
    self._cancels: list[str] = []
    self._by_id: dict[str, Seq] = {}
    self.outputs = Outputs(self)  # tokens read back, on their way to the clients
    self._inflight: list = []  # the dispatched step whose tokens are not read yet
    self._order = 0
    # Where a request's events go: anything with put(); serving.engine.process
    # forwards them to another process.
    self.make_events = lambda request_id: queue.SimpleQueue()
    self.mixed = config.mixed_steps and getattr(runner, "supports_mixed", False)
    self.mixed_steps_run = 0
    self.speculator = Speculator(self)
    # Chunk shapes a mixed step can carry (at most decode_prefill_budget tokens).
    cap = min(config.decode_prefill_budget or config.prefill_chunk, config.prefill_chunk)
    self._mixed_chunks = tuple(t for t in self.chunk_buckets
                               if t <= bucket(cap, self.chunk_buckets))
    # A packed mixed step carries the prompt tokens the step's budget leaves.
    self._mixed_packed = self.mixed and self.packed and (
        hasattr(runner, "mixed_packed_slots") or hasattr(runner, "mixed_packed"))
    cap = min(config.decode_prefill_budget or config.budget, self.packed_buckets[-1])
    self._mixed_packed_ns = tuple(n for n in self.packed_buckets
                                  if n <= bucket(cap, self.packed_buckets))
    if config.mixed_steps and not self.mixed:
      log.warning("mixed_steps: runner %s has no mixed step; prefill and decode run apart",
                  runner.name)
    self._draining = False
    self._stopping = False
    self._thread: threading.Thread | None = None
    self.steps = 0
    self.error: BaseException | None = None
    # The last iterations' timings and what they dispatched.
    self.step_times: collections.deque[StepRecord] = collections.deque(maxlen=4096)
    self.observer = None  # optional metrics sink: .on_step(engine, record), .on_final(final)
    _Compiles.listen()

  @property
  def jump_forward_tokens(self) -> int:  # tokens structured outputs took without sampling
    return self.guided.jump_forward_tokens

  @property
  def spec_draft_tokens(self) -> int:  # speculative tokens drafted
    return self.speculator.draft_tokens

  @property
  def spec_accepted_tokens(self) -> int:  # drafts the model agreed with
    return self.speculator.accepted_tokens

  @property
  def preemptions(self) -> int:
    return self.scheduler.preemptions

  @preemptions.setter
  def preemptions(self, n: int) -> None:
    self.scheduler.preemptions = n

  def _init_slot(self, seq: Seq) -> None:
    """The sampling state of an admitted request's batch slot."""
    self._slot_f[seq.slot], self._slot_i[seq.slot] = sampling.param_rows(
        seq.params, seq.seed, seq.slot)
    # A sampled row reads its slot's bias whatever its own parameters (the
    # other state is inert at its defaults): a slot a biased request left must
    # be reset.
    if seq.params.slot_state or self._slot_biased[seq.slot]:
      self._slot_biased[seq.slot] = seq.params.biased
      v = self.runner.vocab_size
      counts = np.bincount(np.asarray(seq.generated, np.int64), minlength=v)[:v].astype(np.int32)
      row = sampling.slot_row(v, seq.prompt, seq.ends, seq.params.logit_bias,
                              seq.params.allowed_token_ids,
                              None if seq.guide is None else seq.guide.words())
      self._counts, self._slot_tokens = sampling.set_rows(
          self._counts, self._slot_tokens, np.int32(seq.slot), counts, row)

  # -- the interface -------------------------------------------------------

  def start(self) -> None:
    if self._thread is not None:
      return
    if self.config.warmup:
      self.warmup()
    self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
    self._thread.start()

  def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
    try:
      ids = list(self.tok.encode(text))
    except ValueError as e:  # a model loaded without a tokenizer: token ids only
      raise api.InvalidRequest(str(e)) from None
    bos = getattr(self.tok, "bos_id", None)
    return [bos] + ids if add_bos and bos is not None else ids

  def token_pieces(self, ids: Sequence[int]) -> list[str]:
    return [self.tok.decode([i]) for i in ids]

  def detokenize(self, ids: Sequence[int]) -> str:
    self._check_vocab("token ids", ids)
    return self.tok.decode(list(ids))

  def _check_vocab(self, what: str, ids) -> None:
    """InvalidRequest naming the first ids outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
    if bad:
      raise api.InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary "
                               f"[0, {self.runner.vocab_size})")

  def submit(self, request: api.Request) -> api.RequestHandle:
    return self.submit_all([request])[0]

  def submit_all(self, requests: Sequence[api.Request]) -> list[api.RequestHandle]:
    """One admission decision for a call's requests (its n completions): all
    are queued or none. The engine holds at most max_batch + max_waiting
    requests, running or waiting; a call that would take it past that is
    QueueFull (retry later), one larger than that can never be admitted
    (InvalidRequest, naming the limits)."""
    if self._draining or self._stopping:
      raise api.Draining("the server is shutting down and admits no new requests")
    if self.error is not None:
      raise api.EngineFailed(f"the engine stopped after an error: {self.error!r}")
    c, n = self.config, len(requests)
    most = c.max_batch + c.max_waiting
    if n > most:
      raise api.InvalidRequest(
          f"a call of {n} completions can never be admitted: the server holds at most {most} "
          f"requests at once ({c.max_batch} running, --max-batch, + {c.max_waiting} waiting, "
          "--max-waiting)")
    ids = [r.request_id for r in requests]
    if len(set(ids)) < n:
      raise api.InvalidRequest("a call names a request_id twice")
    made = [self._prepare(r) for r in requests]
    with self._lock:
      for rid in ids:
        if rid in self._by_id:
          raise api.InvalidRequest(f"request_id {rid!r} is already running")
      held = len(self._by_id)
      if held + n > most:
        running = min(len(self.scheduler.running), held)
        raise api.QueueFull(
            f"the server is full: {running} requests running and {held - running} waiting "
            f"(at most {c.max_batch} + {c.max_waiting}); this call needs {n}")
      handles = []
      for request, (handle, prompt, max_tokens, seed, guide) in zip(requests, made):
        self._order += 1
        seq = Seq(request, handle, prompt, max_tokens, seed, self.tok, self._order,
                   self.eos_ids, c.scheduling == "priority")
        seq.guide = guide
        self._by_id[request.request_id] = seq
        self._inbox.append(seq)
        handles.append(handle)
      self._wake.notify()
    return handles

  def _prepare(self, request: api.Request):
    """A request's checks and what its Seq is made of: (handle, prompt ids,
    max_tokens, seed, grammar state); InvalidRequest where it cannot run."""
    prompt = self._prompt_ids(request)
    p = request.sampling
    if p.truncate_prompt_tokens is not None:
      prompt = prompt[-p.truncate_prompt_tokens:]
    room = self.max_seq_len - len(prompt)
    if room < 1:
      raise api.InvalidRequest(
          f"the prompt has {len(prompt)} tokens; at most {self.max_seq_len - 1} fit the "
          f"context of {self.max_seq_len}")
    # Without max_tokens a request gets the default, or min_tokens if more.
    max_tokens = min(p.max_tokens or max(self.config.default_max_tokens, p.min_tokens), room)
    for name in ("max_tokens", "min_tokens"):
      if (getattr(p, name) or 0) > room:
        raise api.InvalidRequest(
            f"prompt ({len(prompt)} tokens) + {name} ({getattr(p, name)}) exceeds the "
            f"context of {self.max_seq_len}")
    if len(prompt) >= self.capacity:
      raise api.InvalidRequest(
          f"the prompt has {len(prompt)} tokens; the KV cache holds {self.capacity}")
    if len(prompt) + p.min_tokens > self.capacity:
      raise api.InvalidRequest(
          f"prompt ({len(prompt)} tokens) + min_tokens ({p.min_tokens}) exceeds the "
          f"{self.capacity} tokens the KV cache holds")
    for name, ids in (("stop_token_ids", p.stop_token_ids),
                      ("logit_bias", [t for t, _ in p.logit_bias]),
                      ("allowed_token_ids", p.allowed_token_ids)):
      self._check_vocab(name, ids)
    if p.min_tokens and p.allowed_token_ids and not (
        set(p.allowed_token_ids) - set(p.stop_token_ids)
        - (set() if p.ignore_eos else self.eos_ids)):
      raise api.InvalidRequest("every allowed token id ends the request: min_tokens="
                               f"{p.min_tokens} cannot be met")
    if p.prompt_logprobs is not None and not self.config.prompt_logprobs:
      raise api.InvalidRequest("prompt_logprobs needs a server started with "
                               "--enable-prompt-logprobs")
    if request.priority and self.config.scheduling != "priority":
      raise api.InvalidRequest(f"priority={request.priority} needs priority scheduling "
                               "(serve --scheduling-policy priority)")
    guide = self._grammars.guide(p.structured) if p.structured is not None else None
    if guide is not None and p.allowed_token_ids and not guide.allowed()[
        list(p.allowed_token_ids)].any():
      # Else the request would end (STOP) at its first step with no output.
      raise api.InvalidRequest("allowed_token_ids and the structured output admit no common "
                               "first token")
    seed = p.seed if p.seed is not None else random.getrandbits(64)
    handle = api.RequestHandle(request.request_id, len(prompt),
                               self.make_events(request.request_id))
    return handle, prompt, max_tokens, seed, guide

  def _prompt_ids(self, request: api.Request) -> list[int]:
    forms = (request.prompt_ids, request.prompt_text, request.messages)
    if sum(x is not None for x in forms) != 1:
      raise api.InvalidRequest("give the prompt as text, token ids or chat messages "
                               "(exactly one)")
    if request.messages is not None:
      ids = self.render_chat(request.messages, request.add_generation_prompt)[1]
    elif request.prompt_text is not None:
      ids = self.tokenize(request.prompt_text, add_bos=request.add_bos)
    else:
      ids = [int(t) for t in request.prompt_ids]
      self._check_vocab("prompt token ids", ids)
    if not ids:
      raise api.InvalidRequest("the prompt is empty")
    return ids

  def render_chat(self, messages: Sequence[tuple[str, str]],
                  add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """Chat messages rendered by the model's chat template, then tokenized
    without adding BOS (vLLM's way: the template writes it where the model
    wants it; a BOS written as text becomes the BOS id)."""
    if not messages:
      raise api.InvalidRequest("the chat has no messages")
    render = getattr(self.tok, "apply_chat_template", None)
    messages = [{"role": role, "content": content} for role, content in messages]
    import jinja2

    try:
      text = None if render is None else render(
          messages, add_generation_prompt=add_generation_prompt)
    except (ValueError, TypeError, jinja2.TemplateError) as e:  # raise_exception, a bad role
      raise api.InvalidRequest(f"chat template: {e}") from None
    if text is None:
      raise api.InvalidRequest(f"the model {self.runner.name} has no chat template: send the "
                               "prompt as text")
    bos, bos_id = getattr(self.tok, "bos_token", ""), getattr(self.tok, "bos_id", None)
    if bos and bos_id is not None and text.startswith(bos):
      return text, [bos_id] + list(self.tok.encode(text[len(bos):]))
    return text, list(self.tok.encode(text))

  def cancel(self, request_id: str) -> None:
    with self._lock:
      self._cancels.append(request_id)
      self._wake.notify()

  def stats(self) -> api.EngineStats:
    with self._lock:
      waiting = len(self.scheduler.waiting) + len(self._inbox)
      running = len(self.scheduler.running)
    return api.EngineStats(running=running, waiting=waiting, pages_in_use=self.alloc.in_use,
                           pages_cached=self.alloc.cached, pages_total=self.alloc.usable,
                           steps=self.steps, draining=self._draining,
                           preemptions=self.preemptions,
                           jump_forward_tokens=self.jump_forward_tokens,
                           spec_draft_tokens=self.spec_draft_tokens,
                           spec_accepted_tokens=self.spec_accepted_tokens)

  def counters(self) -> dict:
    """Engine-internal counts for benchmarks and tests: steps, mixed steps run,
    whether prefill runs packed, the runner's compiled shapes (None where the
    runner does not say), and the backend compiles of the engine's loop,
    which starts after warm-up, and their seconds."""
    shapes = getattr(self.runner, "compiled_shapes", None)
    n, secs = _Compiles.of(self._thread.ident if self._thread is not None else None)
    return {"steps": self.steps, "mixed_steps_run": self.mixed_steps_run,
            "packed_prefill": self.packed, "jump_forward_tokens": self.jump_forward_tokens,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "compiled_shapes": shapes() if shapes is not None else None,
            "compiles_after_start": n, "compile_s_after_start": secs}

  def start_profile(self, log_dir: str) -> None:
    # jax's profiler traces the whole process: the scheduler thread's host
    # work and every kernel the device runs, on one timeline.
    jax.profiler.start_trace(log_dir)

  def stop_profile(self) -> None:
    jax.profiler.stop_trace()

  def drain(self, timeout: float | None = None) -> bool:
    self._draining = True
    end = None if timeout is None else time.monotonic() + timeout
    while True:
      with self._lock:
        if not self._by_id:
          return True
      if end is not None and time.monotonic() > end:
        return False
      time.sleep(0.01)

  def stop(self) -> None:
    self._stopping = True
    with self._lock:
      self._cancels.extend(self._by_id)
      self._wake.notify()
    if self._thread is not None:
      self._thread.join(timeout=30)
      self._thread = None

  # -- the scheduler -------------------------------------------------------

  def _loop(self) -> None:
    _Compiles.reset(threading.get_ident())
    try:
      while True:
        with self._lock:
          while not (self._inbox or self._cancels or self.scheduler.waiting or self.scheduler.running
                     or self.outputs.deferred or self._inflight or self._stopping):
            self._wake.wait()
          if self._stopping and not (self._by_id or self._inbox or self._cancels):
            return
        if not self.step():
          time.sleep(0.001)  # nothing could run: do not spin
        if self._stopping:
          with self._lock:
            if not self._by_id:
              return
    except BaseException as e:  # noqa: BLE001 - every request must hear about it
      log.exception("engine step failed")
      self.error = e
      with self._lock:
        seqs = list(self._by_id.values())
        self._by_id.clear()
      on_failed = getattr(self.observer, "on_failed", None)
      for s in seqs:
        failed = api.Failed(f"engine error: {e!r}")
        s.handle.events.put(failed)
        if on_failed is not None:
          on_failed(failed)

  def step(self) -> bool:
    """One iteration; False when there was nothing to do.

    Steps are pipelined: this step's batch is dispatched before the previous
    step's tokens are read back (decode inputs come from the last token of
    each slot, kept on the device), so the device always has the next step
    queued while the host reads tokens, detokenizes, checks stops and sends
    events. A request that ended on EOS or a stop string in the previous step
    may have one more token computed here: it is dropped.
    """
    t0 = time.perf_counter()
    compiles0 = _Compiles.of(threading.get_ident())[0]
    now = time.monotonic()
    with self._lock:
      inbox, self._inbox = self._inbox, []
      cancels, self._cancels = self._cancels, []
    self.scheduler.add(inbox)
    for rid in cancels:
      seq = self._by_id.get(rid)
      if seq is not None and seq.cancel is None:
        seq.cancel = api.FinishReason.CANCELLED
    for seq in list(self.scheduler.waiting) + self.scheduler.running:
      if seq.cancel is None and seq.req.deadline is not None and now >= seq.req.deadline:
        seq.cancel = api.FinishReason.DEADLINE
      if seq.cancel is not None:
        self.outputs.finish(seq, seq.cancel)

    t_wait = t_tokens = 0.0
    flushed, previous = False, self._inflight
    speculates = self.speculator.active()
    if previous and (speculates or any(s.guide is not None and s.pending for s in self.scheduler.running)):
      # A structured request's next step needs its grammar past the token in
      # flight, and drafts need every token: read them now, before this step
      # is dispatched.
      t_wait, t_tokens, flushed = self._collect(previous)
      self._inflight = []
    if speculates and self.speculator.active():  # (still: reading may have ended some)
      spec = self.speculator.run()
      if spec is not None:
        launched, decodes, t_launch, tw = spec
        self._inflight = [launched] if launched else []
        self.steps += 1
        self._record(t0, compiles0, wait=t_wait + tw, decodes=decodes,
                     launched=launched is not None, launch=t_launch, tokens=t_tokens, steps=1)
        return True
    decodes, prefills, steps = self.scheduler.schedule(admit=not self._stopping)
    launched = []  # (rows, device outputs, logprobs wanted)
    t_launch = time.perf_counter()
    for seq, n in prefills:
      if seq.scored:
        launched.append(self._run_scored(seq, n))
    prefills = [(seq, n) for seq, n in prefills if not seq.scored]
    if prefills and decodes and steps == 1 and self.mixed:
      launched.append(self._run_mixed(prefills, decodes))
    else:
      if prefills:
        launched.append(self._run_prefill(prefills))
      if decodes:
        launched.append(self._run_decode(decodes, steps))
    t_launch = time.perf_counter() - t_launch
    tw, tt, fl = self._collect(self._inflight)
    t_wait, t_tokens, flushed = t_wait + tw, t_tokens + tt, flushed or fl
    self._inflight = launched
    if not launched and not previous:
      return flushed
    if launched:
      self.steps += 1
    self._record(t0, compiles0, wait=t_wait, decodes=len(decodes), launched=bool(launched),
                 launch=t_launch, tokens=t_tokens, prefill_tokens=sum(n for _, n in prefills),
                 steps=steps if decodes else 0)
    return True

  def _record(self, t0: float, compiles0: int, **fields) -> None:
    """The iteration's StepRecord, from its start (``t0``, the thread's
    compile count then) to now, for step_times and the observer."""
    record = StepRecord(time.perf_counter() - t0, start=t0,
                        compiles=_Compiles.of(threading.get_ident())[0] - compiles0, **fields)
    self.step_times.append(record)
    if self.observer is not None:
      self.observer.on_step(self, record)

  def _collect(self, previous) -> tuple[float, float, bool]:
    """Reads a dispatched step's tokens back and hands them out: (seconds
    waiting for the device, seconds on the tokens, whether anything was sent)."""
    t_wait, t0 = 0.0, time.perf_counter()
    for seqs, out, want_lp in previous:
      tw = time.perf_counter()
      tokens = np.asarray(out[0])
      lp = [np.asarray(x) for x in out[1:4]] if want_lp else None
      t_wait += time.perf_counter() - tw
      if tokens.ndim == 1:  # one step: [rows] -> [1, rows]
        tokens = tokens[None]
        lp = None if lp is None else [x[None] for x in lp]
      n = len(tokens)
      by_row = tokens.T.tolist()  # [rows][n] Python ints: no numpy scalar per token
      for i, seq in enumerate(seqs):
        if seq is None:
          continue
        seq.pending -= n
        if seq.state != State.DONE:  # a request that ended drops what was in flight
          self.outputs.accept(seq, by_row[i], None if lp is None else
                       [(lp[0][j, i], lp[1][j, i], lp[2][j, i]) for j in range(n)])
    flushed = self._flush_deferred()
    self.guided.write_allow_rows()
    return t_wait, time.perf_counter() - t0 - t_wait, flushed

  def _sampling_inputs(self, seqs: list[Seq | None], batch: int):
    """(per-row sampling arrays, logprobs wanted, every row plain greedy)."""
    rows = [r for r, s in enumerate(seqs) if s is not None]
    live = [seqs[r] for r in rows]
    slots = np.fromiter((s.slot for s in live), np.int32, len(live))
    steps = np.fromiter((len(s.generated) + s.pending for s in live), np.int64, len(live))
    arrays = sampling.gather(self._slot_f[slots], self._slot_i[slots], np.asarray(rows, np.int32),
                             steps, batch)
    want_lp = any(s.params.logprobs or s.params.top_logprobs for s in live)
    # The fast path has no penalties, logit bias or end-token ban (min_tokens).
    greedy = all(s.params.greedy and not s.params.penalized and not s.params.biased
                 and len(s.generated) + s.pending >= s.params.min_tokens for s in live)
    return arrays, want_lp, greedy

  def _sampling_call(self, seqs: list[Seq | None], logits, batch: int):
    arrays, want_lp, greedy = self._sampling_inputs(seqs, batch)
    if greedy:
      out = sampling.greedy(logits, arrays, self._counts, self._last_tok, logprobs=want_lp)
    else:
      out = sampling.sample(logits, arrays, self._counts, self._slot_tokens, self._last_tok)
    self._counts, self._last_tok = out[4], out[5]
    for seq in seqs:
      if seq is not None:
        seq.pending += 1
    return out[:4], want_lp

  def _run_prefill(self, chunks: list[tuple[Seq, int]]):
    if self.packed:
      tokens, tpos, seg, last, table, fresh, finishing = self._packed_inputs(chunks)
      logits = self.runner.prefill_packed(tokens, tpos, seg, last, table, fresh=fresh)
    else:
      tokens, positions, lengths, table, finishing = self._prefill_inputs(chunks)
      logits = self.runner.prefill(tokens, positions, lengths, table)
    return self._sample_rows(finishing, logits, finishing)

  def _run_scored(self, seq: Seq, n: int):
    """A prompt chunk of a request that wants its prompt's logprobs, in a call
    of its own that scores each position's next prompt token."""
    c = seq.computed
    tokens, positions, lengths, table, finishing = self._prefill_inputs([(seq, n)])
    targets = np.zeros_like(tokens)
    nxt = seq.prompt[c + 1:c + 1 + n]  # past the prompt's end: nothing to score
    targets[0, :len(nxt)] = nxt
    logits, scores = self.runner.prefill_scores(tokens, positions, lengths, table, targets)
    seq.scores.append((c, len(nxt), scores))
    return self._sample_rows(finishing, logits, finishing)

  def _sample_rows(self, rows: list[Seq | None], logits, finishing: list[Seq | None]):
    """Samples a call's rows (launched as (rows, device outputs, logprobs
    wanted)); the requests in ``finishing`` completed their prompt and decode
    from now on."""
    out, want_lp = self._sampling_call(rows, logits, len(rows))
    for seq in finishing:
      if seq is not None:
        seq.state = State.DECODE
    return rows, out, want_lp

  def _prefill_inputs(self, chunks: list[tuple[Seq, int]]):
    """Padded chunk arrays; advances each request's computed tokens. The last
    element lists, per row, the request whose prompt this chunk completes."""
    rows = bucket(len(chunks), self.row_buckets)
    t = bucket(max(n for _, n in chunks), self.chunk_buckets)
    tokens = np.zeros((rows, t), np.int32)
    positions = np.zeros((rows,), np.int32)
    lengths = np.zeros((rows,), np.int32)
    slots = np.zeros((rows,), np.int32)
    finishing: list[Seq | None] = [None] * rows
    for i, (seq, n) in enumerate(chunks):
      tokens[i, :n] = seq.tokens[seq.computed:seq.computed + n]
      positions[i], lengths[i], slots[i] = seq.computed, n, seq.slot
      finishing[i] = self._advance(seq, n)
    kv = int((positions + lengths).max()) if positions.any() else None
    return tokens, positions, lengths, self._chunk_table(slots, len(chunks), kv), finishing

  def _chunk_table(self, slots, n: int, kv_tokens: int | None) -> np.ndarray:
    """The page-table rows of a chunk call's ``slots`` (the first ``n`` real,
    the rest padding, zeroed): as wide as the width bucket that covers
    ``kv_tokens``, the longest row's tokens after its chunk, or max_pages
    for fresh chunks (None), which gather nothing: one shape."""
    width = self.max_pages
    if kv_tokens is not None:
      width = bucket(-(-kv_tokens // self.page_size), self.table_buckets)
    table = self.kv.slot_table[slots, :width]  # a copy
    table[n:] = 0
    return table

  def _packed_inputs(self, chunks: list[tuple[Seq, int]]):
    """Chunks one after another in one row of a packed bucket's length:
    (tokens, positions in their sequences, row + 1 (0: padding) [N]; each
    row's last token's index [prefill_rows]; page table [prefill_rows, W];
    whether every chunk starts its prompt (fresh); finishing as in
    ``_prefill_inputs``). W is max_pages when fresh (nothing is gathered: one
    shape), else the table width bucket that covers the longest row, as in
    the row layout. Advances each request's computed tokens."""
    rows = self.config.prefill_rows
    n = bucket(sum(k for _, k in chunks), self.packed_buckets)
    tokens, tpos, seg = (np.zeros((n,), np.int32) for _ in range(3))
    last, slots = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
    finishing: list[Seq | None] = [None] * rows
    o = 0
    fresh = not any(seq.computed for seq, _ in chunks)
    kv = None if fresh else max(seq.computed + k for seq, k in chunks)
    for i, (seq, k) in enumerate(chunks):
      c = seq.computed
      tokens[o:o + k] = seq.tokens[c:c + k]
      tpos[o:o + k], seg[o:o + k], last[i], slots[i] = c + np.arange(k), i + 1, o + k - 1, seq.slot
      o += k
      finishing[i] = self._advance(seq, k)
    return tokens, tpos, seg, last, self._chunk_table(slots, len(chunks), kv), fresh, finishing

  def _advance(self, seq: Seq, n: int) -> Seq | None:
    """Counts n more of ``seq``'s prompt as computed (its full pages go to the
    prefix cache); ``seq`` if that completes the prompt, else None."""
    seq.computed += n
    self.kv.register_blocks(seq)
    return seq if seq.computed == seq.num_tokens else None

  def _run_mixed(self, chunks: list[tuple[Seq, int]], seqs: list[Seq]):
    """The decode batch and the prefill chunks in one device call (one pass
    over the weights), sampled together: rows = decode rows, then chunk rows."""
    self.mixed_steps_run += 1
    rows, slots, lengths, table = self._decode_inputs(seqs, self.batch_buckets[-1])
    for seq in seqs:
      seq.computed += 1
    if self._mixed_packed:
      tokens, tpos, seg, last, p_table, fresh, finishing = self._packed_inputs(chunks)
      logits = self._mixed_packed_call(slots, lengths, table, tokens, tpos, seg, last, p_table,
                                       fresh=fresh)
    else:
      p_tokens, positions, p_lengths, p_table, finishing = self._prefill_inputs(chunks)
      logits = self._mixed_call(slots, lengths, table, p_tokens, positions, p_lengths, p_table)
    return self._sample_rows(rows + finishing, logits, finishing)

  def _mixed_call(self, slots, *args):
    if hasattr(self.runner, "mixed_slots"):
      return self.runner.mixed_slots(self._last_tok, slots, *args)
    return self.runner.mixed(sampling.take(self._last_tok, slots), *args)

  def _mixed_packed_call(self, slots, *args, fresh: bool):
    if hasattr(self.runner, "mixed_packed_slots"):
      return self.runner.mixed_packed_slots(self._last_tok, slots, *args, fresh=fresh)
    return self.runner.mixed_packed(sampling.take(self._last_tok, slots), *args, fresh=fresh)

  def _decode_inputs(self, seqs: list[Seq], batch: int | None = None):
    """(rows padded to ``batch`` or the batch bucket, their slots (-1: padding),
    lengths, page table). A row's input token is its slot's last sampled
    token, which stays on the device (``sampling.take``)."""
    n, b = len(seqs), batch or bucket(len(seqs), self.batch_buckets)
    slots = np.full((b,), -1, np.int32)
    slots[:n] = np.fromiter((s.slot for s in seqs), np.int32, n)
    lengths = np.zeros((b,), np.int32)
    table = np.zeros((b, self.max_pages), np.int32)
    lengths[:n] = np.fromiter((s.computed + 1 for s in seqs), np.int32, n)
    table[:n] = self.kv.slot_table[slots[:n]]
    rows: list[Seq | None] = list(seqs) + [None] * (b - n)
    return rows, slots, lengths, table

  def _run_decode(self, seqs: list[Seq], steps: int = 1):
    rows, slots, lengths, table = self._decode_inputs(seqs)
    if steps > 1:
      return (rows,) + self._run_decode_steps(rows, slots, lengths, table, steps)
    for seq in seqs:
      seq.computed += 1
    logits = self._decode_call(slots, lengths, table)
    out, want_lp = self._sampling_call(rows, logits, len(rows))
    return rows, out, want_lp

  def _decode_call(self, slots, lengths, table):
    """The runner's decode step, each row's input the last token of its slot."""
    if hasattr(self.runner, "decode_slots"):  # gathered inside the step: one call
      return self.runner.decode_slots(self._last_tok, slots, lengths, table)
    return self.runner.decode(sampling.take(self._last_tok, slots), lengths, table)

  def _run_decode_steps(self, rows, slots, lengths, table, steps: int):
    """``steps`` decode steps with sampling on the device: one call where the
    runner has it, else one call per step. Outputs are [steps, batch, ...]."""
    arrays, want_lp, greedy = self._sampling_inputs(rows, len(rows))
    # Sampling computes logprobs whether asked or not: one variant, the one
    # the warm-up compiled (a sampled call without them compiled anew).
    lp = want_lp or not greedy
    if getattr(self.runner, "supports_multi_step", False):
      out = self.runner.decode_multi(slots, lengths, table, arrays, self._counts,
                                     self._slot_tokens, self._last_tok, steps=steps,
                                     greedy_only=greedy, logprobs=lp)
    else:
      outs, counts, last = [], self._counts, self._last_tok
      tok = sampling.take(last, slots)
      for i in range(steps):
        li = np.where(lengths > 0, lengths + i, 0).astype(np.int32)
        o = sampling.step_jit(self.runner.decode(tok, li, table), arrays, np.int32(i), counts,
                              self._slot_tokens, last, greedy_only=greedy, logprobs=lp)
        tok, counts, last = o[0], o[4], o[5]
        outs.append(o[:4])
      out = tuple(None if x[0] is None else jnp.stack(x) for x in zip(*outs)) + (counts, last)
    self._counts, self._last_tok = out[4], out[5]
    for seq in rows:
      if seq is not None:
        seq.computed += steps
        seq.pending += steps
    return out[:4], want_lp

  def _flush_deferred(self) -> bool:
    """Sends the text and events of the tokens accepted last step."""
    return self.outputs.flush_deferred()

  # -- warm-up ---------------------------------------------------------------

  def warmup(self) -> None:
    """Compiles every bucketed shape once (serving.engine.warmup)."""
    warmup_lib.warmup(self)

  def _warm_calls(self) -> tuple[int, int, int]:
    return warmup_lib.warm_calls(self)
