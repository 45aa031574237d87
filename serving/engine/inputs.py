"""The host arrays of a step's device calls, built from the schedule.

Decode rows take their input token from their slot's last sampled token,
which stays on the device: a decode call's inputs are slots, lengths and the
page table. A prefill batch goes to the device as one row of its chunks'
tokens (segment ids keep each chunk's attention to its own sequence)
wherever the runner can (``EngineConfig.packed_prefill``), else as one
padded row each; a mixed step's chunks too. Shapes are padded to the
scheduler's buckets. Building a prefill call's inputs counts its chunks as
computed (their full pages go to the prefix cache).

Per batch slot, the sampling parameters (``slot_f``, ``slot_i``) are set at
admission, so that building a step's inputs is a gather rather than a loop
over requests. The device calls themselves are the engine's.
"""

from __future__ import annotations

import numpy as np

from serving.engine import sampling
from serving.engine.kv_cache import KVCacheManager
from serving.engine.scheduler import Scheduler, bucket
from serving.engine.sequence import Seq


class Inputs:

  def __init__(self, buckets: Scheduler, kv: KVCacheManager, *, slots: int, prefill_rows: int):
    self.buckets = buckets  # the scheduler, whose buckets pad every shape
    self.kv = kv
    self.prefill_rows = prefill_rows
    self.slot_f = np.zeros((slots, sampling.F_COLS), np.float32)
    self.slot_i = np.zeros((slots, sampling.I_COLS), np.int64)

  def sampling(self, seqs: list[Seq | None], batch: int):
    """(per-row sampling arrays, logprobs wanted, every row plain greedy)."""
    rows = [r for r, s in enumerate(seqs) if s is not None]
    live = [seqs[r] for r in rows]
    slots = np.fromiter((s.slot for s in live), np.int32, len(live))
    steps = np.fromiter((len(s.generated) + s.pending for s in live), np.int64, len(live))
    arrays = sampling.gather(self.slot_f[slots], self.slot_i[slots], np.asarray(rows, np.int32),
                             steps, batch)
    want_lp = any(s.params.logprobs or s.params.top_logprobs for s in live)
    # The fast path has no penalties, logit bias or end-token ban (min_tokens).
    greedy = all(s.params.greedy and not s.params.penalized and not s.params.biased
                 and len(s.generated) + s.pending >= s.params.min_tokens for s in live)
    return arrays, want_lp, greedy

  def prefill(self, chunks: list[tuple[Seq, int]]):
    """Padded chunk arrays; advances each request's computed tokens. The last
    element lists, per row, the request whose prompt this chunk completes."""
    rows = bucket(len(chunks), self.buckets.row_buckets)
    t = bucket(max(n for _, n in chunks), self.buckets.chunk_buckets)
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
    return tokens, positions, lengths, self.chunk_table(slots, len(chunks), kv), finishing

  def chunk_table(self, slots, n: int, kv_tokens: int | None) -> np.ndarray:
    """The page-table rows of a chunk call's ``slots`` (the first ``n`` real,
    the rest padding, zeroed): as wide as the width bucket that covers
    ``kv_tokens``, the longest row's tokens after its chunk, or max_pages
    for fresh chunks (None), which gather nothing: one shape."""
    width = self.kv.max_pages
    if kv_tokens is not None:
      width = bucket(-(-kv_tokens // self.kv.page_size), self.buckets.table_buckets)
    table = self.kv.slot_table[slots, :width]  # a copy
    table[n:] = 0
    return table

  def packed(self, chunks: list[tuple[Seq, int]]):
    """Chunks one after another in one row of a packed bucket's length:
    (tokens, positions in their sequences, row + 1 (0: padding) [N]; each
    row's last token's index [prefill_rows]; page table [prefill_rows, W];
    whether every chunk starts its prompt (fresh); finishing as in
    ``prefill``). W is max_pages when fresh (nothing is gathered: one
    shape), else the table width bucket that covers the longest row, as in
    the row layout. Advances each request's computed tokens."""
    rows = self.prefill_rows
    n = bucket(sum(k for _, k in chunks), self.buckets.packed_buckets)
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
    return tokens, tpos, seg, last, self.chunk_table(slots, len(chunks), kv), fresh, finishing

  def decode(self, seqs: list[Seq], batch: int | None = None):
    """(rows padded to ``batch`` or the batch bucket, their slots (-1: padding),
    lengths, page table). A row's input token is its slot's last sampled
    token, which stays on the device (``sampling.take``)."""
    n, b = len(seqs), batch or bucket(len(seqs), self.buckets.batch_buckets)
    slots = np.full((b,), -1, np.int32)
    slots[:n] = np.fromiter((s.slot for s in seqs), np.int32, n)
    lengths = np.zeros((b,), np.int32)
    table = np.zeros((b, self.kv.max_pages), np.int32)
    lengths[:n] = np.fromiter((s.computed + 1 for s in seqs), np.int32, n)
    table[:n] = self.kv.slot_table[slots[:n]]
    rows: list[Seq | None] = list(seqs) + [None] * (b - n)
    return rows, slots, lengths, table

  def _advance(self, seq: Seq, n: int) -> Seq | None:
    """Counts n more of ``seq``'s prompt as computed (its full pages go to the
    prefix cache); ``seq`` if that completes the prompt, else None."""
    seq.computed += n
    self.kv.register_blocks(seq)
    return seq if seq.computed == seq.num_tokens else None
