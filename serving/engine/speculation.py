"""N-gram speculation (EngineConfig.num_speculative_tokens = k > 0).

An iteration of a few decoding requests (all running requests decode, at
most speculative_max_batch, nothing waiting) first reads the previous step's
tokens, drafts up to k tokens per request from an earlier occurrence of its
last few tokens (``ngram_draft``), and checks the drafts in one call over
[last token, drafts] (sampling.verify): each request keeps the drafts equal
to what it would have decoded there (greedy: its argmax; sampled: its draw
with that step's key) plus one token of the model's own. A structured
request drafts only what its grammar admits (serving.engine.guided).

A request that gains nothing from speculative_patience checks in a row
pauses drafting for a while (``outcome``); the engine's iterations pipeline
again while no running request drafts.
"""

from __future__ import annotations

import time

import numpy as np

from serving.engine import sampling
from serving.engine.guided import RequestError, guided_drafts
from serving.engine.scheduler import bucket
from serving.engine.sequence import SPEC_PAUSE, Seq, State


def ngram_draft(tokens, k: int, lookup_max: int, lookup_min: int) -> list[int]:
  """Prompt lookup: up to ``k`` tokens that followed the latest earlier
  occurrence of the last n ``tokens``, for the longest n in
  [lookup_min, lookup_max] that occurs earlier; [] if none does."""
  toks = np.asarray(tokens, np.int32)
  for n in range(min(lookup_max, len(toks) - 1), lookup_min - 1, -1):
    # Windows of toks[:-1]: every n-gram but the last one itself.
    windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
    hits = np.flatnonzero((windows == toks[-n:]).all(axis=1))
    if hits.size:
      start = int(hits[-1]) + n
      return toks[start:start + k].tolist()
  return []


class Speculator:
  """Drafting, its pauses, and the checking call. It holds the engine: the
  call samples on the engine's slots and hands out tokens as a step does."""

  def __init__(self, engine):
    self.engine = engine
    self.config = c = engine.config
    self.draft_tokens = 0  # speculative tokens drafted, and those the model agreed with
    self.accepted_tokens = 0
    # The checking call's shapes: batch buckets up to speculative_max_batch
    # rows of one chunk bucket (the last token and k drafts).
    most = bucket(min(c.speculative_max_batch, c.max_batch), engine.batch_buckets)
    self.rows = tuple(b for b in engine.batch_buckets if b <= most)
    self.chunk = bucket(c.num_speculative_tokens + 1, engine.chunk_buckets)
    self.check_paged = bool(c.num_speculative_tokens) and getattr(
        engine.runner, "check_decode_tokens", 0) >= c.num_speculative_tokens + 1

  def active(self) -> bool:
    """Whether this iteration may check drafts (EngineConfig.num_speculative_tokens):
    every running request decodes, one may draft."""
    c, e = self.config, self.engine
    if (not c.num_speculative_tokens or e.scheduler.waiting or not e.scheduler.running
        or len(e.scheduler.running) > c.speculative_max_batch):
      return False
    return (all(s.state == State.DECODE for s in e.scheduler.running)
            and any(map(self.may_draft, e.scheduler.running)))

  @staticmethod
  def may_draft(seq: Seq) -> bool:
    """Whether a request's tokens may come from drafts: not while paused
    (``outcome``)."""
    return len(seq.generated) >= seq.spec_resume

  def outcome(self, seq: Seq, gained: bool) -> None:
    """Counts a check of a request's drafts toward its pause
    (EngineConfig.speculative_patience)."""
    if gained:
      seq.spec_misses, seq.spec_pause = 0, SPEC_PAUSE[0]
      return
    seq.spec_misses += 1
    if self.config.speculative_patience and seq.spec_misses >= self.config.speculative_patience:
      seq.spec_resume = len(seq.generated) + seq.spec_pause
      seq.spec_misses, seq.spec_pause = 0, min(2 * seq.spec_pause, SPEC_PAUSE[1])

  def draft(self, seq: Seq) -> list[int]:
    c = self.config
    return ngram_draft(seq.tokens, c.num_speculative_tokens, c.prompt_lookup_max,
                       c.prompt_lookup_min)

  def run(self):
    """One checking call for the running requests (their tokens read back):
    [last token, drafts] per row at its next positions. A request with
    drafts takes those sampling.verify keeps (equal to what it would have
    decoded there) and the token after them, with their logprobs if
    it asked, read back now; the K/V of refused drafts lie past its computed
    tokens and are overwritten. A request without drafts (none found, or it
    may not draft) has its one token sampled on the device from its first
    position's logits, read back as a decode step's is. Returns (launched
    entry or None, requests, launch seconds, seconds waiting), or None when no
    request has a draft (a plain decode step runs instead)."""
    t0, e = time.perf_counter(), self.engine
    # Pages for each request's next token, preempting as a decode step does.
    seqs, kept = e.scheduler.schedule_decodes(1), []
    drafts, guided = [], {}  # guided: row -> its grammar's allow words a position
    for seq in seqs:
      room = min(seq.max_tokens - len(seq.generated), e.capacity - seq.num_tokens) - 1
      d = []
      if self.may_draft(seq):
        d = self.draft(seq)[:max(room, 0)]
        if d and seq.guide is not None:
          try:
            d, guided[len(kept)] = guided_drafts(seq, d)
          except RequestError as err:  # its grammar failed: it ends, the others go on
            e.outputs.fail(seq, str(err), err.invalid)
            continue
        if d and not e.kv.reserve(seq, seq.computed + 1 + len(d)):
          d = []  # no pages for the drafts: no preemption for a guess
        if not d:
          self.outcome(seq, False)
      kept.append(seq)
      drafts.append(d)
    seqs = kept
    if not any(drafts):
      return None
    rows, k1 = bucket(len(seqs), self.rows), self.config.num_speculative_tokens + 1
    tokens, lengths = np.zeros((rows, k1), np.int32), np.zeros((rows,), np.int32)
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
      tokens[i, 0], tokens[i, 1:1 + len(d)] = seq.tokens[seq.computed], d
      lengths[i] = 1 + len(d)
    logits = self._checking_call(seqs, tokens, lengths)  # [rows, k + 1, V]
    drafting = [seq if d else None for seq, d in zip(seqs, drafts)] + [None] * (rows - len(seqs))
    arrays, want_lp, _ = e.inputs.sampling(drafting, rows)
    # Penalties, bias and min_tokens read the slot's state at each position.
    penalized = any(seq is not None and seq.params.slot_state for seq in drafting)
    allow = None  # (structured requests' slot state: penalized)
    if any(drafts[i] for i in guided):
      allow = np.full((rows, k1, sampling.mask_words(e.runner.vocab_size)), -1, np.int32)
      for i, words in guided.items():
        allow[i, :len(words)] = words
    checked = sampling.verify_jit(
        logits, tokens, lengths, arrays, e._counts, e._slot_tokens, allow, logprobs=want_lp,
        greedy_only=all(seq is None or seq.params.greedy for seq in drafting),
        penalized=penalized)
    # Rows without drafts: sampled from their only position's logits, as a
    # decode step samples them (penalties, seeds, logprobs and all).
    plain = [seq if not d else None for seq, d in zip(seqs, drafts)] + [None] * (rows - len(seqs))
    launched = None
    if any(plain):
      for seq in plain:
        if seq is not None:
          seq.computed += 1
      launched = (plain,) + e._sampling_call(plain, logits[:, 0], rows)
    t_launch = time.perf_counter() - t0
    kept, after, *lp = (np.asarray(x) for x in checked)
    t_wait = time.perf_counter() - t0 - t_launch
    # Each slot's newest token: the next decode step's input.
    slot_of, newest = np.full((rows,), self.config.max_batch, np.int32), np.zeros((rows,), np.int32)
    emitted, n_emitted = np.zeros((rows, k1), np.int32), np.zeros((rows,), np.int32)
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
      if not d:
        continue
      a = int(kept[i])
      new = d[:a] + [int(after[i])]
      emitted[i, :len(new)], n_emitted[i] = new, len(new)
      self.draft_tokens += len(d)
      self.accepted_tokens += a
      self.outcome(seq, a > 0)
      seq.computed += len(new)  # the last token and the agreed drafts
      slot_of[i], newest[i] = seq.slot, new[-1]
      e.outputs.accept(seq, new, [(lp[0][i, j], lp[1][i, j], lp[2][i, j])
                                  for j in range(len(new))] if lp else None)
    e._last_tok = sampling.set_last(e._last_tok, slot_of, newest)
    if penalized:  # a decode step counts what it samples; these were taken on the host
      e._counts = sampling.add_counts(e._counts, slot_of, emitted, n_emitted)
    e._flush_deferred()
    e.guided.write_allow_rows()  # structured requests' allow rows, before the next call
    return launched, len(seqs), t_launch, t_wait

  def _checking_call(self, seqs, tokens, lengths):
    """The checking call's logits [rows, k + 1, V]: row i's ``tokens`` (its
    first ``lengths[i]`` real: its last token and drafts) at its next positions.

    As a decode step with k + 1 query tokens a row (``runner.check_decode``)
    where it can: decode attention reads the pages in place. A row with fewer
    drafts is padded after them; the padding's K/V, like a refused draft's,
    lies past its computed tokens and is overwritten later. That needs every
    row's pages and context for k + 1 tokens; otherwise (or beyond the decode
    kernel's query tokens) the continued-prefill form, which gathers each
    row's pages for the prefill attention."""
    e = self.engine
    rows, k1 = tokens.shape
    n = len(seqs)
    computed = np.zeros((rows,), np.int32)
    computed[:n] = [seq.computed for seq in seqs]
    if self.check_paged and all(
        seq.computed + k1 <= e.max_pages * e.page_size
        and e.kv.reserve(seq, seq.computed + k1) for seq in seqs):
      table = np.zeros((rows, e.max_pages), np.int32)
      table[:n] = e.kv.slot_table[[seq.slot for seq in seqs]]
      return e.runner.check_decode(tokens, np.where(np.arange(rows) < n, computed + k1, 0),
                                      table)
    chunk = np.zeros((rows, self.chunk), np.int32)
    chunk[:, :k1] = tokens
    slots = np.zeros((rows,), np.int32)
    slots[:n] = [seq.slot for seq in seqs]
    table = e.inputs.chunk_table(slots, n, int((computed + lengths).max()))
    return e.runner.check_prefill(chunk, computed, lengths, table, width=k1)
