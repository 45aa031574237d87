"""The batching engine: one scheduler thread, one model step per iteration.

Each iteration (``step``):
1. takes new submissions and cancellations from the other threads; ends the
   requests that were cancelled or ran past their deadline (pages freed now);
2. asks the scheduler (serving.engine.scheduler) for this step's decodes and
   prefill chunks, within the token budget and the KV pages the cache
   manager (serving.engine.kv_cache) can give them, preempting where the
   pages run out;
3. dispatches the prefill chunk batch and the decode batch (inputs built by
   serving.engine.inputs, shapes padded to the scheduler's buckets, all
   compiled by serving.engine.warmup at start) and samples on the device;
   the decode inputs are the last token of each batch slot, kept on the
   device, so this step is queued before the host has read the previous
   step's tokens;
4. then reads the previous step's tokens and hands each request its tokens,
   text and final event (serving.engine.outputs) while the device runs this
   step.

With ``EngineConfig.mixed_steps``, step 3's two calls are one when both have
work: the chunk's tokens join the decode batch's pass over the weights.

With ``EngineConfig.decode_steps`` = n > 1, an iteration with no prompt
waiting runs n decode steps in one device call (sampling on the device, each
step's token fed to the next), so the host dispatches and reads once per n
tokens; tokens computed past a request's end are dropped when read. Once no
request has more than n // 2 tokens left, it goes back to one step a call.

With ``EngineConfig.prompt_logprobs``, a request that asks for its prompt's
logprobs has each of its prompt chunks dispatched in step 3 as a call of its
own that keeps every position's logits and scores the next prompt token; the
scores stay on the device until the request's final event carries them.

A structured request (serving.engine.guided) and n-gram speculation
(serving.engine.speculation) read the previous step's tokens before this
step is dispatched: the grammar's next allowed set, and the drafts, need
them. Requests are checked when submitted (serving.engine.intake).
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import api, sampling
from serving.engine import warmup as warmup_lib
from serving.engine.config import SCHEDULING, EngineConfig, auto_compile_threads  # noqa: F401
from serving.engine.guided import Guided
from serving.engine.inputs import Inputs
from serving.engine.intake import Intake
from serving.engine.kv_cache import KVCacheManager
from serving.engine.outputs import Outputs
from serving.engine.scheduler import Scheduler, bucket, pow2_buckets
from serving.engine.sequence import Seq, State
from serving.engine.speculation import Speculator, ngram_draft  # noqa: F401
from serving.engine.timing import Compiles, StepRecord

# Names other modules import from here.
_bucket, _pow2_buckets, _Compiles = bucket, pow2_buckets, Compiles

log = logging.getLogger("serving.engine")


def _scheduler_attr(name: str) -> property:
  return property(lambda self: getattr(self.scheduler, name),
                  lambda self, value: setattr(self.scheduler, name, value))


class BatchingEngine(api.Engine):
  # The scheduler's: the shapes every device call is padded to, whether
  # prefill calls are packed, and its preemptions so far.
  batch_buckets, chunk_buckets, row_buckets, table_buckets, packed_buckets, packed, preemptions = (
      map(_scheduler_attr, ("batch_buckets", "chunk_buckets", "row_buckets", "table_buckets",
                            "packed_buckets", "packed", "preemptions")))

  def __init__(self, runner, config: EngineConfig = EngineConfig()):
    self.runner = runner
    self.config = config
    self.page_size = runner.page_size
    if config.max_seq_len is not None and config.max_seq_len > runner.max_context:
      # (vLLM refuses a max_model_len past the model's too: positions past it
      # are not the model's to give)
      raise ValueError(f"EngineConfig.max_seq_len={config.max_seq_len} is more than the "
                       f"{runner.max_context} tokens of runner {runner.name}'s context")
    self.max_seq_len = config.max_seq_len or runner.max_context
    self.max_pages = -(-self.max_seq_len // self.page_size)
    self.kv = KVCacheManager(runner.num_pages, runner.page_size, slots=config.max_batch,
                             max_pages=self.max_pages, prefix_caching=config.prefix_caching)
    self.alloc = self.kv.alloc
    # The whole cache may hold fewer tokens than the context: a request stops there.
    self.capacity = min(self.max_seq_len, self.alloc.usable * self.page_size)
    if self.capacity < self.max_seq_len:
      log.warning("the KV cache holds %d tokens, fewer than the %d of max_seq_len: a request's "
                  "prompt and output together stop there (more pages, or a shorter "
                  "--max-seq-len, make the two agree)", self.capacity, self.max_seq_len)
    self.scheduler = Scheduler(config, self.kv, capacity=self.capacity,
                               on_admit=self._init_slot)
    for flag, on in (("prompt_logprobs", config.prompt_logprobs),
                     ("num_speculative_tokens", config.num_speculative_tokens)):
      if on and not getattr(runner, "supports_prompt_logprobs", False):
        raise ValueError(f"{flag}: runner {runner.name} does not keep every position's logits")
    why = getattr(runner, "backends_why_not", None)
    if why is not None:
      raise ValueError(why)
    self.packed = False
    if config.packed_prefill is not False:
      why = getattr(runner, "packed_why_not", f"runner {runner.name} has no packed prefill")
      if config.packed_prefill and why is not None:
        raise ValueError(f"packed_prefill: {why}")
      self.packed = why is None
    eos = tuple(getattr(runner.tokenizer, "eos_ids", ()) or ())
    bos = getattr(runner.tokenizer, "bos_id", None)
    self.eos_ids = frozenset(eos)
    self.info = api.EngineInfo(
        model_name=runner.name, vocab_size=runner.vocab_size, max_context=self.max_seq_len,
        capacity=self.capacity,
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
    self._slot_biased = np.zeros((config.max_batch,), bool)  # its bias or allow row is set
    self.inputs = Inputs(self.scheduler, self.kv, slots=config.max_batch,
                         prefill_rows=config.prefill_rows)
    self.guided = Guided(self)  # structured outputs' grammar state
    self._grammars = self.guided.grammars
    self.intake = Intake(runner.tokenizer, vocab_size=runner.vocab_size, model_name=runner.name,
                         max_seq_len=self.max_seq_len, capacity=self.capacity, config=config,
                         eos_ids=self.eos_ids, grammars=self._grammars)
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
      raise ValueError(f"mixed_steps: runner {runner.name} has no mixed step (a sliding-window "
                       "model's, or one off models.Model's direct path); leave it off")
    self._draining = False
    self._stopping = False
    self._thread: threading.Thread | None = None
    self.steps = 0
    self.error: BaseException | None = None
    # The last iterations' timings and what they dispatched.
    self.step_times: collections.deque[StepRecord] = collections.deque(maxlen=4096)
    self.observer = None  # optional metrics sink: .on_step(engine, record), .on_final(final)
    Compiles.listen()

  @property
  def tok(self):
    """The tokenizer, the intake's: requests are made with the one set here."""
    return self.intake.tok

  @tok.setter
  def tok(self, tok) -> None:
    self.intake.tok = tok

  @property
  def jump_forward_tokens(self) -> int:  # tokens structured outputs took without sampling
    return self.guided.jump_forward_tokens

  @property
  def spec_draft_tokens(self) -> int:  # speculative tokens drafted
    return self.speculator.draft_tokens

  @property
  def spec_accepted_tokens(self) -> int:  # drafts the model agreed with
    return self.speculator.accepted_tokens

  def _init_slot(self, seq: Seq) -> None:
    """The sampling state of an admitted request's batch slot."""
    self.inputs.slot_f[seq.slot], self.inputs.slot_i[seq.slot] = sampling.param_rows(
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
    return self.intake.tokenize(text, add_bos)

  def token_pieces(self, ids: Sequence[int]) -> list[str]:
    return self.intake.token_pieces(ids)

  def token_bytes(self, ids: Sequence[int]) -> list[list[int]]:
    return self.intake.token_bytes(ids)

  def detokenize(self, ids: Sequence[int]) -> str:
    return self.intake.detokenize(ids)

  def render_chat(self, messages: Sequence[tuple[str, str]],
                  add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    return self.intake.render_chat(messages, add_generation_prompt)

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
    """(handle, prompt ids, max_tokens, seed, grammar state) of a request's
    Seq; InvalidRequest where it cannot run."""
    return self.intake.prepare(request, self.make_events)

  def _prompt_ids(self, request: api.Request) -> list[int]:
    return self.intake.prompt_ids(request)

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
    n, secs = Compiles.of(self._thread.ident if self._thread is not None else None)
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

  # -- the loop ------------------------------------------------------------

  def _loop(self) -> None:
    Compiles.reset(threading.get_ident())
    try:
      while True:
        with self._lock:
          while not (self._inbox or self._cancels or self.scheduler.waiting
                     or self.scheduler.running
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
    compiles0 = Compiles.of(threading.get_ident())[0]
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
    if previous and (speculates or any(s.guide is not None and s.pending
                                       for s in self.scheduler.running)):
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
                        compiles=Compiles.of(threading.get_ident())[0] - compiles0, **fields)
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

  def _sampling_call(self, seqs: list[Seq | None], logits, batch: int):
    arrays, want_lp, greedy = self.inputs.sampling(seqs, batch)
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
      tokens, tpos, seg, last, table, fresh, finishing = self.inputs.packed(chunks)
      logits = self.runner.prefill_packed(tokens, tpos, seg, last, table, fresh=fresh)
    else:
      tokens, positions, lengths, table, finishing = self.inputs.prefill(chunks)
      logits = self.runner.prefill(tokens, positions, lengths, table)
    return self._sample_rows(finishing, logits, finishing)

  def _run_scored(self, seq: Seq, n: int):
    """A prompt chunk of a request that wants its prompt's logprobs, in a call
    of its own that scores each position's next prompt token."""
    c = seq.computed
    tokens, positions, lengths, table, finishing = self.inputs.prefill([(seq, n)])
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

  def _run_mixed(self, chunks: list[tuple[Seq, int]], seqs: list[Seq]):
    """The decode batch and the prefill chunks in one device call (one pass
    over the weights), sampled together: rows = decode rows, then chunk rows."""
    self.mixed_steps_run += 1
    rows, slots, lengths, table = self.inputs.decode(seqs, self.batch_buckets[-1])
    for seq in seqs:
      seq.computed += 1
    if self._mixed_packed:
      tokens, tpos, seg, last, p_table, fresh, finishing = self.inputs.packed(chunks)
      logits = self._mixed_packed_call(slots, lengths, table, tokens, tpos, seg, last, p_table,
                                       fresh=fresh)
    else:
      p_tokens, positions, p_lengths, p_table, finishing = self.inputs.prefill(chunks)
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

  def _run_decode(self, seqs: list[Seq], steps: int = 1):
    rows, slots, lengths, table = self.inputs.decode(seqs)
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
    arrays, want_lp, greedy = self.inputs.sampling(rows, len(rows))
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
