"""matmul_fp8: W8A8 on Hopper's fp8 tensor cores.

``out = act((a @ w^T) * a_scale[:, None] * w_scale[None, :] (+ bias)) (+ residual)``

a [M, K] and w [N, K] are float8_e4m3fn; a_scale [M] and w_scale [N] are
float32 (a's per-token scales, w's per-output-channel scales), so a @ w^T
stands for the product of the dequantized operands a * a_scale and
w * w_scale. The weight is stored [out_features, in_features] (K-major):
Hopper's fp8 wgmma reads both operands K-major, unlike bf16's [K, N] weights.

How data flows:

- At load, ``quantize_weight`` turns a bf16 [K, N] weight (the models' [in,
  out] layout) into (w [N, K] fp8, w_scale [N]): each output channel's amax
  maps to fp8's largest value, 448.
- At each call, ``quantize_rows`` turns the activations [M, K] into (a fp8,
  a_scale [M]) in one XLA fusion (a row's amax, divide, cast);
  ``quantize_rows_static`` does it with a checkpoint's fixed input scale. With
  ``rms_eps`` it also folds the RMSNorm into a_scale: rows differing by a
  factor quantize to the same fp8 values, so quantize(rms_rows(x)) has x's
  fp8 values and x's scale times rsqrt(mean(x**2) + eps). The norm costs no
  pass of its own (the norm's weight is folded into w before quantization).
- The kernel is kernels/matmul.py's Hopper kernel with fp8 operands: the same
  persistent and swapped-operand (small M) schedules, split-K and clusters;
  the float32 accumulator is scaled by the two scales in the epilogue, before
  the bias, the SwiGLU gate and the residual.
- The ``xla`` backend computes the fp8 dot with float32 accumulation and
  leaves the scales and the epilogue to XLA's fusions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels import matmul as mm
from mosaic import dsl, registry, target as target_lib

OP = "matmul_fp8"
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
# A row (or channel) of zeros gets this scale rather than 0 (no division by zero).
MIN_SCALE = 1e-12
OUT_DTYPES = mm.OUT_DTYPES


# --------------------------------------------------------------------------
# Quantization


def _operand(x, what: str, ndim: tuple[int, ...]):
  if getattr(x, "ndim", None) not in ndim or 0 in x.shape:
    raise ValueError(f"{what} must be a non-empty {' or '.join(f'{n}-D' for n in ndim)} array; "
                     f"got shape {jnp.shape(x)}")
  return jnp.asarray(x, jnp.float32)


def quantize_weight(w):
  """w [..., K, N] (the models' [in, out] layout, any float dtype) ->
  (w_q [..., N, K] float8_e4m3fn, w_scale [..., N] float32), per output channel."""
  w = jnp.swapaxes(_operand(w, "quantize_weight's w [..., K, N]", (2, 3, 4)), -1, -2)
  scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-1) / FP8_MAX, MIN_SCALE)
  return (w / scale[..., None]).astype(FP8), scale


def quantize_rows(x, rms_eps: float | None = None, scale_ub: float | None = None):
  """x [M, K] -> (x_q [M, K] float8_e4m3fn, x_scale [M] float32), per row
  (dynamic, per token). ``rms_eps``: the scale also carries each row's
  RMSNorm factor rsqrt(mean(x**2) + eps), so x_q * x_scale is rms_rows(x).
  ``scale_ub``: an upper bound on a row's amax (fbgemm's and vLLM's
  ``input_scale_ub``; of the normalized row with ``rms_eps``): a row with
  larger values saturates at fp8's 448 rather than widen its scale."""
  x = _operand(x, "quantize_rows' x [M, K]", (2,))
  amax = jnp.max(jnp.abs(x), axis=-1)
  if rms_eps is not None:
    r = lax.rsqrt(jnp.mean(x * x, axis=-1) + rms_eps)
  if scale_ub is not None:
    if not (isinstance(scale_ub, (int, float)) and 0 < scale_ub < float("inf")):
      raise ValueError(f"{scale_ub=} must be a positive finite number")
    amax = jnp.minimum(amax, scale_ub if rms_eps is None else scale_ub / r)
  scale = jnp.maximum(amax / FP8_MAX, MIN_SCALE)
  q = x / scale[:, None]
  if scale_ub is not None:
    q = jnp.clip(q, -FP8_MAX, FP8_MAX)  # (fp8 has no inf: a larger value would cast to NaN)
  q = q.astype(FP8)
  if rms_eps is not None:
    scale = scale * r
  return q, scale


def quantize_rows_static(x, scale):
  """x [M, K] -> (x_q float8_e4m3fn, x_scale [M] float32) with one given
  scale for every row (a checkpoint's static per-tensor input scale):
  values past 448 * scale saturate."""
  x = _operand(x, "quantize_rows_static's x [M, K]", (2,))
  scale = jnp.asarray(scale, jnp.float32)
  if scale.shape != ():
    raise ValueError(f"quantize_rows_static's scale must be a scalar; got shape {scale.shape}")
  q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8)
  return q, jnp.broadcast_to(scale, x.shape[:1])


def dequantize_weight(w_q, w_scale):
  """Inverse of ``quantize_weight`` up to rounding: [..., K, N] float32."""
  return jnp.swapaxes(w_q.astype(jnp.float32) * w_scale[..., None], -1, -2)


# --------------------------------------------------------------------------
# Checks


def _layer_view(w, w_scale, bias, layer):
  """One layer's (w, w_scale, bias) for the checks: with ``layer``, w is a
  [L, N, K] stack, w_scale and bias [L, N]."""
  if layer is None:
    return w, w_scale, bias
  if getattr(w, "ndim", None) != 3:
    raise ValueError(f"with layer=, w must be a [L, N, K] stack; got {jnp.shape(w)=}")
  dsl.check_layer(layer, w.shape[0])
  for name, x in (("w_scale", w_scale), ("bias", bias)):
    if x is not None and (getattr(x, "ndim", None) != 2 or x.shape[0] != w.shape[0]):
      raise ValueError(f"with layer=, {name} must be [L, N] with L={w.shape[0]}; "
                       f"got {jnp.shape(x)}")
  one = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return one(w), one(w_scale), one(bias)


def _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer):
  """Shapes and dtypes every backend accepts; returns the output dtype."""
  w, w_scale, bias = _layer_view(w, w_scale, bias, layer)
  if getattr(a, "ndim", None) != 2 or getattr(w, "ndim", None) != 2:
    raise ValueError(f"matmul_fp8 needs 2D a[M, K] and w[N, K]; got {jnp.shape(a)=}, "
                     f"{jnp.shape(w)=}")
  if a.dtype != FP8 or w.dtype != FP8:
    raise ValueError(f"a and w must be {FP8.name} (quantize_rows / quantize_weight); "
                     f"got {a.dtype=}, {w.dtype=}")
  m, k = a.shape
  n, k2 = w.shape
  if k != k2:
    raise ValueError(f"contracting dims differ: a is [M, K]={a.shape}, w is [N, K]={w.shape}")
  if min(m, n, k) < 1:
    raise ValueError(f"empty matmul is not supported: {a.shape=} {w.shape=}")
  for name, x, size in (("a_scale", a_scale, m), ("w_scale", w_scale, n)):
    if x is None:
      raise ValueError(f"{name}= is required (float32 [{size}]; see quantize_rows / "
                       "quantize_weight)")
    if getattr(x, "dtype", None) != jnp.float32 or tuple(x.shape) != (size,):
      raise ValueError(f"{name} must be float32 [{size}]; got "
                       f"{getattr(x, 'dtype', type(x).__name__)} {jnp.shape(x)}")
  mm.check_epilogue(m, n, bias, residual, activation)
  out_dtype = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
  if out_dtype.name not in OUT_DTYPES:
    raise ValueError(f"{out_dtype=} must be one of {OUT_DTYPES}")
  return out_dtype


def _valid(a, w, *, a_scale=None, w_scale=None, bias=None, residual=None, out_dtype=None,
           activation=None, layer=None, config=None) -> str | None:
  if config is not None:
    return f"config= applies to the mosaic backend only; got {config=}"
  try:
    _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer)
  except ValueError as e:
    return str(e)
  return None


def _mosaic_why_not(a, w, *, a_scale=None, w_scale=None, bias=None, residual=None, out_dtype=None,
                    activation=None, layer=None, config=None) -> str | None:
  try:
    out_dtype = _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer)
  except ValueError as e:
    return str(e)
  w, _, bias = _layer_view(w, w_scale, bias, layer)
  kind = target_lib.current().kind
  if kind not in ("hopper", "cpu"):
    return (f"the fp8 kernel runs Hopper's fp8 wgmma; this device is {kind} (the Blackwell "
            "kernel has no fp8 path yet)")
  m, k = a.shape
  n = w.shape[0]
  if (n * out_dtype.itemsize) % 16:
    return f"N={n} x {out_dtype.itemsize} bytes is not a multiple of 16 bytes (TMA row alignment)"
  if m >= 8 and m % 8:
    return f"M={m} must be below 8 or a multiple of 8 (TMA tiles rows by 8)"
  # K blocks are 128 bytes (fp8's wgmma swizzle); N tiles by 64 as in bf16.
  if k % 128:
    return f"K={k} must be a multiple of 128 (one 128-byte fp8 K block)"
  if n % 64:
    return f"N={n} must be a multiple of 64 (TMA tiles of 64 elements)"
  if residual is not None and residual.dtype != out_dtype:
    return f"{residual.dtype=} must equal the output dtype {out_dtype}"
  if isinstance(config, mm.Config):
    if config.tile_k < 128:
      return f"{config.tile_k=} must be >= 128 for fp8 (a 128-byte swizzled K block)"
    if activation == "swiglu":
      return mm._swiglu_tile_error(config, k)
  elif config is not None:
    return f"config must be a matmul.Config; got {config=}"
  return None


# --------------------------------------------------------------------------
# Public wrapper


def matmul_fp8_mosaic(a, w, *, a_scale, w_scale, bias=None, residual=None, out_dtype=None,
                      activation=None, layer=None, config: mm.Config | None = None):
  """The Hopper kernel with fp8 operands; ``config`` overrides the tuning
  table (op ``matmul``, dtype float8_e4m3fn) / heuristic."""
  why = _mosaic_why_not(a, w, a_scale=a_scale, w_scale=w_scale, bias=bias, residual=residual,
                        out_dtype=out_dtype, activation=activation, layer=layer, config=config)
  if why is not None:
    raise ValueError(f"matmul_fp8 mosaic: {why}")
  out_dtype = _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer)
  m, k = a.shape
  n = w.shape[-2]
  swiglu = activation == "swiglu"
  res = residual is not None
  cfg = config or mm.fit_smem(mm.pick_config(m, n, k, FP8, activation), 1,
                              out_dtype.itemsize, swiglu=swiglu, residual=res)
  need = cfg.smem_bytes(1, out_dtype.itemsize, swiglu=swiglu, residual=res)
  if need > mm.SMEM_LIMIT:
    raise ValueError(f"{cfg=} needs {need} bytes of SMEM > {mm.SMEM_LIMIT}")
  if swiglu and (why := mm._swiglu_tile_error(cfg, k)):
    raise ValueError(f"matmul_fp8 mosaic: {why}")
  return mm._run(a, w, bias, residual, layer, (a_scale, w_scale), cfg=cfg, out_dtype=out_dtype,
                 activation=activation)


def _take(w, w_scale, bias, layer):
  if layer is None:
    return w, w_scale, bias
  return tuple(dsl.take_layer(x, layer) for x in (w, w_scale, bias))


@functools.partial(jax.jit, static_argnames=("out_dtype", "activation"))
def _xla(a, w, a_scale, w_scale, bias, residual, out_dtype, activation):
  acc = lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  acc = acc * a_scale[:, None] * w_scale[None, :]
  return mm._epilogue(acc, bias, residual, out_dtype, activation)


def matmul_fp8_xla(a, w, *, a_scale, w_scale, bias=None, residual=None, out_dtype=None,
                   activation=None, layer=None):
  """The fp8 dot through XLA (cuBLAS on a GPU), scales and epilogue fused by XLA."""
  out_dtype = _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer)
  w, w_scale, bias = _take(w, w_scale, bias, layer)
  return _xla(a, w, a_scale, w_scale, bias, residual, out_dtype, activation)


# --------------------------------------------------------------------------
# Reference


def matmul_fp8_reference(a, w, *, a_scale, w_scale, bias=None, residual=None, out_dtype=None,
                         activation=None, layer=None):
  """The meaning of the op: the dequantized operands' product in float32
  (returned in float32)."""
  _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer)
  w, w_scale, bias = _take(w, w_scale, bias, layer)
  a32 = a.astype(jnp.float32) * a_scale[:, None]
  w32 = w.astype(jnp.float32) * w_scale[:, None]
  out = jnp.dot(a32, w32.T, precision=lax.Precision.HIGHEST)
  return mm._epilogue(out, bias, residual, jnp.float32, activation)


def _reference_backend(a, w, *, a_scale, w_scale, bias=None, residual=None, out_dtype=None,
                       activation=None, layer=None):
  out_dtype = _check(a, w, a_scale, w_scale, bias, residual, out_dtype, activation, layer)
  return matmul_fp8_reference(a, w, a_scale=a_scale, w_scale=w_scale, bias=bias,
                              residual=residual, activation=activation,
                              layer=layer).astype(out_dtype)


# --------------------------------------------------------------------------
# Registration

_op = registry.op(OP, "act((a[M,K] @ w[N,K]^T) * a_scale[M,1] * w_scale[1,N] (+ bias[N])) "
                      "(+ residual), a and w float8_e4m3fn, fp32 accumulation; act: none or "
                      "swiglu; with layer=, w is a [L, N, K] stack (w_scale, bias [L, N])")
_op.register("mosaic", matmul_fp8_mosaic, supports=_mosaic_why_not,
             doc="Hopper fp8 wgmma (kernels/matmul.py's kernel), scales in the epilogue")
_op.register("xla", matmul_fp8_xla, supports=_valid,
             doc="fp8 dot_general with fp32 accumulation (cuBLAS on GPU), scales in XLA")
_op.register("reference", _reference_backend, supports=_valid, doc="float32 jnp")
_op.set_defaults(hopper=("mosaic", "xla"), blackwell=("xla",), cpu=("xla", "reference"),
                 default=("xla", "reference"))
