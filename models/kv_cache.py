"""The paged KV cache and the helpers that address it.

``KVCache(k, v)``, each ``[num_layers, Hkv, num_pages, page_size, hd]``:
token t of a sequence lives in page ``page_table[t // page_size]``, slot
``t % page_size``. Page 0 is scratch: padding tokens write there. The cache
is in the model's dtype or in fp8 (``float8_e4m3fn``: half the bytes, values
stored as they are, saturating at +-448, i.e. kv scales of 1).

A step finds each new token's (page, slot) [B, T] (``page_slot``,
``chunk_slots``), writes its K/V there (``write_kv``: one scatter per layer,
padding dropped), and for a chunk over a cached prefix gathers each row's
pages back into [B, Skv, Hkv, hd] (``gather_pages``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.config import ModelConfig

try:
  from kernels.attention_decode import DEFAULT_PAGE_SIZE
except Exception:  # the decode kernel module may not import on every install
  DEFAULT_PAGE_SIZE = 128


class KVCache(NamedTuple):
  k: jax.Array  # [num_layers, Hkv, num_pages, page_size, hd]
  v: jax.Array

  @property
  def page_size(self) -> int:
    return self.k.shape[3]

  @property
  def num_pages(self) -> int:
    return self.k.shape[2]


KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE,
               dtype="bfloat16", sharding=None) -> KVCache:
  if jnp.dtype(dtype).name not in KV_DTYPES:
    raise ValueError(f"KV cache dtype {jnp.dtype(dtype).name} is not supported; "
                     f"supported: {KV_DTYPES}")
  if num_pages < 2:
    raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the scratch page)")
  if page_size <= 0:
    raise ValueError(f"{page_size=} must be positive")
  shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  z = functools.partial(jnp.zeros, shape, jnp.dtype(dtype))
  if sharding is not None:
    z = jax.jit(z, out_shardings=sharding)
  return KVCache(z(), z())


def chunk_slots(positions, lengths, t, page_table, page_size):
  """Of chunks of T tokens at ``positions`` with ``lengths`` valid: each token's
  position, validity, page and slot, each [B, T]."""
  tpos = positions[:, None] + jnp.arange(t, dtype=jnp.int32)
  valid = jnp.arange(t)[None, :] < lengths[:, None]
  return (tpos, valid) + page_slot(tpos, valid, page_table, page_size)


def to_cache_dtype(x, dtype):
  """x in the cache's dtype; into fp8 at scale 1, saturating (a plain cast
  would make NaN)."""
  from kernels.attention_decode import FP8_DTYPES, quantize_pages

  if jnp.dtype(dtype).name in FP8_DTYPES:
    return quantize_pages(x, 1.0, dtype)
  return x.astype(dtype)


def write_kv(kc, vc, layer, page, slot, valid, k, v):
  """k/v [B, T, Hkv, hd] into the layer's cache at each token's (page, slot)
  [B, T]; invalid tokens (padding rows, a short chunk's tail) write nothing."""
  with jax.named_scope("kv_write"):
    if page.size == 1:
      # One token (decode at batch 1): a dynamic update slice. XLA makes the
      # one-row scatter one too, but keeps a scatter's out-of-bounds rule by
      # reading the old row first and selecting: two more kernels per layer.
      # An invalid token (a warm-up row) lands in scratch page 0.
      start = (layer, 0, page.reshape(()), slot.reshape(()), 0)
      put = lambda c, x: jax.lax.dynamic_update_slice(
          c, to_cache_dtype(x, c.dtype).reshape(1, -1, 1, 1, x.shape[-1]), start)
    else:
      # Each invalid token gets a page of its own past the cache's end, which
      # the scatter drops, so every index is unique. Sent to one scratch slot,
      # the colliding updates ran one after another on the GPU: a prefill of
      # 2 prompts padded to 4 rows took ~300 ms instead of ~40
      # (bench/results/serving_h200/padding_writes/).
      spare = kc.shape[2] + jnp.arange(page.size, dtype=page.dtype).reshape(page.shape)
      page = jnp.where(valid, page, spare)
      put = lambda c, x: c.at[layer, :, page, slot].set(
          to_cache_dtype(x, c.dtype), mode="drop", unique_indices=True)
    return put(kc, k), put(vc, v)


def page_slot(tpos, valid, page_table, page_size):
  """Page and slot of each token [B, T]; invalid tokens get scratch page 0
  (``write_kv`` drops them instead)."""
  idx = jnp.clip(tpos // page_size, 0, page_table.shape[1] - 1)
  page = jnp.take_along_axis(page_table, idx, axis=1)
  page = jnp.where(valid, page, 0)
  slot = jnp.where(valid, tpos % page_size, 0)
  return page, slot


def gather_pages(kc, vc, layer, page_table, dtype):
  """cache[layer] pages of each row -> [B, max_pages * page_size, Hkv, hd] in ``dtype``."""
  b, mp = page_table.shape

  def one(c):
    g = c[layer][:, page_table]  # [Hkv, B, max_pages, page_size, hd]
    g = jnp.moveaxis(g, 0, 3)  # [B, max_pages, page_size, Hkv, hd]
    return g.reshape(b, mp * g.shape[2], g.shape[3], g.shape[4]).astype(dtype)

  return one(kc), one(vc)
