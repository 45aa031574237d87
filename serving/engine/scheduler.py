"""The scheduler: which requests run in a step, and how many tokens each.

Each step (``schedule``):
1. gives every decoding request room for one more token (``decode_steps``
   more with multi-step decoding), preempting the most recently admitted
   request (the least urgent one, under priority scheduling) when the
   allocator runs dry: its pages are freed, its tokens recomputed later;
2. spends the rest of the step's token budget on prefill chunks: first the
   requests already part-way through their prompt, then new ones admitted in
   arrival order (by priority, then arrival, with ``EngineConfig.scheduling =
   "priority"``) while their whole prompt fits in free pages and a batch slot
   is free; page-aligned prompt blocks seen before come from the prefix cache,
   and a prompt whose next block another request is computing waits for it
   (serving.engine.kv_cache).

With ``EngineConfig.prefill_first``, a step that has prefill chunks
schedules no decodes: decoding requests keep their pages and wait.

The result is a ``Schedule`` the engine's loop dispatches. The shapes the
device calls are padded to (batch, chunk, row, page-table width and packed
token buckets) are the scheduler's too: warm-up compiles each of them.

Pure Python (and numpy through the KV cache manager): it runs and is tested
without a model.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from serving.engine.config import EngineConfig
from serving.engine.kv_cache import KVCacheManager
from serving.engine.sequence import Seq, State

log = logging.getLogger("serving.engine")


def pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= factor
  out.append(hi)
  return tuple(out)


def bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if b >= n:
      return b
  raise ValueError(f"{n=} exceeds the largest bucket {buckets[-1]}")


class Schedule(NamedTuple):
  decodes: list[Seq]  # requests that decode this step, in rank order
  prefills: list[tuple[Seq, int]]  # (request, prompt tokens this step)
  steps: int  # decode steps in the decode call


class Scheduler:
  """Owns the waiting queue, the running requests (in admission order), the
  free batch slots and the decisions over them; the KV cache manager holds
  their pages. ``on_admit(seq)`` runs as a request takes its slot (the
  engine sets the slot's sampling state there)."""

  def __init__(self, config: EngineConfig, kv: KVCacheManager, *, capacity: int,
               packed: bool = False, on_admit: Callable[[Seq], None] | None = None):
    self.config = config
    self.kv = kv
    self.capacity = capacity  # tokens a request may reach (context or cache)
    self.packed = packed  # prefill calls pack their chunks in one row
    self.on_admit = on_admit
    self.waiting: collections.deque[Seq] = collections.deque()
    self.running: list[Seq] = []  # admitted, in admission order
    self.free_slots = list(range(config.max_batch - 1, -1, -1))
    self.preemptions = 0
    c = config
    self.batch_buckets = tuple(sorted(c.batch_buckets or pow2_buckets(1, c.max_batch)))
    if self.batch_buckets[-1] != c.max_batch:
      raise ValueError(f"the largest of {c.batch_buckets=} must be {c.max_batch=}")
    self.chunk_buckets = pow2_buckets(c.min_chunk, c.prefill_chunk, 4)
    self.row_buckets = pow2_buckets(1, c.prefill_rows, 4)
    # Page-table widths of continued chunks (a prefix in the cache): they
    # attend over their rows' pages gathered up to the table's width, so a
    # table as wide as the context would gather and attend max_pages pages for
    # every chunk, whatever its length. Bucketed (x4) so warm-up compiles each.
    self.table_buckets = pow2_buckets(1, kv.max_pages, 4)
    # Token counts of a packed prefill call (x2, multiples of 8: matmul tiles).
    most = min(c.budget, c.prefill_rows * c.prefill_chunk)
    self.packed_buckets = tuple(sorted({-(-b // 8) * 8 for b in pow2_buckets(
        min(c.min_chunk, most), most)}))

  def add(self, seqs: list[Seq]) -> None:
    """Queues new requests."""
    self.waiting.extend(seqs)
    if seqs:
      self.order_waiting()

  def schedule(self, admit: bool = True) -> Schedule:
    """This step's decodes and prefill chunks; ``admit`` False: no waiting
    request is admitted (the engine is stopping)."""
    c = self.config
    steps = self.decode_steps()
    # Decodes reserve their pages first, so that admitting prompts never takes
    # the pages a running request needs for its next token.
    decodes = self.schedule_decodes(steps)
    if c.prefill_first:
      prefills = self.schedule_prefills(c.budget, admit)
      if prefills:
        decodes = []  # they wait for the prefill phase, pages reserved
    else:
      budget = c.budget - len(decodes)
      if decodes and c.decode_prefill_budget is not None:
        budget = min(budget, c.decode_prefill_budget)
      prefills = self.schedule_prefills(budget, admit)
    return Schedule(decodes, prefills, steps)

  def decode_steps(self) -> int:
    """Decode steps this iteration: config.decode_steps unless a prompt waits
    (its first token would wait for all the steps), a request is still in
    prefill, some request lacks the pages or the context for them, or no
    request has more than half of them left to generate."""
    n = self.config.decode_steps
    if n == 1 or self.waiting:
      return 1
    need = most_left = 0
    for seq in self.running:
      if (seq.state != State.DECODE or seq.guide is not None
          or seq.computed + n > self.kv.max_pages * self.kv.page_size):
        return 1
      need += max(0, self.kv.pages_for(seq.computed + n) - len(seq.pages))
      most_left = max(most_left, seq.max_tokens - len(seq.generated) - seq.pending)
    # A call computes all its steps for every row. When each request ends
    # within n // 2 tokens, one-step calls (a little dearer per token than a
    # step of a multi-step call: each has its own dispatch and sampling call)
    # waste less than the unused steps would.
    if most_left <= n // 2:
      return 1
    return n if need <= self.kv.alloc.available else 1

  def schedule_decodes(self, steps: int = 1) -> list[Seq]:
    """The decoding requests that get pages for ``steps`` more tokens, most
    urgent first; the least urgent running requests are preempted to make
    room."""
    decodes = []
    for seq in sorted((s for s in self.running if s.state == State.DECODE),
                      key=lambda s: s.rank):
      if seq.state != State.DECODE:
        continue  # preempted below while making room for an earlier one
      n = len(seq.generated) + seq.pending
      if n >= seq.max_tokens or len(seq.prompt) + n >= self.capacity:
        continue  # its last token is in flight: it ends when that is read
      while not self.kv.reserve(seq, seq.computed + steps):
        victim = max((s for s in self.running if s.state != State.WAITING),
                     key=lambda s: s.rank)
        self.preempt(victim)
        if victim is seq:
          break
      if seq.state == State.DECODE:
        decodes.append(seq)
    return decodes

  def preempt(self, seq: Seq) -> None:
    """Frees a running request's pages and slot and queues it first again."""
    log.info("preempting %s (%d tokens) to free KV pages", seq.req.request_id, seq.num_tokens)
    self.preemptions += 1
    self.kv.evict(seq)
    seq.state = State.WAITING
    self.running.remove(seq)
    self.free_slots.append(seq.slot)
    seq.slot = -1
    self.waiting.appendleft(seq)
    self.order_waiting()

  def order_waiting(self) -> None:
    """Under priority scheduling, waiting requests in (priority, arrival)
    order; first-come-first-served keeps them as they were queued."""
    if self.config.scheduling == "priority":
      self.waiting = collections.deque(sorted(self.waiting, key=lambda s: s.rank))

  def admit(self, seq: Seq) -> bool:
    """Gives a waiting request its pages (cached prefix first) and a batch
    slot, and makes it running; False (nothing taken) where either is short."""
    if not self.free_slots:
      return False
    if not self.kv.allocate_prompt(seq):
      return False
    seq.state = State.PREFILL
    seq.slot = self.free_slots.pop()
    self.kv.bind_slot(seq)
    if seq.scheduled_at is None:
      seq.scheduled_at = time.monotonic()
    if self.on_admit is not None:
      self.on_admit(seq)
    self.running.append(seq)
    return True

  def release(self, seq: Seq) -> None:
    """Takes a request out of the schedule and frees its pages and slot."""
    if seq.state == State.DONE:
      return
    if seq.state == State.WAITING:
      self.waiting.remove(seq)
    else:
      self.running.remove(seq)
      self.kv.free(seq)
      self.free_slots.append(seq.slot)
    seq.state = State.DONE

  def schedule_prefills(self, budget: int, admit: bool = True) -> list[tuple[Seq, int]]:
    return self.fit_buckets(self.pick_prefills(budget, admit))

  def fit_buckets(self, chunks: list[tuple[Seq, int]]) -> list[tuple[Seq, int]]:
    """A prefill call pads each row to the chunk bucket of its longest chunk
    (x4 apart): 700 tokens run as 2,048. When every chunk is at most twice
    the bucket below, they are cut to that bucket and the rest goes in the
    next step's call, at most as large again: the two calls compute at most
    half the tokens of the one (700 tokens with buckets 512 and 2,048: 512,
    then 188 in a second call of 512, not one call of 2,048). Packed calls
    pad only their total, so keep their chunks."""
    if self.packed or not chunks:
      return chunks
    longest = max(n for _, n in chunks)
    i = self.chunk_buckets.index(bucket(longest, self.chunk_buckets))
    below = self.chunk_buckets[i - 1] if i else 0
    if not longest <= 2 * below < self.chunk_buckets[i]:
      return chunks
    return [(seq, min(n, below)) for seq, n in chunks]

  def pick_prefills(self, budget: int, admit: bool = True) -> list[tuple[Seq, int]]:
    """Prompt chunks within ``budget`` tokens and prefill_rows rows: the
    running requests' next chunks, then waiting requests admitted in order."""
    out = []
    cap = self.config.prefill_chunk
    for seq in self.running:
      if len(out) == self.config.prefill_rows or budget <= 0:
        return out
      if seq.state == State.PREFILL:
        n = min(seq.num_tokens - seq.computed, budget, cap)
        out.append((seq, n))
        budget -= n
    inflight = self.kv.inflight_blocks(self.running) if self.waiting else set()
    i = 0
    while (i < len(self.waiting) and len(out) < self.config.prefill_rows and budget > 0
           and admit):
      seq = self.waiting[i]
      if inflight and not seq.scored and self.kv.shares_inflight(seq, inflight):
        i += 1  # it waits; the requests behind it need not
        continue
      if seq.pending or not self.admit(seq):  # preempted with a token in flight: next step
        break
      del self.waiting[i]
      inflight.update(self.kv.uncached_blocks(seq))
      n = min(seq.num_tokens - seq.computed, budget, cap)
      out.append((seq, n))
      budget -= n
    return out
