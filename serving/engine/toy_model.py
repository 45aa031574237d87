"""A small Llama-like decoder in plain jnp with the ``models`` serving API.

It implements ``prefill(cache, tokens, positions, lengths, page_table)`` and
``decode(cache, tokens, lengths, page_table)`` over the shared paged KV layout
``[num_layers, Hkv, num_pages, page_size, D]`` exactly as models/ documents
them, with random weights and the byte tokenizer. The engine's tests run on it
so that they need neither checkpoint files nor interpreted kernels; attention
reads the whole page table (gather) and masks by position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from serving.engine.text import ByteTokenizer


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  name: str = "toy"
  vocab_size: int = 258
  hidden_size: int = 32
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 8
  intermediate_size: int = 64
  max_position_embeddings: int = 4096


class KVCache(NamedTuple):
  k: jax.Array
  v: jax.Array


def _rms(x, w):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w


def _rope(x, pos):  # x [B, T, H, D], pos [B, T]
  d = x.shape[-1] // 2
  freq = 10000.0 ** (-jnp.arange(d) / d)
  ang = pos[..., None, None].astype(jnp.float32) * freq
  x1, x2 = x[..., :d], x[..., d:]
  return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang),
                          x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def _forward(cfg: ToyConfig, params, cache: KVCache, tokens, positions, lengths, page_table):
  b, t = tokens.shape
  hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ps = cache.k.shape[3]
  pos = positions[:, None] + jnp.arange(t)[None]  # [B, T]
  valid = jnp.arange(t)[None] < lengths[:, None]
  page = jnp.where(valid, jnp.take_along_axis(page_table, pos // ps, axis=1, mode="clip"), 0)
  slot = jnp.where(valid, pos % ps, 0)
  kv_len = positions + lengths  # [B]
  kv_pos = jnp.arange(page_table.shape[1] * ps)
  mask = (kv_pos[None, None] <= pos[..., None]) & (kv_pos[None, None] < kv_len[:, None, None])
  x = params["embed"][tokens]
  k_all, v_all = cache.k, cache.v
  for i, lp in enumerate(params["layers"]):
    h = _rms(x, lp["ln1"])
    q = _rope((h @ lp["wq"]).reshape(b, t, hq, hd), pos)
    k = _rope((h @ lp["wk"]).reshape(b, t, hkv, hd), pos)
    v = (h @ lp["wv"]).reshape(b, t, hkv, hd)
    # Writes [B, T, Hkv, D] at (page, slot) (advanced indices first); invalid tokens go to page 0.
    k_all = k_all.at[i, :, page, slot].set(k)
    v_all = v_all.at[i, :, page, slot].set(v)
    kc = k_all[i][:, page_table].reshape(hkv, b, -1, hd)  # [Hkv, B, S, D]
    vc = v_all[i][:, page_table].reshape(hkv, b, -1, hd)
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    s = jnp.einsum("btkgd,kbsd->bkgts", qg, kc) * hd ** -0.5
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, -1) * mask[:, None, None].any(-1, keepdims=True)
    o = jnp.einsum("bkgts,kbsd->btkgd", p, vc).reshape(b, t, hq * hd)
    x = x + o @ lp["wo"]
    h = _rms(x, lp["ln2"])
    x = x + (jax.nn.silu(h @ lp["wg"]) * (h @ lp["wu"])) @ lp["wd"]
  last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  logits = _rms(last, params["ln_f"]) @ params["head"]
  return logits.astype(jnp.float32), KVCache(k_all, v_all)


class ToyModel:
  """Random weights (fixed seed); same call signatures as models.Model."""

  def __init__(self, config: ToyConfig = ToyConfig(), seed: int = 0):
    self.config = config
    self.tokenizer = ByteTokenizer(config.vocab_size)
    c = config
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 7 * c.num_layers))
    def w(*shape):
      return jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5
    self.params = {
        "embed": w(c.vocab_size, c.hidden_size) * c.vocab_size ** 0.5,
        "ln_f": jnp.ones((c.hidden_size,)),
        "head": w(c.hidden_size, c.vocab_size) * 4.0,
        "layers": [dict(
            ln1=jnp.ones((c.hidden_size,)), ln2=jnp.ones((c.hidden_size,)),
            wq=w(c.hidden_size, c.num_heads * c.head_dim),
            wk=w(c.hidden_size, c.num_kv_heads * c.head_dim),
            wv=w(c.hidden_size, c.num_kv_heads * c.head_dim),
            wo=w(c.num_heads * c.head_dim, c.hidden_size),
            wg=w(c.hidden_size, c.intermediate_size), wu=w(c.hidden_size, c.intermediate_size),
            wd=w(c.intermediate_size, c.hidden_size)) for _ in range(c.num_layers)],
    }
    self._fwd = jax.jit(functools.partial(_forward, c), donate_argnums=(1,))

  def init_cache(self, num_pages: int, page_size: int = 16) -> KVCache:
    c = self.config
    shape = (c.num_layers, c.num_kv_heads, num_pages, page_size, c.head_dim)
    return KVCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))

  def prefill(self, cache, tokens, positions, lengths, page_table, **backends):
    del backends
    return self._fwd(self.params, cache, jnp.asarray(tokens, jnp.int32),
                     jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32),
                     jnp.asarray(page_table, jnp.int32))

  def decode(self, cache, tokens, lengths, page_table, **backends):
    del backends
    lengths = jnp.asarray(lengths, jnp.int32)
    valid = (lengths > 0).astype(jnp.int32)
    return self._fwd(self.params, cache, jnp.asarray(tokens, jnp.int32)[:, None],
                     jnp.maximum(lengths - 1, 0), valid, jnp.asarray(page_table, jnp.int32))
