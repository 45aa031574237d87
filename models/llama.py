"""The Llama-family decoder (Llama 3, Mistral, Qwen2, SmolLM2) in Flax NNX.

Data flow of one step, top to bottom::

  tokens [B, T] --embed--> x [B, T, D]
  for each layer (a lax.fori_loop over the layer index, unrolled for one-token
  decode steps; the KV cache in the carry so its pages are updated in place;
  the ops read the layer's weights from the stacked parameters in place, so
  every iteration uses the same buffers):
    h = rms_norm(x)   (with folded norms: inside the next matmul, see below)
    q [B,T,Hq,hd], k/v [B,T,Hkv,hd] = h @ wqkv (+ bias for Qwen2), split; RoPE on q, k
    k/v are written into their pages: cache[layer, :, page, slot]
    o = attention: a fresh prefill (no cached prefix) attends within its chunk
        (plain causal attention_prefill); a chunk on top of a cached prefix
        gathers the row's pages and masks by position/segment ids; decode calls
        attention_decode on the layer's pages in place (sliding-window models
        use the masked attention_prefill, which knows windows)
        (one-token decode steps: RoPE, the k/v write and attention are one op,
        attention_decode_append, one kernel with mosaic; see below)
    x = o @ wo + x    (x in float32 with residual_dtype="float32": the adds in
                      float32, h and every matmul input in the weights' dtype)
    a = silu(g) * u with g, u = rms_norm(x) @ w_gate_up (one matmul, the gate
        fused into its epilogue); x = a @ w_down + x
  logits = rms_norm(x) @ lm_head   (lm_head = embed.T when tied), float32

Folded norms (``Llama(norms_folded=True)``, what ``models.Model`` builds):
each layer's two RMSNorm weights are folded into the rows of wqkv and
w_gate_up (``fold_norm_weights``; the norms' weights become 1), and those
matmuls normalize their input rows themselves (``matmul(..., rms_eps=)``): at
decode the swapped-operand kernel computes the rows' scale from the a blocks
it streams anyway, so the layer has no norm kernels. The function is the
same up to rounding the folded weights to their dtype.

Decode append (``Llama(decode_append=True)``, the default): a decode step of
one token a sequence hands the un-rotated q/k/v rows [B, 1, Hkv, G + 2, hd]
and a RoPE table (built once a step) to ``attention_decode_append``, which
rotates q and k, writes k and v into their page slot and attends, when the
backend attention_decode would run has it (mosaic with bf16/f16 pages and
hd % 128 == 0; xla; reference). Otherwise, and for Tq > 1, the separate ops
run. On the H200 this took 0.06 ms off the batch-1 step and 0.08 ms off the
batch-64 one (bench/results/decode_append_h200/).

Decode unroll (``Llama(decode_unroll=None)``, the default): a one-token
decode step runs its layers unrolled, with no loop. XLA records each loop
iteration as a command buffer; between two launches the GPU idled ~2.5 us and
the counter's add was a ~1.6 us kernel, ~4 us a layer. Unrolled, the batch-1
step traced 0.13 ms shorter, and with 8 decode steps a call TPOT at
concurrency 1 fell from 4.16 to 4.05 ms end to end. With one step a call the
gain is 0.02-0.05 ms: that call's launch takes ~3x longer
(bench/results/decode_unroll_h200/). The price is compile time (warm-up 159 s
against 130); prefill and mixed steps keep the loop.

RMSNorm, every matmul and the attention go through the ``mosaic.registry`` ops
(``rms_norm``, ``matmul``, ``matmul_fp8``, ``attention_prefill``,
``attention_decode``, ``attention_decode_append``), so the backend of each is
a name chosen by the caller. models/jitted.py jits each step of this module
(prefill, decode, mixed: decode rows and prefill chunks sharing one pass over
the weights) with the backend names as static arguments and the cache
donated; with a mesh, under shard_map over axis 'tp' (models/sharding.py:
heads and FFN features split, one all-reduce after wo and one after w_down,
the vocabulary all-gathered), so every kernel sees local shapes.

The paged KV cache is models/kv_cache.py's ``KVCache``: decode attention
reads its pages (bf16 or fp8) in place; chunks that attend a cached prefix
gather the pages and widen them to the model's dtype first. RoPE is
models/rope.py.

Weights are stored [in_features, out_features]; stacked layer weights carry a
leading [num_layers] axis.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.matmul import SWIGLU_BLOCK, fold_rms_weight
from kernels.matmul_fp8 import FP8_MAX, quantize_rows, quantize_rows_static, quantize_weight
from models import kv_cache, sharding
from models.config import FFN_BLOCK, ModelConfig
from models.kv_cache import KVCache
from models.rope import model_rope, rotate
from mosaic import registry

assert SWIGLU_BLOCK == FFN_BLOCK, "models.config.FFN_BLOCK must be kernels.matmul.SWIGLU_BLOCK"

OPS = ("rms_norm", "matmul", "attention_prefill", "attention_decode")  # chosen by backend flags
# Weight quantizations of the layers' linears (None: the model's dtype). fp8:
# W8A8, per-channel weight and per-token activation scales (kernels/matmul_fp8.py).
QUANTIZATIONS = (None, "fp8")


@dataclasses.dataclass(frozen=True)
class ActivationScales:
  """How an fp8 linear scales its input rows. Dynamic (the default): each
  row's amax maps to 448, the amax bounded by ``ub`` when set (an
  fbgemm_fp8 checkpoint's activation_scale_ub). ``static``: one scale per
  linear and layer, the param ``in_scale`` (a compressed-tensors
  checkpoint's static per-tensor ``input_scale``)."""
  static: bool = False
  ub: float | None = None

  def __post_init__(self):
    if not isinstance(self.static, bool):
      raise ValueError(f"ActivationScales.static={self.static!r} must be a bool")
    if self.ub is None:
      return
    if self.static:
      raise ValueError(f"ActivationScales: ub={self.ub!r} bounds dynamic scales; static ones "
                       "have none")
    if (isinstance(self.ub, bool) or not isinstance(self.ub, (int, float))
        or not 0 < self.ub < float("inf")):
      raise ValueError(f"ActivationScales.ub={self.ub!r} must be a positive finite number")


def check_quantization(quantization, activation_scales=None) -> None:
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization={quantization!r} is not supported; use one of "
                     f"{[q for q in QUANTIZATIONS if q]} (or None)")
  if activation_scales is None:
    return
  if not isinstance(activation_scales, ActivationScales):
    raise ValueError(f"activation_scales={activation_scales!r} must be a "
                     "models.llama.ActivationScales or None")
  if quantization != "fp8":
    raise ValueError(f"activation_scales={activation_scales!r} applies to fp8 linears only; "
                     f"quantization={quantization!r}")

# Runs attention_decode's backend where it has it (``_append_backend``).
APPEND_OP = "attention_decode_append"
# The fp8 linears' op (Linear with quantization="fp8"); --matmul-backend names it too.
FP8_OP = "matmul_fp8"


def _load_ops():
  """Imports the op modules, which register their backends."""
  import importlib

  names = OPS + (APPEND_OP, FP8_OP)
  # attention_prefill_fp8 adds attention_prefill's "mosaic_fp8" backend.
  for name in names + ("attention_prefill_fp8",):
    importlib.import_module(f"kernels.{name}")
  return {name: registry.get_op(name) for name in names}


@functools.cache
def ops():
  return _load_ops()


# ---------------------------------------------------------------- modules


def _init(rngs, shape, dtype, fan_in):
  return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype)


# Set while tracing the layer loop's body: the layer index (an int32 scalar).
# The blocks' parameters are then their whole [num_layers, ...] stacks, which
# the matmul and rms_norm ops index in place (``layer=``): every iteration of
# the loop hands its kernels the same buffers, so XLA replays the recorded
# command buffer of an iteration instead of recording it again for each layer.
_LAYER: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("layer", default=None)


class Linear(nnx.Module):
  """y = x @ w (+ b) (+ residual) through the ``matmul`` op; w is [in, out].

  With ``quantization="fp8"`` the weight is w_q [out, in] float8_e4m3fn and
  w_scale [out] (``quantize_params``), and each call quantizes its input rows
  (one XLA fusion, which also applies a folded norm's row scale) and runs the
  ``matmul_fp8`` op (W8A8 on fp8 tensor cores). ``activation_scales``: how
  the input rows are scaled (``ActivationScales``; static ones add the param
  in_scale).

  Under tensor parallelism a ``row_parallel`` layer (wo, w_down: input
  features split) yields partial sums: they are summed over 'tp' before the
  residual is added; a column-parallel one (q/k/v, gate/up) needs nothing.
  """

  def __init__(self, din: int, dout: int, *, bias: bool = False, dtype, rngs: nnx.Rngs,
               quantization: str | None = None,
               activation_scales: ActivationScales | None = None):
    check_quantization(quantization, activation_scales)
    self.quantized = quantization == "fp8"
    self.activation_ub = activation_scales.ub if activation_scales else None
    static = activation_scales is not None and activation_scales.static
    self.in_scale = nnx.Param(jnp.ones((), jnp.float32)) if static else None
    if self.quantized:
      w_q, w_scale = quantize_weight(_init(rngs, (din, dout), dtype, din))
      self.w_q, self.w_scale = nnx.Param(w_q), nnx.Param(w_scale)
    else:
      self.w = nnx.Param(_init(rngs, (din, dout), dtype, din))
    self.b = nnx.Param(_init(rngs, (dout,), dtype, 1.0) * 0.1) if bias else None

  def _matmul(self, a, *, residual=None, out_dtype=None, activation=None, layer=None,
              rms_eps=None, bias=True):
    """The op call on 2-D rows a [M, K]."""
    b = None if self.b is None or not bias else self.b[...]
    if not self.quantized:
      return ops()["matmul"](a, self.w[...], bias=b, residual=residual, out_dtype=out_dtype,
                             activation=activation, layer=layer,
                             **({} if rms_eps is None else dict(rms_eps=rms_eps)))
    with jax.named_scope("quantize"):
      if self.in_scale is None:
        a_q, a_scale = quantize_rows(a, rms_eps, self.activation_ub)
      elif rms_eps is not None:
        # (Static scales come from checkpoints, which keep their norms apart.)
        raise ValueError("a static input scale applies to the norm's output; build the "
                         "model with fold_norms=False")
      else:
        a_q, a_scale = quantize_rows_static(a, _layer_param(self.in_scale[...], layer))
    return ops()[FP8_OP](a_q, self.w_q[...], a_scale=a_scale, w_scale=self.w_scale[...],
                         bias=b, residual=residual, out_dtype=out_dtype or a.dtype,
                         activation=activation, layer=layer, backend=fp8_backend())

  def __call__(self, x, *, residual=None, out_dtype=None, row_parallel=False, activation=None,
               rms_eps=None):
    """``rms_eps``: x's rows are RMS-normalized first (the norm's weight is in w)."""
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])  # matmul is 2-D: [M = B*T, K]
    r = None if residual is None else residual.reshape(a.shape[0], -1)
    axis = sharding.tp_axis() if row_parallel else None
    layer = _LAYER.get()
    if axis is not None:
      y = self._matmul(a, out_dtype=jnp.float32, layer=layer, bias=False)
      with jax.named_scope("all_reduce"):  # a row of its own in profiles (serving.profiler)
        y = jax.lax.psum(y, axis)
      if self.b is not None:  # replicated: added once, after the sum
        y = y + _layer_param(self.b[...], layer).astype(jnp.float32)
      if r is not None:
        y = y + r.astype(jnp.float32)
      y = y.astype(out_dtype or x.dtype)
      return y.reshape(*lead, y.shape[-1])
    y = self._matmul(a, residual=r, out_dtype=out_dtype, activation=activation, layer=layer,
                     rms_eps=rms_eps)
    # The float32 reference backends may hand back float32: keep the model dtype.
    y = y.astype(out_dtype or x.dtype)
    return y.reshape(*lead, y.shape[-1])


def fp8_backend() -> str | None:
  """The fp8 op's backend: its own explicit choice (``registry.use``,
  MOSAIC_BACKEND_MATMUL_FP8), else the matmul's (--matmul-backend), else
  None (its default order). The jitted steps fix both in their key
  (``backends``)."""
  own = registry.get_op(FP8_OP).explicit_choice(None)
  if own is not None:
    return own
  name = registry.get_op("matmul").explicit_choice(None)
  return name if name is not None and name in registry.get_op(FP8_OP).names else None


def _layer_param(p, layer):
  """A stacked [num_layers, ...] parameter's entry for ``layer`` (inside the
  layer loop), or ``p`` itself outside it."""
  return p if layer is None else jnp.take(p, layer, axis=0)


def head_rms_norm(x, w, eps):
  """RMSNorm over the last axis (head_dim) in float32, as transformers'
  Qwen3RMSNorm: normalized, cast back, then times the weight."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * w.astype(x.dtype)


# hidden_act -> act(gate) in float32 (transformers' ACT2FN names).
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
}


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, dtype):
    self.w = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    return ops()["rms_norm"](x, self.w[...], eps=self.eps, layer=_LAYER.get()).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, quantization=None,
               activation_scales=None):
    d, hd = cfg.hidden_size, cfg.head_dim
    q = dict(quantization=quantization, activation_scales=activation_scales)
    self.cfg = cfg
    # One matmul for q, k and v. Columns are grouped by kv head: [Hkv, G + 2, hd]
    # holds each kv head's G query heads, then its k, then its v, so an even
    # split of the columns over 'tp' gives each device whole groups.
    self.wqkv = Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=cfg.qkv_bias,
                       dtype=dtype, rngs=rngs, **q)
    self.wo = Linear(cfg.num_heads * hd, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs, **q)
    # Qwen3: RMSNorm weights over head_dim for q and k (applied before RoPE).
    self.q_norm = nnx.Param(jnp.ones((hd,), dtype)) if cfg.qk_norm else None
    self.k_norm = nnx.Param(jnp.ones((hd,), dtype)) if cfg.qk_norm else None

  def qkv_packed(self, h, rms_eps=None):
    """h [B, T, D] -> [B, T, Hkv, G + 2, hd]: each kv head's G query heads,
    then its k, then its v, before RoPE; ``rms_eps``: h is the raw residual
    stream, normalized inside the matmul (folded norms)."""
    b, t, _ = h.shape
    with jax.named_scope("qkv"):  # scopes name the ops in profiles (serving.profiler)
      # -1 kv heads: all of them, or this device's shard under tensor parallelism.
      y = self.wqkv(h, rms_eps=rms_eps)
      y = y.reshape(b, t, -1, self.cfg.q_per_kv + 2, self.cfg.head_dim)
    if self.q_norm is not None:
      with jax.named_scope("qk_norm"):
        layer, g, eps = _LAYER.get(), self.cfg.q_per_kv, self.cfg.rms_norm_eps
        q = head_rms_norm(y[:, :, :, :g], _layer_param(self.q_norm[...], layer), eps)
        k = head_rms_norm(y[:, :, :, g:g + 1], _layer_param(self.k_norm[...], layer), eps)
        y = jnp.concatenate([q, k, y[:, :, :, g + 1:]], axis=3)
    return y

  def qkv(self, h, rope, rms_eps=None):
    """h [B, T, D] -> q [B, T, Hq, hd], k/v [B, T, Hkv, hd]; RoPE applied with
    ``rope`` = rope_angles(positions, inv_freq)."""
    b, t, _ = h.shape
    g = self.cfg.q_per_kv
    y = self.qkv_packed(h, rms_eps)
    with jax.named_scope("qkv"):
      q = y[:, :, :, :g].reshape(b, t, -1, self.cfg.head_dim)  # head h = kv head h // G
      k, v = y[:, :, :, g], y[:, :, :, g + 1]
    with jax.named_scope("rope"):
      return rotate(q, *rope), rotate(k, *rope), v


class MLP(nnx.Module):
  """Gated MLP: (act(h @ w_gate) * (h @ w_up)) @ w_down, gate and up in one
  matmul, which applies SiLU's gate in its epilogue (other activations run on
  its output). Its columns come in blocks of SWIGLU_BLOCK gate features
  followed by the same up features (kernels.matmul.swiglu_columns); a 'tp'
  split keeps blocks whole. F is ``cfg.ffn_size``: intermediate_size padded
  with zero features up to whole blocks."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, quantization=None,
               activation_scales=None):
    d, f = cfg.hidden_size, cfg.ffn_size
    q = dict(quantization=quantization, activation_scales=activation_scales)
    self.act = cfg.hidden_act
    self.w_gate_up = Linear(d, 2 * f, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs, **q)
    self.w_down = Linear(f, d, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs, **q)

  def __call__(self, h, residual, rms_eps=None):
    with jax.named_scope("gate_up"):
      if self.act in ("silu", "swish"):
        act = self.w_gate_up(h, activation="swiglu", rms_eps=rms_eps)  # [..., F]
      else:
        y = self.w_gate_up(h, rms_eps=rms_eps, out_dtype=jnp.float32)  # [..., 2F]
        y = y.reshape(*y.shape[:-1], -1, 2, SWIGLU_BLOCK)
        act = ACTIVATIONS[self.act](y[..., 0, :]) * y[..., 1, :]
        act = act.reshape(*act.shape[:-2], -1).astype(h.dtype)
    with jax.named_scope("down"):
      return self.w_down(act, residual=residual, row_parallel=True, out_dtype=residual.dtype)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, quantization=None,
               activation_scales=None):
    q = dict(quantization=quantization, activation_scales=activation_scales)
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    self.attn = Attention(cfg, dtype=dtype, rngs=rngs, **q)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, **q)


class Llama(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype="bfloat16", rngs: nnx.Rngs,
               norms_folded: bool = False, decode_append: bool = True,
               decode_unroll: int | None = None, residual_dtype=None, quantization=None,
               activation_scales: ActivationScales | None = None):
    """``norms_folded``: the layers' norm weights are folded into wqkv and
    w_gate_up (``fold_norm_weights`` on the params), which then normalize.
    ``decode_append``: a one-token decode step rotates, writes the cache and
    attends in one op (attention_decode_append) where its backend has it.
    ``decode_unroll``: layers per iteration of a one-token decode step's
    layer loop (None: all of them, no loop; see _run_layers).
    ``residual_dtype``: the residual stream's dtype (None: ``dtype``). A
    float32 stream under bfloat16 weights adds every sublayer's output to it
    in float32 (the matmul epilogue's residual add) and rounds only the norms'
    outputs, the matmul inputs, to ``dtype``. The folded norms normalize the
    matmul's own a operand, which is ``dtype``, so the two exclude each other.
    ``quantization``: "fp8" makes the layers' linears W8A8 (``Linear``; the
    embedding and lm_head stay in ``dtype``); their params come from
    ``quantize_params``. ``activation_scales``: with fp8, how a linear's
    input rows are scaled (``ActivationScales``; None: dynamic, unbounded)."""
    if decode_unroll is not None and (isinstance(decode_unroll, bool)
                                      or not isinstance(decode_unroll, int)
                                      or decode_unroll < 1):
      raise ValueError(f"decode_unroll must be None or an int >= 1, got {decode_unroll!r}")
    dtype = jnp.dtype(dtype)
    residual_dtype = dtype if residual_dtype is None else jnp.dtype(residual_dtype)
    if residual_dtype.name not in ("bfloat16", "float16", "float32"):
      raise ValueError(f"residual_dtype={residual_dtype.name} is not supported; use bfloat16, "
                       "float16 or float32")
    if residual_dtype != dtype and norms_folded:
      raise ValueError(f"residual_dtype={residual_dtype.name} differs from dtype={dtype.name}: "
                       "the folded norms need the residual stream in the weights' dtype; "
                       "build with norms_folded=False")
    self.cfg = cfg
    self.dtype = dtype
    self.residual_dtype = residual_dtype
    self.norms_folded = norms_folded
    self.decode_append = decode_append
    self.decode_unroll = decode_unroll
    self.quantization = quantization
    self.activation_scales = activation_scales
    self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, 1.0))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(rngs):
      return Block(cfg, dtype=dtype, rngs=rngs, quantization=quantization,
                   activation_scales=activation_scales)

    self.layers = make_layers(rngs)  # every parameter has a leading [num_layers] axis
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    self.lm_head = (None if cfg.tie_embeddings
                    else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs))

  # -- pieces shared by prefill and decode

  def _row_logits(self, x, rows):
    """Logits [R, vocab] of x[rows] (x [N, D]). The lm_head matmul tiles rows
    by 8 (TMA): past 8 rows, the rows are padded with row 0 up to a multiple
    of 8 and those logits dropped."""
    r = rows.shape[0]
    m = r if r <= 8 else -(-r // 8) * 8
    rows = jnp.concatenate([rows, jnp.zeros((m - r,), rows.dtype)])
    return self._logits(jnp.take(x, rows, axis=0))[:r]

  def _logits(self, x):
    """x [..., D] -> [..., vocab] float32."""
    with jax.named_scope("final_norm"):
      h = self.final_norm(x).astype(self.dtype)
    with jax.named_scope("lm_head"):
      if self.lm_head is not None:
        y = self.lm_head(h, out_dtype=jnp.float32)
        axis = sharding.tp_axis()
        # Column-parallel: each device has a slice of the vocabulary.
        if axis is None:
          return y
        with jax.named_scope("all_gather"):
          return jax.lax.all_gather(y, axis, axis=y.ndim - 1, tiled=True)
      lead = h.shape[:-1]
      y = ops()["matmul"](h.reshape(-1, h.shape[-1]), self.embed[...].T, out_dtype=jnp.float32)
      return y.reshape(*lead, -1)

  def _run_layers(self, x, cache: KVCache, attend, unroll: int = 1):
    """Loops over the layer index; ``attend(block, h, k_cache, v_cache, layer, rms_eps,
    window)`` does the attention part (q/k/v, cache write, attention, output
    projection input) with the layer's sliding window (static; None: none).
    Layers whose windows differ (Qwen2's max_window_layers) run as one loop
    per run of equal windows (``ModelConfig.layer_runs``).

    The loop carries no parameters: ``block`` holds every layer's stacked
    parameters and the ops pick layer ``layer`` in place (see _LAYER).
    ``unroll`` layers run per loop iteration. XLA records an iteration as one
    command buffer; between two launches of it the GPU idles ~2.5 us, and the
    counter's add is a ~1.6 us kernel: ~4 us a layer, 3% of the B=1 decode
    step (bench/results/decode_unroll_h200/). Prefill's layers take
    milliseconds, so they keep the loop (and its compile time)."""
    block = self.layers
    # Folded norms: the raw residual stream goes to wqkv / w_gate_up, which
    # normalize it themselves.
    eps = self.cfg.rms_norm_eps if self.norms_folded else None
    norm = lambda f, x: x if eps is not None else f(x).astype(self.dtype)
    x = x.astype(self.residual_dtype)

    # The loop counter is the layer index: a scan over arange(L) would slice
    # its index out of an array each iteration, one more kernel per layer.
    def body(window, layer, carry):
      x, kc, vc = carry
      token = _LAYER.set(layer)
      try:
        with jax.named_scope("attn_norm"):
          h = norm(block.attn_norm, x)
        o, kc, vc = attend(block, h, kc, vc, layer, eps, window)
        with jax.named_scope("o_proj"):
          x = block.attn.wo(o, residual=x, row_parallel=True, out_dtype=x.dtype)
        with jax.named_scope("mlp_norm"):
          h = norm(block.mlp_norm, x)
        x = block.mlp(h, residual=x, rms_eps=eps)
      finally:
        _LAYER.reset(token)
      return x, kc, vc

    # The "layers" scope tells the profiler (serving.profiler.classify) which
    # ops run in a layer when no loop says so (unrolled).
    carry = (x, cache.k, cache.v)
    with jax.named_scope("layers"):
      for first, end, window in self.cfg.layer_runs():
        carry = jax.lax.fori_loop(first, end, functools.partial(body, window), carry,
                                  unroll=min(unroll, end - first))
    x, k, v = carry
    return x, KVCache(k, v)

  def _windows(self) -> tuple[int | None, ...]:
    """The distinct sliding windows of the layers (None: full attention)."""
    return tuple(dict.fromkeys(self.cfg.layer_windows()))

  # -- entry points (called inside jit by the functions below)

  def prefill(self, cache: KVCache, tokens, positions, lengths, page_table, *,
              all_logits: bool = False, fresh: bool = False):
    """tokens [B, T]; positions/lengths [B]; page_table [B, max_pages].

    Returns logits [B, vocab] at each row's last valid token (or [B, T, vocab]
    with all_logits) and the cache with this chunk's K/V written.

    ``fresh`` (static; the caller knows positions == 0 for every row): no row
    has a cached prefix, so each row attends to its own chunk with a plain
    causal mask (padding sits after the valid tokens, so valid queries never
    see it): no page gather, Skv = T, and backends without positions/segment
    ids (cuDNN) can run it.
    """
    cfg = self.cfg
    b, t = tokens.shape
    ps = cache.page_size
    tpos, valid, page, slot = kv_cache.chunk_slots(positions, lengths, t, page_table, ps)  # [B, T]
    with jax.named_scope("rope"):  # once per step: the profiler books it as rope
      rope = model_rope(cfg, tpos)
    chunk_attention = {w: self._chunk_attention(tpos, valid, positions + lengths, page_table,
                                                ps, fresh, w) for w in self._windows()}

    def attend(block, h, kc, vc, layer, rms_eps, window):
      q, k, v = block.attn.qkv(h, rope, rms_eps)
      kc, vc = kv_cache.write_kv(kc, vc, layer, page, slot, valid, k, v)
      with jax.named_scope("attention"):
        o = chunk_attention[window](q, k, v, kc, vc, layer)
      return o.reshape(b, t, -1).astype(h.dtype), kc, vc

    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]
    x, cache = self._run_layers(x, cache, attend)
    if not all_logits:
      last = jnp.maximum(lengths - 1, 0)
      x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, D]
    return self._logits(x), cache

  def prefill_packed(self, cache: KVCache, tokens, tpos, seg, last, page_table, *,
                     fresh: bool = True):
    """Prompt chunks packed into one row, without padding rows or chunk buckets.

    tokens/tpos/seg [N]: each token, its position in its sequence and its
    chunk's row + 1 (0: padding, which writes and sees nothing); last [R]:
    the index in N of each chunk's last token; page_table [R, W]. N is the
    chunks' total rounded up to a bucket, so ragged chunks cost their own
    tokens, not R x the longest one's bucket. Returns logits [R, vocab] at
    each row's last token and the cache.

    ``fresh`` (static; every chunk starts its prompt): attention is causal
    within each chunk (segment ids), over the packed row itself. Otherwise
    some row continues a prompt whose prefix is in the cache: each row's W
    pages are gathered (after this chunk's writes) and laid end to end,
    [R * W * page_size] keys, each row's live keys carrying its segment id, so
    a query block visits only its own row's keys.
    """
    n = tokens.shape[0]
    parts = {w: self._packed_parts(tpos, seg, page_table, cache.page_size, fresh, w)
             for w in self._windows()}
    page, slot, valid, _ = parts[self._windows()[0]]
    with jax.named_scope("rope"):
      rope = model_rope(self.cfg, tpos[None])

    def attend(block, h, kc, vc, layer, rms_eps, window):
      q, k, v = block.attn.qkv(h, rope, rms_eps)  # [1, N, H, hd]
      kc, vc = kv_cache.write_kv(kc, vc, layer, page[None], slot[None], valid[None], k, v)
      with jax.named_scope("attention"):
        o = parts[window][3](q, k, v, kc, vc, layer)
      return o.reshape(1, n, -1).astype(h.dtype), kc, vc

    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], tokens[None], axis=0)  # [1, N, D]
    x, cache = self._run_layers(x, cache, attend)
    return self._logits(jnp.take(x[0], last, axis=0)), cache  # [R, vocab]

  def _packed_parts(self, tpos, seg, page_table, ps: int, fresh: bool, window=None):
    """Of packed chunks (tpos/seg [N], page_table [R, W]): each token's K/V
    page and slot [N], whether it is real [N], and attend_kv(q, k, v, kc, vc,
    layer) over q/k/v [1, N, ...] (``prefill_packed`` says what it attends)."""
    n = tpos.shape[0]
    r, w = page_table.shape
    valid = seg > 0
    rows = page_table[jnp.maximum(seg - 1, 0)]  # each token's row's table [N, W]
    page, slot = (a.reshape(n) for a in kv_cache.page_slot(tpos[:, None], valid[:, None], rows, ps))
    q_masks = dict(q_positions=tpos[None], q_segment_ids=seg[None])
    if fresh:
      attention = self._prefill_attention(1, n, n, window, kv_positions=tpos[None],
                                          kv_segment_ids=seg[None], **q_masks)
      return page, slot, valid, lambda q, k, v, kc, vc, layer: attention(q, k, v)
    skv = w * ps
    kv_pos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (r, skv))
    # Keys each row holds after this chunk: its last token's position + 1.
    total = jnp.maximum(jax.ops.segment_max(jnp.where(valid, tpos + 1, 0), seg,
                                            num_segments=r + 1)[1:], 0)
    kv_seg = (kv_pos < total[:, None]) * jnp.arange(1, r + 1, dtype=jnp.int32)[:, None]
    attention = self._prefill_attention(1, n, r * skv, window, kv_positions=kv_pos.reshape(1, -1),
                                        kv_segment_ids=kv_seg.reshape(1, -1), **q_masks)

    def attend_kv(q, k, v, kc, vc, layer):
      kg, vg = kv_cache.gather_pages(kc, vc, layer, page_table, q.dtype)  # [R, W * ps, Hkv, hd]
      return attention(q, kg.reshape(1, r * skv, *kg.shape[2:]),
                       vg.reshape(1, r * skv, *vg.shape[2:]))

    return page, slot, valid, attend_kv

  def _attention_shapes(self, b, t, skv):
    """q [B, T, Hq, hd] and k/v [B, Skv, Hkv, hd] as shapes (for op.plan)."""
    cfg, dt = self.cfg, self.embed[...].dtype
    return (jax.ShapeDtypeStruct((b, t, cfg.num_heads, cfg.head_dim), dt),
            jax.ShapeDtypeStruct((b, skv, cfg.num_kv_heads, cfg.head_dim), dt))

  def _prefill_attention(self, b, t, skv, window=None, **kw):
    """attention(q, k, v) over [B, Skv] keys with the masks in ``kw`` and the
    sliding ``window`` (None: none). Its plan
    (the kernel's block ranges, from positions alone) is built here, once per
    step: built inside the layer loop, XLA's GPU pipeline keeps it there."""
    qa, ka = self._attention_shapes(b, t, skv)
    kw = dict(causal=True, sliding_window=window, **kw)
    plan = ops()["attention_prefill"].plan(qa, ka, ka, **kw)
    return lambda q, k, v: ops()["attention_prefill"](q, k, v, plan=plan, **kw)

  def _chunk_attention(self, tpos, valid, total, page_table, page_size: int, fresh: bool,
                       window=None):
    """attention(q, k, v, kc, vc, layer) of prefill chunks (tpos/valid [B, T],
    total [B] kv tokens after the chunk; k/v: the chunk's own, already written
    into kc/vc): within the chunk when ``fresh``, else over the row's gathered
    pages, masked by position and segment ids."""
    b, t = tpos.shape
    if fresh:
      attention = self._prefill_attention(b, t, t, window)
      return lambda q, k, v, kc, vc, layer: attention(q, k, v)
    skv = page_table.shape[1] * page_size
    kv_pos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv))
    attention = self._prefill_attention(
        b, t, skv, window, q_positions=tpos, kv_positions=kv_pos,
        q_segment_ids=valid.astype(jnp.int32),
        kv_segment_ids=(kv_pos < total[:, None]).astype(jnp.int32))

    def attend(q, k, v, kc, vc, layer):
      kg, vg = kv_cache.gather_pages(kc, vc, layer, page_table, q.dtype)  # [B, Skv, Hkv, hd]
      return attention(q, kg, vg)

    return attend

  def mixed(self, cache: KVCache, dec_tokens, dec_lengths, dec_table, tokens, positions,
            lengths, page_table, *, fresh: bool = False):
    """Decode rows and prefill chunks in one pass over the weights.

    dec_tokens [Bd] (one new token per row; dec_lengths [Bd] include it, 0 =
    padding row), dec_table [Bd, P]; the chunks as in ``prefill``. Their
    Bd + B*T tokens go through the norms and matmuls as one flat batch
    x [1, Bd + B*T, D], so each weight is read once for both; the K/V of all
    of them are written by one scatter per layer; attention runs per part
    (attention_decode on the decode rows' pages, the chunk attention of
    ``prefill`` on the chunks). Returns (logits [Bd + B, vocab]: the decode
    rows', then each chunk's at its last valid token; cache).
    """
    cfg = self.cfg
    if cfg.sliding_window is not None:
      raise NotImplementedError("mixed steps: sliding-window models decode through the masked "
                                "prefill attention; run prefill and decode apart")
    bd = dec_tokens.shape[0]
    b, t = tokens.shape
    ps = cache.page_size
    dpos = dec_lengths - 1  # [Bd]
    tpos, valid, page, slot = kv_cache.chunk_slots(positions, lengths, t, page_table, ps)  # [B, T]
    dpage, dslot = kv_cache.page_slot(dpos[:, None], (dpos >= 0)[:, None], dec_table, ps)  # [Bd, 1]
    flat = lambda d, p: jnp.concatenate([d.reshape(bd), p.reshape(b * t)])[None]  # [1, N]
    page, slot, valid_kv = flat(dpage, page), flat(dslot, slot), flat(dpos >= 0, valid)
    with jax.named_scope("rope"):
      rope = model_rope(cfg, flat(jnp.maximum(dpos, 0), tpos))
    chunk_attention = self._chunk_attention(tpos, valid, positions + lengths, page_table, ps,
                                           fresh)

    def attend(block, h, kc, vc, layer, rms_eps, window):
      del window  # None: sliding-window models are refused above
      q, k, v = block.attn.qkv(h, rope, rms_eps)  # [1, N, H, hd]
      kc, vc = kv_cache.write_kv(kc, vc, layer, page, slot, valid_kv, k, v)
      with jax.named_scope("attention"):
        od = ops()["attention_decode"](q[0, :bd, None], kc, vc, dec_lengths, dec_table,
                                       layer=layer)  # [Bd, 1, Hq, hd]
        split = lambda a: a[0, bd:].reshape(b, t, *a.shape[2:])
        op = chunk_attention(split(q), split(k), split(v), kc, vc, layer)  # [B, T, Hq, hd]
      o = jnp.concatenate([od.reshape(bd, -1), op.reshape(b * t, -1)])
      return o[None].astype(h.dtype), kc, vc

    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], flat(dec_tokens, tokens), axis=0)  # [1, N, D]
    x, cache = self._run_layers(x, cache, attend)
    last = bd + jnp.arange(b) * t + jnp.maximum(lengths - 1, 0)
    return self._row_logits(x[0], jnp.concatenate([jnp.arange(bd), last])), cache  # [Bd + B]

  def mixed_packed(self, cache: KVCache, dec_tokens, dec_lengths, dec_table, tokens, tpos, seg,
                   last, page_table, *, fresh: bool = False):
    """``mixed`` with the prompt chunks packed in one row, as in
    ``prefill_packed`` (tokens/tpos/seg [N], last [R], page_table [R, W]):
    x [1, Bd + N, D]. Returns (logits [Bd + R, vocab]: the decode rows',
    then each chunk's at its last token; cache)."""
    cfg = self.cfg
    if cfg.sliding_window is not None:
      raise NotImplementedError("mixed steps: sliding-window models decode through the masked "
                                "prefill attention; run prefill and decode apart")
    bd, n = dec_tokens.shape[0], tokens.shape[0]
    ps = cache.page_size
    dpos = dec_lengths - 1  # [Bd]
    page, slot, valid, attend_kv = self._packed_parts(tpos, seg, page_table, ps, fresh)
    dpage, dslot = kv_cache.page_slot(dpos[:, None], (dpos >= 0)[:, None], dec_table, ps)  # [Bd, 1]
    flat = lambda d, p: jnp.concatenate([d.reshape(bd), p])[None]  # [1, Bd + N]
    page, slot, valid_kv = flat(dpage, page), flat(dslot, slot), flat(dpos >= 0, valid)
    with jax.named_scope("rope"):
      rope = model_rope(cfg, flat(jnp.maximum(dpos, 0), tpos))

    def attend(block, h, kc, vc, layer, rms_eps, window):
      del window  # None: sliding-window models are refused above
      q, k, v = block.attn.qkv(h, rope, rms_eps)  # [1, Bd + N, H, hd]
      kc, vc = kv_cache.write_kv(kc, vc, layer, page, slot, valid_kv, k, v)
      with jax.named_scope("attention"):
        od = ops()["attention_decode"](q[0, :bd, None], kc, vc, dec_lengths, dec_table,
                                       layer=layer)  # [Bd, 1, Hq, hd]
        op = attend_kv(q[:, bd:], k[:, bd:], v[:, bd:], kc, vc, layer)  # [1, N, Hq, hd]
      o = jnp.concatenate([od.reshape(bd, -1), op.reshape(n, -1)])
      return o[None].astype(h.dtype), kc, vc

    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], flat(dec_tokens, tokens), axis=0)  # [1, Bd + N, D]
    x, cache = self._run_layers(x, cache, attend)
    return self._row_logits(x[0], jnp.concatenate([jnp.arange(bd), bd + last])), cache

  def decode(self, cache: KVCache, tokens, lengths, page_table):
    """tokens [B, Tq]; lengths [B] include the Tq new tokens -> logits [B, Tq, vocab]."""
    cfg = self.cfg
    b, tq = tokens.shape
    ps = cache.page_size
    tpos = lengths[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)  # [B, Tq]
    valid = tpos >= 0
    with jax.named_scope("rope"):
      rope = model_rope(cfg, jnp.maximum(tpos, 0))
    page, slot = kv_cache.page_slot(tpos, valid, page_table, ps)
    windowed = {}
    for w in self._windows():
      if w is None:
        continue
      # attention_decode has no window: the windowed layers read the pages
      # through the masked prefill attention instead (same positions rule).
      skv = page_table.shape[1] * ps
      kv_pos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv))
      windowed[w] = self._prefill_attention(
          b, tq, skv, w, q_positions=tpos, kv_positions=kv_pos,
          q_segment_ids=valid.astype(jnp.int32),
          kv_segment_ids=(kv_pos < lengths[:, None]).astype(jnp.int32))

    rope_tab = None
    if tq == 1 and None in self._windows() and self.decode_append:
      from kernels.attention_decode_append import rope_table

      with jax.named_scope("rope"):
        rope_tab = rope_table(*rope)  # once per step, like the angles

    def attend(block, h, kc, vc, layer, rms_eps, window):
      if rope_tab is not None and window is None:
        qkv = block.attn.qkv_packed(h, rms_eps)
        backend = _append_backend(qkv, kc, vc, lengths, page_table, rope_tab, layer)
        if backend is not None:
          with jax.named_scope("attention"):
            # RoPE, the K/V write and attention in one op (one kernel with mosaic).
            o, kc, vc = ops()["attention_decode_append"](
                qkv, kc, vc, lengths, page_table, rope_tab, layer=layer, backend=backend)
          return o.reshape(b, tq, -1).astype(h.dtype), kc, vc
      q, k, v = block.attn.qkv(h, rope, rms_eps)
      kc, vc = kv_cache.write_kv(kc, vc, layer, page, slot, valid, k, v)
      if window is None:
        with jax.named_scope("attention"):
          # layer=: the kernel reads this layer's pages from the stack in place
          # (slicing kc[layer] would copy the layer's whole cache every step).
          o = ops()["attention_decode"](q, kc, vc, lengths, page_table, layer=layer)
      else:
        o = windowed[window](q, *kv_cache.gather_pages(kc, vc, layer, page_table, q.dtype))
      return o.reshape(b, tq, -1).astype(h.dtype), kc, vc

    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], tokens, axis=0)  # [B, Tq, D]
    unroll = 1 if tq > 1 else self.decode_unroll or cfg.num_layers
    x, cache = self._run_layers(x, cache, attend, unroll=unroll)
    return self._logits(x), cache


def _append_backend(qkv, kc, vc, lengths, page_table, rope_tab, layer) -> str | None:
  """The attention_decode_append backend for a decode step: the one that
  attention_decode would run, if the append op has it and it takes the call
  (e.g. not triton; not mosaic with fp8 pages), else None (separate ops)."""
  b, t, hkv, gp2, d = qkv.shape
  q = jax.ShapeDtypeStruct((b, t, hkv * (gp2 - 2), d), qkv.dtype)
  name = ops()["attention_decode"].select(q, kc, vc, lengths, page_table, layer=layer).name
  append = ops()["attention_decode_append"]
  if name not in append.names:
    return None
  why = append.get(name).why_not(qkv, kc, vc, lengths, page_table, rope_tab, layer=layer)
  return name if why is None else None


# ---------------------------------------------------------------- folded norms


def fold_norm_weights(params):
  """A copy of the pure-dict ``params`` for ``Llama(norms_folded=True)``:
  each layer's attn_norm / mlp_norm weight multiplies the rows of wqkv /
  w_gate_up, and the norm weights become 1. Idempotent (folding 1s changes
  nothing), so a folded checkpoint loads the same either way."""
  layers = dict(params["layers"])
  for norm, owner, lin in (("attn_norm", "attn", "wqkv"), ("mlp_norm", "mlp", "w_gate_up")):
    g = layers[norm]["w"]
    sub = dict(layers[owner])
    sub[lin] = dict(sub[lin], w=_fold(g, sub[lin]["w"]))
    layers[owner] = sub
    layers[norm] = dict(layers[norm], w=jnp.ones_like(g))
  return dict(params, layers=layers)


@jax.jit
def _fold(g, w):
  return fold_rms_weight(g, w)  # one fused elementwise kernel: no float32 copy of w


# ---------------------------------------------------------------- fp8 weights

QUANTIZED_LINEARS = (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down"))


def quantize_params(params, quantization: str | None):
  """A copy of the pure-dict ``params`` (after ``fold_norm_weights``) for
  ``Llama(quantization=...)``: each layer linear's w [L, in, out] becomes
  w_q [L, out, in] float8_e4m3fn and w_scale [L, out] (per output channel).
  The embedding, the norms, the biases, static input scales (in_scale) and
  lm_head are kept. A linear that already has a w_scale [L, out] (an fp8
  checkpoint's, its w the dequantized fp8 values) is quantized with it, so
  the checkpoint's fp8 values come back as written."""
  check_quantization(quantization)
  if quantization is None:
    return params
  layers = dict(params["layers"])
  for owner, lin in QUANTIZED_LINEARS:
    sub = dict(layers[owner])
    p = dict(sub[lin])
    if "w_scale" in p:
      p["w_q"], p["w_scale"] = _quantize_with(p.pop("w"), p["w_scale"])
    else:
      p["w_q"], p["w_scale"] = _quantize(p.pop("w"))
    sub[lin] = p
    layers[owner] = sub
  return dict(params, layers=layers)


@jax.jit
def _quantize_with(w, scale):
  # A zero scale is a padded FFN feature (its weights are zero).
  scale = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
  q = jnp.clip(w.astype(jnp.float32) / scale[..., None, :], -FP8_MAX, FP8_MAX)
  return jnp.swapaxes(q, -1, -2).astype(jnp.float8_e4m3fn), scale


@jax.jit
def _quantize(w):
  # Jitted so XLA fuses the float32 steps (not a float32 copy per step; on
  # XLA:CPU the transpose still holds one float32 temporary of the stack).
  return quantize_weight(w)


