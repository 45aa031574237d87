"""The KV page allocator: free list, reference counts, prefix cache.

Pages are indices into the KV cache's page axis; page 0 is the null page the
model writes padding to, never handed out. A page is *in use* while some
request holds a reference. Full pages of prompt tokens are registered under a
hash chained over every block before them, so a later prompt with the same
page-aligned prefix reuses those pages instead of recomputing them. A cached
page that nobody references stays in an LRU list and is evicted only when the
free list is empty.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
  """Chained hash of each full page of ``tokens`` (hash i covers pages 0..i)."""
  out, prev = [], b""
  for i in range(len(tokens) // page_size):
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(",".join(map(str, tokens[i * page_size:(i + 1) * page_size])).encode())
    prev = h.digest()
    out.append(prev)
  return out


class PageAllocator:

  def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True):
    if num_pages < 2:
      raise ValueError(f"{num_pages=} must be >= 2 (page 0 is reserved)")
    if page_size < 1:
      raise ValueError(f"{page_size=} must be >= 1")
    self.num_pages = num_pages
    self.page_size = page_size
    self.prefix_caching = prefix_caching
    self._free: collections.deque[int] = collections.deque(range(1, num_pages))
    self._refs = [0] * num_pages
    self._by_hash: dict[bytes, int] = {}
    self._hash_of: dict[int, bytes] = {}
    # Cached pages nobody references, oldest first: evicted on demand.
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

  @property
  def usable(self) -> int:
    return self.num_pages - 1

  @property
  def in_use(self) -> int:
    return self.usable - len(self._free) - len(self._idle)

  @property
  def cached(self) -> int:
    return len(self._hash_of)

  @property
  def available(self) -> int:
    return len(self._free) + len(self._idle)

  def allocate(self, n: int) -> list[int] | None:
    """``n`` fresh pages, or None (nothing taken) if fewer are available."""
    if n > self.available:
      return None
    pages = []
    for _ in range(n):
      if self._free:
        p = self._free.popleft()
      else:
        p, _ = self._idle.popitem(last=False)
        del self._by_hash[self._hash_of.pop(p)]
      self._refs[p] = 1
      pages.append(p)
    return pages

  def release(self, pages: Sequence[int]) -> None:
    for p in pages:
      if self._refs[p] <= 0:
        raise RuntimeError(f"page {p} released more often than taken")
      self._refs[p] -= 1
      if self._refs[p] == 0:
        if p in self._hash_of:
          self._idle[p] = None
        else:
          self._free.append(p)

  def lookup(self, hashes: Sequence[bytes]) -> list[int]:
    """Takes a reference on the cached pages of the longest matching prefix."""
    if not self.prefix_caching:
      return []
    pages = []
    for h in hashes:
      p = self._by_hash.get(h)
      if p is None:
        break
      pages.append(p)
    for p in pages:
      if self._refs[p] == 0:
        del self._idle[p]
      self._refs[p] += 1
    return pages

  def cached_prefix(self, hashes: Sequence[bytes]) -> int:
    """How many leading blocks of ``hashes`` are cached (``lookup`` without
    taking references)."""
    if not self.prefix_caching:
      return 0
    n = 0
    while n < len(hashes) and hashes[n] in self._by_hash:
      n += 1
    return n

  def register(self, page: int, h: bytes) -> None:
    """Marks a full, written page as holding the block with hash ``h``."""
    if not self.prefix_caching or h in self._by_hash or page in self._hash_of:
      return
    self._by_hash[h] = page
    self._hash_of[page] = h

  def check(self) -> None:
    """Invariants, for tests: every page is free, idle-cached or referenced."""
    free, idle = set(self._free), set(self._idle)
    assert 0 not in free and 0 not in idle, "page 0 handed out"
    assert not free & idle
    for p in range(1, self.num_pages):
      assert (p in free) + (p in idle) + (self._refs[p] > 0) == 1, f"page {p} state"
