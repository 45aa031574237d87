"""attention_prefill_fp8: prefill attention with fp8 Q, K, V (FA3's fp8 path).

``o = softmax((q * q_scale) (k * k_scale)^T * sm_scale + mask) (v * v_scale)``

q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] are float8_e4m3fn; q_scale [Hq] and
k_scale, v_scale [Hkv] are float32 per-head scales, or shape () per-tensor
ones. Masks (causal, cached prefix, positions, packed segments, sliding
window), GQA and the lse mean what they mean in kernels/attention_prefill.py;
the output is bfloat16 (``out_dtype``: float16 or float32 too).

How data flows:

- ``quantize_heads`` turns a bf16 [B, S, H, D] tensor into fp8 and its
  per-head scales (each head's amax maps to 448) in one XLA fusion; a model
  quantizes q, k, v after RoPE.
- The mosaic backend is kernels/attention_prefill.py's FA3 kernel (producer
  warpgroup, TMA ring, two consumers with ping-pong, optional overlap) with
  fp8 operands: QK^T runs on the fp8 tensor cores; q_scale * k_scale *
  sm_scale folds into the softmax's exp2 factor; P = exp2(s - m + 8) is cast
  to fp8 (256 times the probabilities: e4m3's subnormals would flush small
  ones) and goes through SMEM as the fp8 P V's A operand; v_scale and 1/l
  scale the output once. fp8 wgmma reads both operands K-major, so V enters
  the kernel transposed, V^T [B, Hkv, D, Skv]: the wrapper's transpose fuses
  with the quantization that writes V.
- attention_prefill's ``mosaic_fp8`` backend (registered here, chosen by
  name only) is this kernel behind ``quantize_heads`` of 16-bit q, k, v: the
  bf16 op's call, with fp8 inside.
- The ``xla`` backend dequantizes to float32 and runs the bf16 op's xla
  backend in float32 (fp8 storage, 32-bit math; 16 bits would round the
  dequantized operands again, or overflow float16): the portable fallback.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels import attention_prefill as ap
from mosaic import dsl, registry, target as target_lib, tuning

OP = "attention_prefill_fp8"
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # a head of zeros gets this scale, not 0
OUT_DTYPES = ("bfloat16", "float16", "float32")
# Head dims the fp8 kernel runs: Q K^T contracts D, which fp8 wgmma reads in
# 128-byte swizzled blocks; at D = 256 the bf16 output tiles leave no SMEM
# for a K/V ring of 128-key blocks.
MOSAIC_HEAD_DIMS = (128,)
# P V contracts a kv block, also in 128-byte blocks.
MOSAIC_BLOCK_KV = (128, 256)
# What attention_prefill's "mosaic_fp8" backend quantizes (the bf16 op's dtypes).
QUANTIZED_DTYPES = ("bfloat16", "float16")


# --------------------------------------------------------------------------
# Quantization


def quantize_heads(x):
  """x [B, S, H, D] (any float dtype) -> (x_q float8_e4m3fn, scale float32 [H]):
  per head, over its tokens and dims (dynamic: a prefill's own amax)."""
  if getattr(x, "ndim", None) != 4 or 0 in x.shape:
    raise ValueError(f"quantize_heads' x must be a non-empty [B, S, H, D] array; got "
                     f"{getattr(x, 'shape', type(x).__name__)}")
  x = jnp.asarray(x, jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(x), axis=(0, 1, 3)) / FP8_MAX, MIN_SCALE)
  return (x / scale[:, None]).astype(FP8), scale


def _per_head(scale, heads: int):
  """A () or [heads] scale as float32 [heads]."""
  return jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (heads,))


# --------------------------------------------------------------------------
# Checks


def _check(q, k, v, q_scale, k_scale, v_scale, out_dtype, causal, sm_scale, q_positions,
           kv_positions, q_segment_ids, kv_segment_ids, sliding_window):
  """What every backend accepts; returns (shapes, output dtype)."""
  dims = ap._check(q, k, v, causal, sm_scale, q_positions, kv_positions, q_segment_ids,
                   kv_segment_ids, sliding_window, dtypes=(FP8.name,))
  _, _, Hq, _, _, Hkv = dims
  for name, x, heads in (("q_scale", q_scale, Hq), ("k_scale", k_scale, Hkv),
                         ("v_scale", v_scale, Hkv)):
    if x is None:
      raise ValueError(f"{name}= is required (float32 [{heads}] per head or () per tensor; "
                       "see quantize_heads)")
    if getattr(x, "dtype", None) != jnp.float32 or tuple(x.shape) not in ((), (heads,)):
      raise ValueError(f"{name} must be float32 of shape () or ({heads},); got "
                       f"{getattr(x, 'dtype', type(x).__name__)} {jnp.shape(x)}")
    if not isinstance(x, jax.core.Tracer):  # (a traced scale's values are not known here)
      values = np.asarray(x)
      if not (np.isfinite(values) & (values > 0)).all():
        raise ValueError(f"{name} must be finite and > 0 (as quantize_heads makes them); got "
                         f"{values.ravel()[~(np.isfinite(values.ravel()) & (values.ravel() > 0))][0]}")
  out_dtype = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
  if out_dtype.name not in OUT_DTYPES:
    raise ValueError(f"{out_dtype=} must be one of {OUT_DTYPES}")
  return dims, out_dtype


def _valid(q, k, v, *, q_scale=None, k_scale=None, v_scale=None, out_dtype=None, causal=True,
           sm_scale=None, q_positions=None, kv_positions=None, q_segment_ids=None,
           kv_segment_ids=None, sliding_window=None, return_lse=False, config=None) -> str | None:
  if config is not None:
    return f"config= applies to the mosaic backend only; got {config=}"
  try:
    _check(q, k, v, q_scale, k_scale, v_scale, out_dtype, causal, sm_scale, q_positions,
           kv_positions, q_segment_ids, kv_segment_ids, sliding_window)
  except ValueError as e:
    return str(e)
  return None


def _mosaic_why_not(q, k, v, *, q_scale=None, k_scale=None, v_scale=None, out_dtype=None,
                    causal=True, sm_scale=None, q_positions=None, kv_positions=None,
                    q_segment_ids=None, kv_segment_ids=None, sliding_window=None,
                    return_lse=False, config=None) -> str | None:
  try:
    (_, _, _, D, _, _), _ = _check(q, k, v, q_scale, k_scale, v_scale, out_dtype, causal,
                                   sm_scale, q_positions, kv_positions, q_segment_ids,
                                   kv_segment_ids, sliding_window)
  except ValueError as e:
    return str(e)
  return _mosaic_limits(D, sm_scale, config)


def _mosaic_limits(D, sm_scale, config) -> str | None:
  """What the kernel cannot run among calls that pass ``_check``."""
  kind = target_lib.current().kind
  if kind not in ("hopper", "cpu"):
    return f"the fp8 kernel runs Hopper's fp8 wgmma; this device is {kind}"
  if why := ap.scale_why_not(sm_scale):
    return why
  if D not in MOSAIC_HEAD_DIMS:
    return (f"head dim {D} is not supported (supported: {MOSAIC_HEAD_DIMS}: fp8 wgmma "
            "contracts 128-byte blocks, and D = 256 leaves no SMEM for the K/V ring)")
  if config is not None:
    if not isinstance(config, ap.Config):
      return f"config must be an attention_prefill.Config; got {config=}"
    if config.block_kv not in MOSAIC_BLOCK_KV:
      return f"{config.block_kv=} must be one of {MOSAIC_BLOCK_KV} for fp8 (P V contracts it)"
  return None


# --------------------------------------------------------------------------
# Public wrapper


def _pick_config(D: int, causal: bool) -> ap.Config:
  key = tuning.shape_key(head_dim=D, dtype=FP8.name, causal=int(causal))
  # P always goes through SMEM (Hopper's wgmma takes 16-bit A operands only
  # from registers).
  return tuning.lookup("attention_prefill", key, ap.Config,
                       lambda: ap.Config(block_q=64, block_kv=128, stages=2, p_smem=True))


def attention_prefill_fp8_mosaic(q, k, v, *, q_scale, k_scale, v_scale, out_dtype=None,
                                 causal=True, sm_scale=None, q_positions=None, kv_positions=None,
                                 q_segment_ids=None, kv_segment_ids=None, sliding_window=None,
                                 return_lse=False, config: ap.Config | None = None):
  """The FA3 kernel on fp8 operands; ``config`` overrides the tuning table
  (op ``attention_prefill``, dtype float8_e4m3fn) / heuristic."""
  # (One _check: it reads the scales' values, a wait for the device.)
  try:
    (B, Sq, Hq, D, Skv, Hkv), out_dtype = _check(
        q, k, v, q_scale, k_scale, v_scale, out_dtype, causal, sm_scale, q_positions,
        kv_positions, q_segment_ids, kv_segment_ids, sliding_window)
    why = _mosaic_limits(D, sm_scale, config)
  except ValueError as e:
    why = str(e)
  if why is not None:
    raise ValueError(f"attention_prefill_fp8 mosaic: {why}")
  masks = dict(causal=causal, sm_scale=sm_scale, q_positions=q_positions,
               kv_positions=kv_positions, q_segment_ids=q_segment_ids,
               kv_segment_ids=kv_segment_ids, sliding_window=sliding_window)
  return _run_mosaic(q, k, v, (q_scale, k_scale, v_scale), out_dtype, masks,
                     bool(return_lse), config, plan=None)


def _mosaic_config(D, causal, dense, out_dtype, has_lse, config) -> ap.Config:
  """The call's config: ``config`` or the table's / heuristic's, checked
  against SMEM (the interpreter's variant where it interprets)."""
  cfg = config or _pick_config(D, causal)
  if not cfg.p_smem:
    raise ValueError(f"attention_prefill_fp8 mosaic: {cfg=} needs p_smem=True (fp8 P is a "
                     "wgmma operand only from SMEM)")
  need = ap.smem_bytes(cfg, D, 1, dense=dense, has_lse=has_lse,
                       out_itemsize=jnp.dtype(out_dtype).itemsize)
  limit = target_lib.current().ceilings.smem_per_block
  if not dsl.interpreting() and need > limit:
    raise ValueError(f"attention_prefill_fp8 mosaic: {cfg} needs about {need} bytes of SMEM "
                     f"for this call; the limit is {limit}")
  if dsl.interpreting():
    # What ap._mosaic_setup does: the interpreter has no run_state, and its
    # thread pool can stall the overlap's turn-passing under load.
    cfg = dataclasses.replace(cfg, acc_in_place=False,
                              pingpong=cfg.pingpong and not cfg.overlap)
  return cfg


def _mosaic_setup(B, Sq, Skv, D, out_dtype, masks, has_lse, config):
  """(config, make_plan(), dense) of a checked call; masks as ``_mask_args`` fills them."""
  dense = ap.unmasked(masks["causal"], masks["sliding_window"], masks["q_segment_ids"])
  cfg = _mosaic_config(D, bool(masks["causal"]), dense, out_dtype, has_lse, config)
  vecs = ap._vectors(B, Sq, Skv, masks["q_positions"], masks["kv_positions"],
                     masks["q_segment_ids"], masks["kv_segment_ids"])
  make_plan = lambda: ap._mosaic_plan(*vecs, cfg=cfg, causal=bool(masks["causal"]),
                                      window=masks["sliding_window"])
  return cfg, make_plan, dense


def _run_mosaic(q, k, v, qkv_scales, out_dtype, masks, has_lse, config, plan):
  """The kernel on checked fp8 q/k/v and their (q, k, v) scales; ``plan``
  (None: made here) from ``_mosaic_setup`` for the same call."""
  (B, Sq, Hq, D), (_, Skv, Hkv, _) = q.shape, k.shape
  cfg, make_plan, dense = _mosaic_setup(B, Sq, Skv, D, out_dtype, masks, has_lse, config)
  if plan is None:
    plan = make_plan()
  else:
    shapes = lambda p: [tuple(x.shape) for x in p]
    want = shapes(jax.eval_shape(make_plan))
    got = shapes(plan) if isinstance(plan, ap.MosaicPlan) else None
    if got != want:
      raise ValueError(f"the plan was made for other shapes or another config: {got} "
                       f"(this call needs {want})")
  sm = float(D ** -0.5 if masks["sm_scale"] is None else masks["sm_scale"])
  q_scale, k_scale, v_scale = qkv_scales
  kv_head = lambda s: jnp.repeat(_per_head(s, Hkv), Hq // Hkv)
  scales = jnp.stack([_per_head(q_scale, Hq) * kv_head(k_scale) * (sm * math.log2(math.e)),
                      kv_head(v_scale)])
  return ap._attention_mosaic(q, k, v, plan, scales, cfg=cfg, causal=bool(masks["causal"]),
                              scale=sm, window=masks["sliding_window"], has_lse=has_lse,
                              dense=dense, out_dtype=jnp.dtype(out_dtype))


# --------------------------------------------------------------------------
# attention_prefill's "mosaic_fp8" backend: 16-bit q/k/v in, fp8 inside


def _quantized_why_not(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                       kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                       sliding_window=None, return_lse=False, config=None) -> str | None:
  try:
    _, _, _, D, _, _ = ap._check(q, k, v, causal, sm_scale, q_positions, kv_positions,
                                 q_segment_ids, kv_segment_ids, sliding_window,
                                 dtypes=QUANTIZED_DTYPES)
  except ValueError as e:
    return str(e)
  return _mosaic_limits(D, sm_scale, config)


def attention_prefill_quantized(q, k, v, *, return_lse=False, config: ap.Config | None = None,
                                plan: ap.MosaicPlan | None = None, **masks):
  """attention_prefill on 16-bit q, k, v through the fp8 kernel: each is
  quantized per head (``quantize_heads``, the call's own amax), and the
  output comes back in q's dtype. Dynamic scales cost reads of q, k, v (the
  amax, then the quantization); the operands' and P's fp8 rounding cost
  ~0.05 relative error on random inputs. ``plan``: from
  ``attention_prefill_quantized_plan`` with the same arguments."""
  masks = _mask_args(masks)
  why = _quantized_why_not(q, k, v, return_lse=return_lse, config=config, **masks)
  if why is not None:
    raise ValueError(f"attention_prefill mosaic_fp8: {why}")
  (q8, qs), (k8, ks), (v8, vs) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
  return _run_mosaic(q8, k8, v8, (qs, ks, vs), q.dtype, masks, bool(return_lse), config, plan)


def attention_prefill_quantized_plan(q, k, v, *, return_lse=False,
                                     config: ap.Config | None = None, **masks) -> ap.MosaicPlan:
  """The quantized call's block ranges and padded vectors, computed once."""
  masks = _mask_args(masks)
  why = _quantized_why_not(q, k, v, return_lse=return_lse, config=config, **masks)
  if why is not None:
    raise ValueError(f"attention_prefill mosaic_fp8: {why}")
  (B, Sq, _, D), Skv = q.shape, k.shape[1]
  return _mosaic_setup(B, Sq, Skv, D, q.dtype, masks, bool(return_lse), config)[1]()


def _dequantize(q, k, v, q_scale, k_scale, v_scale, dtype):
  f = lambda x, s: (x.astype(jnp.float32) * _per_head(s, x.shape[2])[:, None]).astype(dtype)
  return f(q, q_scale), f(k, k_scale), f(v, v_scale)


def attention_prefill_fp8_xla(q, k, v, *, q_scale, k_scale, v_scale, out_dtype=None,
                              return_lse=False, **masks):
  """Dequantizes to float32, then the bf16 op's xla backend (in float32)."""
  _, out_dtype = _check(q, k, v, q_scale, k_scale, v_scale, out_dtype, **_mask_args(masks))
  q, k, v = _dequantize(q, k, v, q_scale, k_scale, v_scale, jnp.float32)
  out = ap.attention_prefill_xla(q, k, v, return_lse=return_lse, **masks)
  return (out[0].astype(out_dtype), out[1]) if return_lse else out.astype(out_dtype)


def _mask_args(masks):
  names = ("causal", "sm_scale", "q_positions", "kv_positions", "q_segment_ids",
           "kv_segment_ids", "sliding_window")
  unknown = set(masks) - set(names)
  if unknown:
    raise TypeError(f"unknown arguments {sorted(unknown)}")
  defaults = dict(causal=True, sm_scale=None, q_positions=None, kv_positions=None,
                  q_segment_ids=None, kv_segment_ids=None, sliding_window=None)
  return {**defaults, **masks}


# --------------------------------------------------------------------------
# Reference


def attention_prefill_fp8_reference(q, k, v, *, q_scale, k_scale, v_scale, out_dtype=None,
                                    return_lse=False, **masks):
  """The meaning of the op: attention of the dequantized operands in float32
  (returned in float32)."""
  _check(q, k, v, q_scale, k_scale, v_scale, out_dtype, **_mask_args(masks))
  q, k, v = _dequantize(q, k, v, q_scale, k_scale, v_scale, jnp.float32)
  return ap.attention_prefill_reference(q, k, v, return_lse=return_lse, **masks)


def _reference_backend(q, k, v, *, out_dtype=None, return_lse=False, **kw):
  out = attention_prefill_fp8_reference(q, k, v, return_lse=return_lse, **kw)
  out_dtype = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
  return (out[0].astype(out_dtype), out[1]) if return_lse else out.astype(out_dtype)


# --------------------------------------------------------------------------
# Registration

_op = registry.op(OP, "softmax((q q_scale)(k k_scale)^T * scale + mask)(v v_scale), q/k/v "
                      "float8_e4m3fn with per-head or per-tensor scales; GQA, causal, "
                      "segments, positions, sliding window")
_op.register("mosaic", attention_prefill_fp8_mosaic, supports=_mosaic_why_not,
             doc="Mosaic GPU FA3 on fp8 wgmma: scales in the exp2 factor, fp8 P via SMEM")
_op.register("xla", attention_prefill_fp8_xla, supports=_valid,
             doc="dequantize, then the bf16 op's xla backend in float32")
_op.register("reference", _reference_backend, supports=_valid, doc="float32 jnp")
_op.set_defaults(hopper=("mosaic", "xla"), default=("xla", "reference"))
# On the bf16 op, by name only (fp8 rounding changes the output): not in its defaults.
ap.op.register("mosaic_fp8", attention_prefill_quantized, supports=_quantized_why_not,
               plan=attention_prefill_quantized_plan,
               doc="q/k/v quantized per head, then the fp8 FA3 kernel (by name only)")


def attention_prefill_fp8(q, k, v, *, backend: str | None = None, **kwargs):
  return _op(q, k, v, backend=backend, **kwargs)
