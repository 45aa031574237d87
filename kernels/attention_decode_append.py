"""One new token a sequence: RoPE, its K/V write and decode attention, one op.

``attention_decode_append(qkv[B,1,Hkv,G+2,D], k_pages, v_pages, lengths[B],
page_table, rope[B,2,D])``: a decode step's q, k and v rows come out of one
matmul un-rotated (each kv head's G query heads, then its k, then its v). The
op rotates q and k by RoPE (``rope_table`` of the step's angles), writes k and
v into the token's page slot (position ``lengths - 1``) and attends as
``attention_decode``; it returns (o, k_pages, v_pages).

As XLA ops around ``attention_decode`` that is three small kernels a layer
(3.5 us at batch 1 and 6.8 us at batch 64 on the H200,
bench/results/decode_append_h200/). The Mosaic backend is the decode kernel
of kernels/attention_decode.py in its append mode, one kernel: Q is rotated
in its SMEM tile, and the block that holds the token's position stores k and
v and patches them into the page it streams. Its config is that kernel's
``Config``; this file holds the op's checks, what append mode supports, the
jitted call, the jnp backends (xla, the float32 reference) and registration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import attention_decode as ad
from mosaic import dsl, registry


def rope_table(cos, sin):
  """(cos, sin) of the tokens' angles, each [B, ..., D/2] (one token a row,
  as ``models.rope.rope_angles`` gives them) -> the append op's float32
  table [B, 2, D]: (cos | cos, -sin | sin), the rotation as a product with
  x and with x's halves swapped."""
  b = cos.shape[0]
  c = jnp.asarray(cos, jnp.float32).reshape(b, -1)
  s = jnp.asarray(sin, jnp.float32).reshape(b, -1)
  return jnp.stack([jnp.concatenate([c, c], -1), jnp.concatenate([-s, s], -1)], axis=1)


def _check_append(qkv, k_pages, v_pages, lengths, page_table, rope, layer=None):
  if not hasattr(qkv, "shape") or qkv.ndim != 5 or qkv.shape[1] != 1 or qkv.shape[3] < 3:
    raise ValueError("qkv must be [B, 1, Hkv, G + 2, D] (each kv head's G query heads, then "
                     f"its k, then its v), got {getattr(qkv, 'shape', type(qkv).__name__)}")
  b, _, hkv, gp2, d = qkv.shape
  q = jax.ShapeDtypeStruct((b, 1, hkv * (gp2 - 2), d), qkv.dtype)
  ad._check(q, k_pages, v_pages, lengths, page_table, layer)
  if k_pages.shape[-4] != hkv:
    raise ValueError(f"qkv has {hkv} kv heads, the pages {k_pages.shape[-4]}: {k_pages.shape=}")
  if not hasattr(rope, "shape") or tuple(rope.shape) != (b, 2, d) or rope.dtype != jnp.float32:
    raise ValueError(f"rope must be the float32 [B, 2, D] = {(b, 2, d)} of rope_table, got "
                     f"{getattr(rope, 'shape', None)} {getattr(rope, 'dtype', None)}")
  return q


def _rotate(x, rope):
  """x [B, T, H, D] rotated by the table [B, 2, D], in float32."""
  h = x.shape[-1] // 2
  x32 = x.astype(jnp.float32)
  swapped = jnp.concatenate([x32[..., h:], x32[..., :h]], axis=-1)
  c, s = rope[:, None, None, 0], rope[:, None, None, 1]
  return (x32 * c + swapped * s).astype(x.dtype)


def _append_jnp(qkv, k_pages, v_pages, lengths, page_table, rope, layer, attend):
  """The op in jnp: rotate, scatter k and v into their slots (none for a row
  whose position -1 or past its table is not a slot), then ``attend``."""
  b, _, hkv, gp2, d = qkv.shape
  q = _rotate(qkv[:, :, :, :-2].reshape(b, 1, hkv * (gp2 - 2), d), rope)
  k, v = _rotate(qkv[:, :, :, -2], rope), qkv[:, :, :, -1]  # [B, 1, Hkv, D]
  page = k_pages.shape[-2]
  pos = jnp.asarray(lengths) - 1
  valid = (pos >= 0) & (pos < page_table.shape[1] * page)
  idx = jnp.clip(pos // page, 0, page_table.shape[1] - 1)
  pg = jnp.where(valid, jnp.take_along_axis(page_table, idx[:, None], axis=1)[:, 0],
                 k_pages.shape[-3])  # out of range: dropped
  slot = jnp.where(valid, pos % page, 0)

  def put(pages, x):
    x = x[:, 0]
    if jnp.dtype(pages.dtype).name in ad.FP8_DTYPES:
      x = ad.quantize_pages(x, 1.0, pages.dtype)
    if pages.ndim == 5:  # [B, Hkv, D] at (layer, :, page, slot)
      return pages.at[layer, :, pg, slot].set(x.astype(pages.dtype), mode="drop")
    return pages.at[:, pg, slot].set(x.swapaxes(0, 1).astype(pages.dtype), mode="drop")

  k_pages, v_pages = put(k_pages, k), put(v_pages, v)
  return attend(q, k_pages, v_pages), k_pages, v_pages


def _append_then(attention, qkv, k_pages, v_pages, lengths, page_table, rope, sm_scale, layer):
  """The op in jnp around ``attention`` (an attention_decode backend)."""
  _check_append(qkv, k_pages, v_pages, lengths, page_table, rope, layer)
  attend = lambda q, k, v: attention(q, k, v, lengths, page_table, sm_scale=sm_scale,
                                     layer=layer)
  return _append_jnp(qkv, k_pages, v_pages, lengths, page_table, rope, layer, attend)


def attention_decode_append_xla(qkv, k_pages, v_pages, lengths, page_table, rope, *,
                                sm_scale=None, layer=None):
  return _append_then(ad.attention_decode_xla, qkv, k_pages, v_pages, lengths, page_table,
                      rope, sm_scale, layer)


def attention_decode_append_reference(qkv, k_pages, v_pages, lengths, page_table, rope, *,
                                      sm_scale=None, layer=None):
  """The meaning of the op; the output is float32."""
  return _append_then(ad.attention_decode_reference, qkv, k_pages, v_pages, lengths,
                      page_table, rope, sm_scale, layer)


def _append_config(qkv, k_pages, page_table) -> ad.Config:
  b, _, hkv, gp2, d = qkv.shape
  return ad._pick_config(b, hkv, 1, page_table.shape[1], k_pages.shape[-2], d, qkv.dtype,
                         k_pages.dtype, gp2)


def _append_mosaic_supports(qkv, k_pages, v_pages, lengths, page_table, rope, *, layer=None,
                            config: ad.Config | None = None, **kwargs) -> str | None:
  del kwargs
  try:
    q = _check_append(qkv, k_pages, v_pages, lengths, page_table, rope, layer)
  except ValueError as e:
    return str(e)
  why = ad._mosaic_supports(q, k_pages, v_pages, lengths, page_table, layer=layer)
  if why:
    return why
  gp2, d = qkv.shape[-2:]
  if jnp.dtype(k_pages.dtype).name in ad.FP8_DTYPES:
    return "the kernel appends to bf16 / f16 pages only (fp8 pages: the xla backend)"
  if d % 128:
    return f"the kernel rotates 64-column halves: head dim must be a multiple of 128, got {d}"
  if gp2 > ad.ROWS:
    return f"the q heads, k and v of a kv head ({gp2}) must fit one {ad.ROWS}-row tile"
  cfg = config or _append_config(qkv, k_pages, page_table)
  page = k_pages.shape[-2]
  if cfg.blocks_per_sm or cfg.step_keys(page) % ad.ROWS:
    return (f"config {cfg} has no append mode (needs steps of a multiple of 64 keys and no "
            "persistent grid)")
  # Append mode's SMEM: a 64-row Q tile, the RoPE table and two k/v row buffers.
  isz = jnp.dtype(qkv.dtype).itemsize
  extra = (ad.ROWS - ad._tile_rows(cfg, gp2)) * d * isz + 2 * d * 4 + 2 * 2 * d * isz
  if ad._smem_bytes(cfg, page, d, qkv.dtype, True, k_pages.dtype, gp2) + extra > ad.SMEM_LIMIT:
    return f"config {cfg} does not fit in SMEM with append mode's buffers"
  return None


@functools.partial(jax.jit, static_argnames=("sm_scale", "config"))
def _append_mosaic(qkv, k_pages, v_pages, lengths, page_table, rope, layer=None, *,
                   sm_scale: float, config: ad.Config):
  b, _, hkv, gp2, d = qkv.shape
  g = gp2 - 2
  shape = k_pages.shape
  layer_arr = dsl.layer_operand(layer if k_pages.ndim == 5 else None)
  # The kernel writes the pages in place: refs make the call alias them.
  k_ref = jax.new_ref(k_pages.reshape(-1, *shape[-3:]))
  v_ref = jax.new_ref(v_pages.reshape(-1, *shape[-3:]))
  o = ad._kernel_call(qkv.reshape(b, hkv, gp2, d), k_ref, v_ref, lengths, page_table,
                      layer_arr, None, tq=1, group=g, sm_scale=sm_scale, config=config,
                      rope=rope)
  o = ad._unpack_o(o, 1, hkv * g).astype(qkv.dtype)
  return o, jax.freeze(k_ref).reshape(shape), jax.freeze(v_ref).reshape(shape)


def attention_decode_append_mosaic(qkv, k_pages, v_pages, lengths, page_table, rope, *,
                                   sm_scale=None, layer=None, config: ad.Config | None = None):
  why = _append_mosaic_supports(qkv, k_pages, v_pages, lengths, page_table, rope, layer=layer,
                                config=config)
  if why:
    raise ValueError(f"attention_decode_append mosaic: {why}")
  config = config or _append_config(qkv, k_pages, page_table)
  return _append_mosaic(qkv, k_pages, v_pages, lengths, page_table, rope, layer,
                        sm_scale=ad._scale(sm_scale, qkv.shape[-1]), config=config)


def _append_try_check(*args, layer=None, **kwargs) -> str | None:
  del kwargs
  try:
    _check_append(*args[:6], layer=layer)
  except (ValueError, TypeError) as e:
    return str(e)
  return None


append_op = registry.op(
    "attention_decode_append",
    "one new token a sequence: RoPE on its q and k, its k and v into the paged cache, "
    "then paged decode attention")
append_op.register("mosaic", attention_decode_append_mosaic, supports=_append_mosaic_supports,
                   doc="Mosaic GPU: the decode kernel rotates and writes in its blocks")
append_op.register("xla", attention_decode_append_xla, supports=_append_try_check,
                   doc="jnp rotation and scatter, then attention_decode's xla backend")
append_op.register("reference", attention_decode_append_reference, supports=_append_try_check,
                   doc="float32 jnp; output stays float32")
append_op.set_defaults(hopper=("mosaic", "xla"), default=("xla",))


def attention_decode_append(qkv, k_pages, v_pages, lengths, page_table, rope, *, sm_scale=None,
                            layer=None, backend: str | None = None):
  """One new token a sequence (a decode step), at position ``lengths - 1``:
  qkv [B, 1, Hkv, G + 2, D] holds each kv head's G query heads, then its k,
  then its v, un-rotated; ``rope`` the float32 table [B, 2, D] of
  ``rope_table``. Rotates q and k, writes k and v into the token's page slot
  (``page_table``; nothing for a row whose position is -1 or past its
  table), and attends as ``attention_decode`` (``layer``: a whole cache
  stack). Returns (o [B, 1, Hq, D], k_pages, v_pages)."""
  kw = {} if layer is None else {"layer": layer}
  return append_op(qkv, k_pages, v_pages, lengths, page_table, rope, sm_scale=sm_scale,
                   backend=backend, **kw)
