"""The KV cache manager: which pages of the cache each request holds.

It owns the page allocator (serving.engine.pages) and, per batch slot, the
row of the page table that the device calls read (``slot_table``), kept up
to date as pages come and go so that building a step's inputs is a gather,
not a loop over requests. A request's pages cover its tokens so far; its
full prompt pages are registered in the prefix cache under chained block
hashes as their KV is computed, so a later prompt with the same page-aligned
prefix starts past it (``allocate_prompt``).

A prompt whose next uncached block another running request is prefilling
waits until that block is in the prefix cache instead of computing it too
(SGLang's in-batch prefix caching): n requests with one long prompt (a
shared system prompt, or the n completions of one call) prefill it once
(``inflight_blocks``, ``shares_inflight``).

Pure Python and numpy: the scheduler and its tests use it without a model.
"""

from __future__ import annotations

import numpy as np

from serving.engine.pages import PageAllocator, block_hashes
from serving.engine.sequence import Seq, State


class KVCacheManager:

  def __init__(self, num_pages: int, page_size: int, *, slots: int, max_pages: int,
               prefix_caching: bool = True):
    self.alloc = PageAllocator(num_pages, page_size, prefix_caching=prefix_caching)
    self.page_size = page_size
    self.max_pages = max_pages  # pages of the longest sequence: the table's width
    self.slot_table = np.zeros((slots, max_pages), np.int32)

  def pages_for(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def reserve(self, seq: Seq, tokens: int) -> bool:
    """Pages for ``seq``'s first ``tokens`` tokens (False, nothing taken,
    where the allocator has too few)."""
    need = self.pages_for(tokens) - len(seq.pages)
    if need <= 0:
      return True
    pages = self.alloc.allocate(need)
    if pages is None:
      return False
    self.slot_table[seq.slot, len(seq.pages):len(seq.pages) + need] = pages
    seq.pages.extend(pages)
    return True

  def allocate_prompt(self, seq: Seq) -> bool:
    """Pages for a request's tokens at admission: the cached pages of its
    longest prefix in the prefix cache, then fresh ones; its computed
    tokens start after the cached ones. False (nothing taken) where the
    allocator has too few."""
    self.hash_blocks(seq)
    # At least one token is computed, for the logits of the next token. A
    # request that wants its prompt's logprobs computes every token.
    cached = [] if seq.scored else self.alloc.lookup(
        seq.hashes[:(seq.num_tokens - 1) // self.page_size])
    fresh = self.alloc.allocate(self.pages_for(seq.num_tokens) - len(cached))
    if fresh is None:
      self.alloc.release(cached)
      return False
    seq.pages = cached + fresh
    seq.computed = seq.registered = len(cached) * self.page_size
    if not seq.generated:
      seq.cached_tokens = seq.computed
    return True

  def bind_slot(self, seq: Seq) -> None:
    """Writes ``seq``'s pages into its batch slot's page-table row."""
    self.slot_table[seq.slot] = 0
    self.slot_table[seq.slot, :len(seq.pages)] = seq.pages

  def free(self, seq: Seq) -> None:
    """Drops ``seq``'s references on its pages (cached ones stay cached)."""
    self.alloc.release(seq.pages)
    seq.pages = []

  def evict(self, seq: Seq) -> None:
    """Frees a preempted request's pages: its tokens are computed again later."""
    self.free(seq)
    seq.computed, seq.registered = 0, 0

  def hash_blocks(self, seq: Seq) -> None:
    """seq.hashes for its tokens now: tokens are only appended, so hashes of
    as many full pages as it has are still right (a waiting request is
    checked every step)."""
    if seq.hashes is None or len(seq.hashes) != seq.num_tokens // self.page_size:
      seq.hashes = block_hashes(seq.tokens, self.page_size)

  def register_blocks(self, seq: Seq) -> None:
    """Registers ``seq``'s full pages whose KV is computed in the prefix cache."""
    full = min(seq.computed // self.page_size, len(seq.hashes or ()))
    for i in range(seq.registered // self.page_size, full):
      self.alloc.register(seq.pages[i], seq.hashes[i])
    seq.registered = max(seq.registered, full * self.page_size)

  def uncached_blocks(self, seq: Seq) -> list[bytes]:
    """Hashes of ``seq``'s prompt blocks not registered yet."""
    return seq.hashes[seq.registered // self.page_size:]

  def inflight_blocks(self, running: list[Seq]) -> set[bytes]:
    """Hashes of the prompt blocks running requests are prefilling, not yet cached."""
    if not self.alloc.prefix_caching:
      return set()
    out = set()
    for seq in running:
      if seq.state == State.PREFILL:
        out.update(self.uncached_blocks(seq))
    return out

  def shares_inflight(self, seq: Seq, inflight: set[bytes]) -> bool:
    """Whether the first block of ``seq``'s prompt that is not cached is one
    another request is computing (``inflight``): then it waits for it."""
    self.hash_blocks(seq)
    hashes = seq.hashes[:(seq.num_tokens - 1) // self.page_size]
    k = self.alloc.cached_prefix(hashes)
    return k < len(hashes) and hashes[k] in inflight
