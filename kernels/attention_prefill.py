"""Prefill attention: o = softmax(q k^T * sm_scale + mask) v, with GQA.

Shapes: q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D]; query head h reads kv head
h // (Hq // Hkv), so K/V are never repeated. Query i may see key j iff their
segment ids are equal and non-zero (when given), kv_pos[j] <= q_pos[i] when
causal, and q_pos[i] - kv_pos[j] < sliding_window when a window is set. By
default the queries are the last Sq tokens of the kv sequence
(q_pos = arange(Sq) + Skv - Sq): a cached prefix plus themselves. A query row
that sees no key outputs 0. With return_lse the natural-log log-sum-exp of
the scaled scores comes back too, float32 [B, Hq, Sq] (-inf for such rows).

Every backend but cuDNN reduces the mask to four int32 vectors (q_pos, q_seg,
kv_pos, kv_seg) plus, per query block, the range of kv blocks that can hold a
visible key (``_block_ranges``). The tiled kernels only visit that range,
which is how causal block skipping, sliding windows and packed ragged batches
(B = 1, one segment per sequence) cost only the visible blocks. Padding added
to reach a block multiple gets segment 0 (never visible). The mosaic backend's
ranges and padded vectors are its plan (``MosaicPlan``): ``op.plan(q, k, v,
**masks)`` builds it from shapes and positions, and calls that pass
``plan=`` skip that work, so a model builds it once per step, not per layer.

Data flow of the Mosaic GPU kernel (``_mosaic_kernel``), FlashAttention-3
style: one CTA owns 2 * block_q query rows of one head. Warpgroup 2 is the
producer: it streams K, V and the kv position/segment vectors by TMA through
a ``stages``-deep SMEM ring. Warpgroups 0 and 1 are consumers, each owning a
block_q query tile held in SMEM: QK^T by wgmma into an fp32 accumulator,
online softmax in registers with exp2 and the scale folded in, P (bf16/fp16)
from registers times V by wgmma; a ping-pong barrier lets one consumer's
softmax overlap the other's wgmma. With ``overlap`` a consumer also overlaps
itself: it issues QK^T of block j and P V of block j - 1 together and runs
block j's softmax while the second wgmma is in flight. Blocks fully inside the visible region skip
the mask; diagonal/boundary blocks apply it from the position vectors. A call
with no mask at all (not causal, no window, no segments) never loads those
vectors: its only masked block is the last, partial one, masked by key index.
Head dims 64, 128 and 256; at 256 the kv blocks are 64 keys (two Q tiles and
two stages of K and V are 192 KB of SMEM).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np

from mosaic import dsl, registry, tuning
from mosaic import target as target_lib
from mosaic.dsl import jax, jnp, lax, pl, plgpu

DTYPES = ("bfloat16", "float16")
REF_DTYPES = ("bfloat16", "float16", "float32")
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# --------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class Config(tuning.KernelConfig):
  """Mosaic kernel tiling: each consumer warpgroup owns block_q query rows."""
  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  pingpong: bool = True
  # P goes to wgmma from SMEM instead of registers (the interpreter reads
  # wgmma operands only from SMEM, so interpret mode forces this on).
  p_smem: bool = False
  # P @ V accumulates into the running output in place (pl.run_state) rather
  # than into a fresh accumulator that is then added (the interpreter has no
  # run_state, so interpret mode turns this off).
  acc_in_place: bool = True
  # FA3's intra-warpgroup overlap: the softmax of kv block j runs while the
  # wgmma of P_{j-1} V_{j-1} is in flight (costs one more S accumulator of
  # registers).
  overlap: bool = False
  # Launch each batch row's query tiles in order of their kv block counts,
  # most first, so the short ones fill the tail of the grid (the plan sorts
  # them: causal rows run last tile first, a packed row's long sequences'
  # late tiles go before its short sequences').
  heavy_first: bool = True

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"{self.block_q=} must be 64 (one wgmma M tile per warpgroup)")
    if self.block_kv not in (64, 128, 192, 256):
      raise ValueError(f"{self.block_kv=} must be one of 64, 128, 192, 256")
    if not 2 <= self.stages <= 6:
      raise ValueError(f"{self.stages=} must be in [2, 6]")


# What a kernel needs beyond its buffers (barriers, alignment, the runtime's
# scratch: 2.7 KB in the H200 lowering).
_SMEM_RESERVE = 3 * 1024


def unmasked(causal: bool, sliding_window, q_segment_ids) -> bool:
  """Whether every key is visible to every query (no causal mask, window or
  segments): the mosaic kernel then needs only the key count, no vectors."""
  return not causal and sliding_window is None and q_segment_ids is None


def smem_bytes(cfg: Config, head_dim: int, itemsize: int = 2, *, dense: bool = False,
               has_lse: bool = False, out_itemsize: int | None = None) -> int:
  """SMEM a mosaic call with ``cfg`` needs: two Q tiles, the K/V ring and,
  unless ``dense`` (no mask), the position and segment vectors. An output
  of another width than the operands (fp8 in, bf16 out) gets tiles of its
  own; otherwise it goes out through the Q tiles."""
  n = (2 * cfg.block_q + 2 * cfg.stages * cfg.block_kv) * head_dim * itemsize
  if not dense:
    n += 4 * 2 * (2 * cfg.block_q + cfg.stages * cfg.block_kv)
  if has_lse:
    n += 4 * 2 * cfg.block_q
  if cfg.p_smem:
    n += 2 * cfg.block_q * cfg.block_kv * itemsize
  if out_itemsize is not None and out_itemsize != itemsize:
    n += 2 * cfg.block_q * head_dim * out_itemsize
  return n + _SMEM_RESERVE


# --------------------------------------------------------------------------
# Input checks and mask vectors shared by all backends


def _check(q, k, v, causal, sm_scale, q_positions, kv_positions, q_segment_ids,
           kv_segment_ids, sliding_window, dtypes=REF_DTYPES):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or x.ndim != 4:
      raise ValueError(f"{name} must be a 4D array [B, S, H, D], got "
                       f"{getattr(x, 'shape', type(x))}")
  B, Sq, Hq, D = q.shape
  Bk, Skv, Hkv, Dk = k.shape
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape: {k.shape=} {v.shape=}")
  if Bk != B or Dk != D:
    raise ValueError(f"k/v batch and head dim must match q: {q.shape=} {k.shape=}")
  if Hq % Hkv:
    raise ValueError(f"query heads must be a multiple of kv heads: {Hq=} {Hkv=}")
  if Sq < 1 or Skv < 1:
    raise ValueError(f"sequence lengths must be >= 1: {Sq=} {Skv=}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype: {q.dtype=} {k.dtype=} {v.dtype=}")
  if jnp.dtype(q.dtype).name not in dtypes:
    raise ValueError(f"{q.dtype=} is not supported; supported: {dtypes}")
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"{causal=} must be a Python bool")
  if sm_scale is not None and not isinstance(sm_scale, (int, float)):
    raise ValueError(f"{sm_scale=} must be a Python float or None")
  if sliding_window is not None and (not isinstance(sliding_window, int)
                                     or isinstance(sliding_window, bool) or sliding_window < 1):
    raise ValueError(f"{sliding_window=} must be a positive int or None")
  for name, x, s in (("q_positions", q_positions, Sq), ("kv_positions", kv_positions, Skv),
                     ("q_segment_ids", q_segment_ids, Sq), ("kv_segment_ids", kv_segment_ids, Skv)):
    if x is None:
      continue
    if not hasattr(x, "shape") or tuple(x.shape) != (B, s):
      raise ValueError(f"{name} must have shape {(B, s)}, got {getattr(x, 'shape', type(x))}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be integer, got {x.dtype=}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  return B, Sq, Hq, D, Skv, Hkv


def _vectors(B, Sq, Skv, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
  """int32 [B, S] positions and segments with the op's defaults filled in."""
  if q_positions is None:
    q_positions = jnp.broadcast_to(jnp.arange(Sq, dtype=jnp.int32) + (Skv - Sq), (B, Sq))
  if kv_positions is None:
    kv_positions = jnp.broadcast_to(jnp.arange(Skv, dtype=jnp.int32), (B, Skv))
  if q_segment_ids is None:
    q_segment_ids = jnp.ones((B, Sq), jnp.int32)
    kv_segment_ids = jnp.ones((B, Skv), jnp.int32)
  return (jnp.asarray(q_positions, jnp.int32), jnp.asarray(q_segment_ids, jnp.int32),
          jnp.asarray(kv_positions, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32))


def _mask(qp, qs, kp, ks, causal, window):
  """[B, Sq', Skv'] bool: which query sees which key."""
  m = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
  if causal:
    m &= kp[:, None, :] <= qp[:, :, None]
  if window is not None:
    m &= (qp[:, :, None] - kp[:, None, :]) < window
  return m


def _pad_to(x, axis, size, value=0):
  n = x.shape[axis]
  if n == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - n)
  return jnp.pad(x, pad, constant_values=value)


def _block_summary(pos, seg, block):
  """Per block of ``block`` tokens, over its real tokens (segment != 0):
  has_real, all_real, the segment ids' min and max, the positions' min and
  max; the positions' (min, max) among the tokens of the min segment and
  among those of the max segment; whether a segment lies strictly between."""
  B, S = pos.shape
  n = S // block
  p = pos.reshape(B, n, block)
  s = seg.reshape(B, n, block)
  real = s != 0
  big = jnp.iinfo(jnp.int32).max
  smin = jnp.where(real, s, big).min(-1, keepdims=True)
  smax = jnp.where(real, s, -big).max(-1, keepdims=True)
  pmin = lambda m: jnp.where(m, p, big).min(-1)
  pmax = lambda m: jnp.where(m, p, -big).max(-1)
  first, last = real & (s == smin), real & (s == smax)
  return (real.any(-1), real.all(-1), smin[..., 0], smax[..., 0], pmin(real), pmax(real),
          (pmin(first), pmax(first)), (pmin(last), pmax(last)),
          (real & ~first & ~last).any(-1))


def _block_ranges(qp, qs, kp, ks, block_q, block_kv, causal, window):
  """Per query block: [lo, hi) of kv blocks that may hold a visible key, and
  [full_lo, full_hi) inside it whose keys are all visible to all its rows.

  Conservative from per-block min/max, so [lo, hi) may include blocks with
  nothing visible (the element mask handles those) but never misses one.
  A block that holds the end of one packed sequence and the start of the
  next is judged per sequence (positions restart at each), so neither
  sequence's positions widen the other's range. Empty blocks get
  lo = hi = full_lo = full_hi = 0. Returns int32 [B, nq, 4].
  """
  qh, qa, qsmin, qsmax, qpmin, qpmax, q_first, q_last, q_mid = _block_summary(qp, qs, block_q)
  kh, ka, ksmin, ksmax, kpmin, kpmax, k_first, k_last, k_mid = _block_summary(kp, ks, block_kv)
  e = lambda x: x[:, :, None]
  f = lambda x: x[:, None, :]

  def reach(q_pmin, q_pmax, k_pmin, k_pmax):
    """Whether positions in these ranges may be in the causal / window mask."""
    ok = True
    if causal:
      ok = f(k_pmin) <= e(q_pmax)
    if window is not None:
      ok &= (e(q_pmin) - f(k_pmax)) < window
    return ok

  # A visible pair shares a segment: the min or max one of both blocks
  # (judged by that segment's own positions), or one strictly between in
  # either (judged by the blocks' whole ranges).
  vis = ((e(q_mid) | f(k_mid)) & (e(qsmin) <= f(ksmax)) & (f(ksmin) <= e(qsmax))
         & reach(qpmin, qpmax, kpmin, kpmax))
  for q_seg, (q_lo, q_hi) in ((qsmin, q_first), (qsmax, q_last)):
    for k_seg, (k_lo, k_hi) in ((ksmin, k_first), (ksmax, k_last)):
      vis |= (e(q_seg) == f(k_seg)) & reach(q_lo, q_hi, k_lo, k_hi)
  vis &= e(qh) & f(kh)
  full = (e(qa) & f(ka) & (e(qsmin) == e(qsmax)) & (f(ksmin) == f(ksmax))
          & (e(qsmin) == f(ksmin)))
  if causal:
    full &= f(kpmax) <= e(qpmin)
  if window is not None:
    full &= (e(qpmax) - f(kpmin)) < window
  nk = vis.shape[-1]
  idx = jnp.arange(nk, dtype=jnp.int32)
  any_vis = vis.any(-1)
  lo = jnp.where(vis, idx, nk).min(-1)
  hi = jnp.where(vis, idx + 1, 0).max(-1)
  lo = jnp.where(any_vis, lo, 0)
  hi = jnp.where(any_vis, hi, 0)
  any_full = full.any(-1)
  flo = jnp.where(full, idx, nk).min(-1)
  # The unmasked run is the contiguous run of full blocks starting at flo.
  fhi = jnp.where((idx >= e(flo)) & ~full, idx, nk).min(-1)
  fhi = jnp.minimum(fhi, hi)
  flo = jnp.where(any_full, flo, lo)
  fhi = jnp.where(any_full, fhi, lo)
  return jnp.stack([lo, hi, flo, fhi], -1).astype(jnp.int32)


# --------------------------------------------------------------------------
# Mosaic GPU kernel (FA3)


# fp8 P is exp2(s - m + P_SHIFT), i.e. 2^P_SHIFT times the probabilities:
# e4m3's range reaches 448, and values below its smallest subnormal (2^-9)
# would round to 0. The row sum carries the same factor, so o = acc / l is
# unchanged and only the lse subtracts it.
P_SHIFT = 8.0


def _mosaic_kernel(meta_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, scales_ref,
                   o_ref, lse_ref, *, cfg: Config, groups: int, scale: float,
                   causal: bool, window: int | None, has_lse: bool, dense_kv: int | None):
  """``dense_kv``: no mask but the keys' count (non-causal, no window, no
  segments): the kernel then masks padding keys by index and never reads the
  position and segment vectors, which also frees their SMEM.

  ``scales_ref`` (fp8 operands, kernels/attention_prefill_fp8.py): float32
  [2, Hq], per query head the score factor q_scale * k_scale * sm_scale *
  log2(e) and v_scale. v_ref is then V^T [B, Hkv, D, Skv] (fp8 wgmma reads
  both operands K-major), P goes through SMEM in fp8 and the output, wider
  than the operands, gets SMEM tiles of its own."""
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  dense = dense_kv is not None
  fp8 = scales_ref is not None
  D = q_ref.shape[-1]
  dtype = q_ref.dtype
  shift = P_SHIFT if fp8 else 0.0

  def body(q_smem, k_smem, v_smem, qvec_smem, kvec_smem, lse_smem, p_smem, o_smem,
           q_bar, k_bar, v_bar, k_free, v_free, sched):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    i = lax.axis_index("q_seq")  # launch slot: the plan's meta is in launch order
    # The query tile this slot runs (unmasked, every tile is equal work and
    # the order is the tiles': no load before the Q copy).
    t = i if dense else meta_ref[b, i, 2, 2]
    wg = lax.axis_index("wg")
    # The CTA's kv range is the union of its two consumers' ranges.
    lo_cta = meta_ref[b, i, 2, 0]
    hi_cta = meta_ref[b, i, 2, 1]
    n = hi_cta - lo_cta

    def sync_sched():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      # exp(s * scale) == exp2(s * c)
      c = scales_ref[0, h] if fp8 else scale * LOG2E
      lo = meta_ref[b, i, wg, 0]
      hi = meta_ref[b, i, wg, 1]
      flo = meta_ref[b, i, wg, 2]
      fhi = meta_ref[b, i, wg, 3]
      q0 = (2 * t + wg) * block_q
      qo = q_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, block_q), h], qo, q_bar.at[wg])
      if not dense:
        plgpu.copy_gmem_to_smem(qp_ref.at[b, pl.ds(q0, block_q)], qvec_smem.at[wg, 0],
                                q_bar.at[wg])
        plgpu.copy_gmem_to_smem(qs_ref.at[b, pl.ds(q0, block_q)], qvec_smem.at[wg, 1],
                                q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      row = plgpu.Layout.WGMMA.reduce(1)
      col = plgpu.Layout.WGMMA.reduce(0)
      if not dense:
        qpos = plgpu.load(qvec_smem.at[wg, 0], (), layout=row)
        qseg = plgpu.load(qvec_smem.at[wg, 1], (), layout=row)
      s_shape = (block_q, block_kv)

      m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row)
      l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row)
      acc = plgpu.layout_cast(jnp.full((block_q, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      slot_of = lambda s: lax.rem(s - lo_cta, stages)

      def softmax(sc, s, m_i, l_i, masked: bool, cast: bool = True):
        """Scores of kv block ``s`` -> (P, m, l, alpha); releases its K slot.

        P comes back in the input dtype, or float32 with ``cast=False``.

        The named scopes are the regions of the in-kernel timeline
        (dsl.kernel_timeline); they cost nothing otherwise.
        """
        slot = slot_of(s)
        with jax.named_scope("softmax"):
          if masked and dense:
            key = plgpu.broadcasted_iota(jnp.int32, s_shape, 1, layout=plgpu.Layout.WGMMA)
            sc = jnp.where(key + s * block_kv < dense_kv, sc, -jnp.inf)
          elif masked:
            kpos = plgpu.load(kvec_smem.at[slot, 0], (), layout=col)
            kseg = plgpu.load(kvec_smem.at[slot, 1], (), layout=col)
            qp2 = lax.broadcast_in_dim(qpos, s_shape, [0])
            qs2 = lax.broadcast_in_dim(qseg, s_shape, [0])
            kp2 = lax.broadcast_in_dim(kpos, s_shape, [1])
            ks2 = lax.broadcast_in_dim(kseg, s_shape, [1])
            vis = qs2 == ks2
            if causal:
              vis = vis & (kp2 <= qp2)
            if window is not None:
              vis = vis & ((qp2 - kp2) < window)
            sc = jnp.where(vis, sc, -jnp.inf)
            # The vectors were read through the generic proxy; the producer
            # may refill the slot by TMA (the async proxy) once K is released.
            plgpu.commit_smem()
          plgpu.barrier_arrive(k_free.at[slot])
          m_new = jnp.maximum(m_i, sc.max(axis=1) * c)
          # A row with nothing visible yet keeps m = -inf; subtract 0 there.
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
          alpha = jnp.exp2(m_i - m_use)
          p = jnp.exp2(sc * c - lax.broadcast_in_dim(m_use - shift if fp8 else m_use, s_shape,
                                                     [0]))
          l_new = l_i * alpha + p.sum(axis=1)
          return p.astype(dtype) if cast else p, m_new, l_new, alpha

      def rescale(acc, alpha):
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def p_operand(p16):
        if p_smem is None:
          return p16
        p_smem.at[wg][...] = p16
        plgpu.commit_smem()
        return p_smem.at[wg]

      def v_operand(slot):
        return v_smem.at[slot].T if fp8 else v_smem.at[slot]  # fp8: V^T in SMEM

      def pv(acc, p16, slot):
        """acc + P V[slot]; releases the V slot."""
        with jax.named_scope("pv"):
          p_op = p_operand(p16)
          if cfg.acc_in_place:
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_op, v_operand(slot)))(
                plgpu.ACC.init(acc))
          else:
            def pv_(acc_ref):
              plgpu.wgmma(acc_ref, p_op, v_operand(slot))
              return acc_ref[...]

            acc = acc + pl.run_scoped(pv_, plgpu.ACC((block_q, D), jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc

      def skip(s, _):
        # Steps of the CTA's range this consumer does not need: keep the
        # barrier phases and the ping-pong in step with the other consumer.
        slot = slot_of(s)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        if cfg.pingpong and cfg.overlap:
          take_turn()
          pass_turn()
        elif cfg.pingpong:
          sync_sched()
          sync_sched()
        return _

      # -- one block per step: QK, softmax, PV in sequence; the two consumers
      # meet at a barrier twice per step so that one's softmax runs while the
      # other's wgmmas do.

      def qk(slot, after_issue):
        """S = Q K[slot]^T; with ping-pong, ``after_issue`` runs while it computes."""
        def f(s_ref):
          plgpu.wgmma(s_ref, qo, k_smem.at[slot].T)
          if cfg.pingpong:
            after_issue()
          return s_ref[...]

        with jax.named_scope("qk"):
          return pl.run_scoped(f, plgpu.ACC(s_shape, jnp.float32))

      def step(s, carry, masked: bool):
        acc, m_i, l_i = carry
        slot = slot_of(s)
        with jax.named_scope("wait_k"):
          plgpu.barrier_wait(k_bar.at[slot])
        sc = qk(slot, sync_sched)
        # fp8 P is cast after the barrier (it takes no 8-bit vectors).
        p16, m_new, l_i, alpha = softmax(sc, s, m_i, l_i, masked, cast=not fp8)
        acc = rescale(acc, alpha)
        if not dsl.interpreting():
          # Keeps the softmax from being scheduled past the barriers below.
          acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        p16 = p16.astype(dtype)
        with jax.named_scope("wait_v"):
          if cfg.pingpong:
            plgpu.barrier_arrive(sched)
          plgpu.barrier_wait(v_bar.at[slot])
          if cfg.pingpong:
            plgpu.barrier_wait(sched)
        return pv(acc, p16, slot), m_new, l_i

      # -- overlap (FA3's intra-warpgroup pipelining): step s issues QK of
      # block s and PV of block s - 1 back to back, then runs block s's
      # softmax while PV is still on the tensor cores. The ping-pong becomes a
      # turn passed between the consumers around each issue.

      def take_turn():
        plgpu.barrier_wait(sched.at[wg])

      def pass_turn():
        plgpu.barrier_arrive(sched.at[1 - wg])

      def first(s, carry):
        acc, m_i, l_i, _ = carry
        slot = slot_of(s)
        with jax.named_scope("wait_k"):
          plgpu.barrier_wait(k_bar.at[slot])
          if cfg.pingpong:
            take_turn()
        sc = qk(slot, pass_turn)
        # The first block of the range may be a boundary block: always mask.
        p16, m_i, l_i, _ = softmax(sc, s, m_i, l_i, masked=True)
        return acc, m_i, l_i, p16

      def overlapped(s, carry, masked: bool):
        acc, m_i, l_i, p_prev = carry
        slot, prev = slot_of(s), slot_of(s - 1)
        with jax.named_scope("wait_k"):
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(v_bar.at[prev])
          if cfg.pingpong:
            take_turn()
        p_op = p_operand(p_prev)

        def issue(s_ref, o_ref):
          plgpu.wgmma(s_ref, qo, k_smem.at[slot].T)
          plgpu.wgmma(o_ref, p_op, v_operand(prev))
          if cfg.pingpong:
            pass_turn()
          # Waits for QK only; PV of the previous block stays in flight.
          return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)

        # P stays float32 until PV has finished: its bf16 registers are the
        # operand of the wgmma in flight, and writing them earlier makes
        # ptxas serialize the wgmmas.
        if cfg.acc_in_place:
          def body_(refs):
            s_ref, o_ref, out_refs = refs
            sc = issue(s_ref, o_ref)
            for r, x in zip(out_refs, softmax(sc, s, m_i, l_i, masked, cast=False)):
              r[...] = x

          zero_s = plgpu.layout_cast(jnp.zeros(s_shape, jnp.float32), plgpu.Layout.WGMMA)
          _, o, (p, m_new, l_new, alpha) = pl.run_state(body_)(
              (plgpu.ACC.init(zero_s), plgpu.ACC.init(acc), (zero_s, m_i, l_i, m_i)))
        else:
          def body_(s_ref, o_ref):
            sc = issue(s_ref, o_ref)
            out = softmax(sc, s, m_i, l_i, masked, cast=False)
            return out, o_ref[...]

          (p, m_new, l_new, alpha), delta = pl.run_scoped(
              body_, plgpu.ACC(s_shape, jnp.float32), plgpu.ACC((block_q, D), jnp.float32))
          o = acc + delta
        if not dsl.interpreting():
          o, p = lax.optimization_barrier((o, p))  # after the wait for PV
        plgpu.barrier_arrive(v_free.at[prev])
        return rescale(o, alpha), m_new, l_new, p.astype(dtype)

      def last(s, carry):
        acc, m_i, l_i, p_prev = carry
        slot = slot_of(s)
        with jax.named_scope("wait_v"):
          plgpu.barrier_wait(v_bar.at[slot])
        return pv(acc, p_prev, slot), m_i, l_i, p_prev

      if cfg.pingpong:
        # Consumer 0 goes first: consumer 1 hands it the turn (overlap) or
        # starts one meeting behind.
        pl.when(wg == 1)(pass_turn if cfg.overlap else sync_sched)
      lax.fori_loop(lo_cta, lo, skip, None)
      if cfg.overlap:
        p0 = plgpu.layout_cast(jnp.zeros(s_shape, dtype), plgpu.Layout.WGMMA)
        carry = lax.fori_loop(lo, jnp.minimum(lo + 1, hi), first, (acc, m_i, l_i, p0))
        a = lo + 1
        carry = lax.fori_loop(a, jnp.maximum(flo, a), functools.partial(overlapped, masked=True),
                              carry)
        carry = lax.fori_loop(jnp.maximum(flo, a), jnp.maximum(fhi, a),
                              functools.partial(overlapped, masked=False), carry)
        carry = lax.fori_loop(jnp.maximum(fhi, a), hi, functools.partial(overlapped, masked=True),
                              carry)
        acc, m_i, l_i, _ = lax.fori_loop(jnp.maximum(lo, hi - 1), hi, last, carry)
      else:
        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
      lax.fori_loop(hi, hi_cta, skip, None)
      if cfg.pingpong:
        # The last turn (or meeting) the other consumer handed over.
        pl.when(wg == 0)(take_turn if cfg.overlap else sync_sched)

      l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
      inv_l = scales_ref[1, h] / l_safe if fp8 else 1.0 / l_safe
      acc = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
      ot = qo if o_smem is None else o_smem.at[wg]
      ot[...] = acc.astype(o_ref.dtype)
      if has_lse:
        lse_smem.at[wg][...] = jnp.where(
            l_i == 0.0, -jnp.inf,
            (m_i + jnp.log2(l_safe) - shift) * LN2 if fp8 else (m_i + jnp.log2(l_safe)) * LN2)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(ot, o_ref.at[b, pl.ds(q0, block_q), h])
      if has_lse:
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, block_q)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      hk = lax.div(h, jnp.int32(groups))

      @pl.loop(lo_cta, hi_cta)
      def _(s):
        slot = lax.rem(s - lo_cta, stages)
        rows = pl.ds(s * block_kv, block_kv)
        refill = s - lo_cta >= stages
        # K and V slots are released separately (with overlap, V of block
        # s - 1 is still being read while K of block s + 1 may load).
        with jax.named_scope("wait_free"):
          pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
        with jax.named_scope("load_kv"):
          plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], k_smem.at[slot], k_bar.at[slot])
          if not dense:
            plgpu.copy_gmem_to_smem(kp_ref.at[b, rows], kvec_smem.at[slot, 0], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(ks_ref.at[b, rows], kvec_smem.at[slot, 1], k_bar.at[slot])
        with jax.named_scope("wait_free"):
          pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
        with jax.named_scope("load_kv"):
          v_src = v_ref.at[b, hk, :, rows] if fp8 else v_ref.at[b, rows, hk]
          plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], v_bar.at[slot])

      # Wait for the last releases so that no arrival is left unobserved.
      @pl.loop(jnp.maximum(hi_cta - stages, lo_cta), hi_cta)
      def _(s):
        slot = lax.rem(s - lo_cta, stages)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])

  tf_q = dsl.smem_transforms((block_q, D), dtype)
  tf_kv = dsl.smem_transforms((block_kv, D), dtype)
  v_tile = (D, block_kv) if fp8 else (block_kv, D)
  out_dtype = o_ref.dtype
  scratch = [
      plgpu.SMEM((2, block_q, D), dtype, transforms=tf_q),
      plgpu.SMEM((stages, block_kv, D), dtype, transforms=tf_kv),
      plgpu.SMEM((stages, *v_tile), dtype, transforms=dsl.smem_transforms(v_tile, dtype)),
      None if dense else plgpu.SMEM((2, 2, block_q), jnp.int32),
      None if dense else plgpu.SMEM((stages, 2, block_kv), jnp.int32),
      plgpu.SMEM((2, block_q), jnp.float32) if has_lse else None,
      plgpu.SMEM((2, block_q, block_kv), dtype, transforms=dsl.smem_transforms(
          (block_q, block_kv), dtype)) if cfg.p_smem else None,
      None if out_dtype == dtype else plgpu.SMEM(
          (2, block_q, D), out_dtype, transforms=dsl.smem_transforms((block_q, D), out_dtype)),
  ]
  barriers = [
      # Q (K) and, unless dense, its position and segment vectors.
      plgpu.Barrier(num_arrivals=1 if dense else 3, num_barriers=2),
      plgpu.Barrier(num_arrivals=1 if dense else 3, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      # Ping-pong: a turn passed between the consumers (overlap), or a meeting.
      plgpu.Barrier(num_arrivals=1, num_barriers=2) if cfg.overlap else plgpu.Barrier(num_arrivals=2),
  ]
  pl.run_scoped(lambda *refs: body(*refs), *scratch, *barriers, collective_axes="wg")


class MosaicPlan(NamedTuple):
  """The mosaic kernel's per-call metadata (``op.plan``): the position and
  segment vectors padded to its blocks, and each CTA's kv block ranges. It
  depends on the positions, not on q, k, v: a model builds it once per step,
  not once per layer."""

  # int32 [B, Sq_p / (2 block_q), 3, 4], per launch slot (each row's slots in
  # Config.heavy_first order): consumer 0's and 1's [lo, hi, full_lo,
  # full_hi) kv block ranges, then the CTA's [lo, hi, query tile, 0].
  meta: jax.Array
  qp: jax.Array  # int32 [B, Sq_p]
  qs: jax.Array
  kp: jax.Array  # int32 [B, Skv_p]
  ks: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "causal", "window"))
def _mosaic_plan(qp, qs, kp, ks, *, cfg: Config, causal: bool, window: int | None):
  B, Sq = qp.shape
  Skv = kp.shape[1]
  bq2 = 2 * cfg.block_q
  Sq_p = dsl.round_up(Sq, bq2)
  Skv_p = dsl.round_up(Skv, cfg.block_kv)
  qp = _pad_to(qp, 1, Sq_p)
  kp = _pad_to(kp, 1, Skv_p)
  # Padding queries get segment -1 and padding keys 0: never equal, and a
  # real query's segment 0 (padding in the caller's packing) becomes -1 too.
  qs = jnp.where(_pad_to(qs, 1, Sq_p) == 0, -1, _pad_to(qs, 1, Sq_p))
  ks = _pad_to(ks, 1, Skv_p)
  per_tile = _block_ranges(qp, jnp.where(qs < 0, 0, qs), kp, ks, cfg.block_q, cfg.block_kv,
                           causal, window)
  nt = Sq_p // bq2
  per_tile = per_tile.reshape(B, nt, 2, 4)
  empty = per_tile[..., 0] == per_tile[..., 1]
  # The CTA's range is the union of its non-empty consumers' ranges.
  lo_c = jnp.where(empty, jnp.iinfo(jnp.int32).max, per_tile[..., 0]).min(-1)
  hi_c = jnp.where(empty, 0, per_tile[..., 1]).max(-1)
  lo_c = jnp.where(empty.all(-1), 0, lo_c)
  hi_c = jnp.where(empty.all(-1), 0, hi_c)
  # An empty consumer range sits at lo_c so the skip loops cover the CTA range.
  per_tile = jnp.where(empty[..., None], lo_c[..., None, None], per_tile)
  # The kernel's loops run lo_c..lo..flo..fhi..hi..hi_c: keep that order whatever happens.
  per_tile = jnp.clip(per_tile, lo_c[..., None, None], hi_c[..., None, None])
  per_tile = jnp.concatenate([per_tile[..., :1], jnp.maximum(per_tile[..., 1:2], per_tile[..., :1]),
                              jnp.clip(per_tile[..., 2:], per_tile[..., :1], per_tile[..., 1:2])], -1)
  tile = jnp.broadcast_to(jnp.arange(nt, dtype=jnp.int32), lo_c.shape)
  cta = jnp.stack([lo_c, hi_c, tile, jnp.zeros_like(tile)], -1)[:, :, None]
  meta = jnp.concatenate([per_tile, cta], axis=2).astype(jnp.int32)
  if cfg.heavy_first:
    # Longest processing time first, per row: a stable sort, so equal tiles
    # keep their order (an unmasked call's tiles are all equal).
    order = jnp.argsort(-(hi_c - lo_c), axis=1, stable=True)
    meta = jnp.take_along_axis(meta, order[:, :, None, None], axis=1)
  return MosaicPlan(meta, qp, qs, kp, ks)


@functools.partial(jax.jit, static_argnames=("cfg", "causal", "scale", "window", "has_lse",
                                             "dense", "out_dtype"))
def _attention_mosaic(q, k, v, plan: MosaicPlan, scales=None, *, cfg: Config, causal: bool,
                      scale: float, window: int | None, has_lse: bool, dense: bool = False,
                      out_dtype=None):
  """``scales`` (fp8 q, k, v): float32 [2, Hq], see ``_mosaic_kernel``."""
  B, Sq, Hq, D = q.shape
  _, Skv, Hkv, _ = k.shape
  bq2 = 2 * cfg.block_q
  Sq_p = dsl.round_up(Sq, bq2)
  Skv_p = dsl.round_up(Skv, cfg.block_kv)
  nt = Sq_p // bq2
  q = _pad_to(q, 1, Sq_p)
  k = _pad_to(k, 1, Skv_p)
  v = _pad_to(v, 1, Skv_p)
  if scales is not None:
    v = v.transpose(0, 2, 3, 1)  # V^T [B, Hkv, D, Skv_p]: K-major for the fp8 P V
  meta, qp, qs, kp, ks = plan
  out_dtype = q.dtype if out_dtype is None else out_dtype
  out_type = [jax.ShapeDtypeStruct((B, Sq_p, Hq, D), out_dtype)]
  out_type.append(jax.ShapeDtypeStruct((B, Hq, Sq_p), jnp.float32) if has_lse else None)

  def entry(meta_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, *refs):
    scales_ref = refs[0] if scales is not None else None
    o_ref, lse_ref = refs[-2:]
    _mosaic_kernel(meta_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, scales_ref,
                   o_ref, lse_ref, cfg=cfg, groups=Hq // Hkv, scale=scale, causal=causal,
                   window=window, has_lse=has_lse, dense_kv=Skv if dense else None)

  extra = () if scales is None else (scales,)
  o, lse = dsl.kernel(
      entry,
      out_type=out_type,
      grid=(Hq, nt, B),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(meta, q, k, v, qp, qs, kp, ks, *extra)
  o = o[:, :Sq]
  return (o, lse[:, :, :Sq]) if has_lse else o


def _pick_config(D, dtype, causal) -> Config:
  key = tuning.shape_key(head_dim=D, dtype=jnp.dtype(dtype).name, causal=int(causal))

  def heuristic():
    # SMEM: 2 Q tiles + stages x (K + V). D = 64 fits 256-key blocks, which
    # halve the softmax's per-row work per key; on the H200 they beat a
    # 4-deep ring of 128-key blocks by 8% (bench/results/attention_prefill_h200_run4/).
    if D <= 64:
      return Config(block_q=64, block_kv=256, stages=2)
    if D > 128:  # D = 256: 64 KB of Q tiles and 64-key K/V blocks (64 KB a stage)
      return Config(block_q=64, block_kv=64, stages=2)
    return Config(block_q=64, block_kv=128, stages=2)

  return tuning.lookup("attention_prefill", key, Config, heuristic)


def _mosaic_setup(q, k, v, causal, sm_scale, q_positions, kv_positions, q_segment_ids,
                  kv_segment_ids, sliding_window, config, has_lse):
  """(config, position/segment vectors, scale, dense) of a mosaic call."""
  B, Sq, Hq, D, Skv, Hkv = _check(q, k, v, causal, sm_scale, q_positions, kv_positions,
                                  q_segment_ids, kv_segment_ids, sliding_window, DTYPES)
  why = _mosaic_why_not(q, k, v) or scale_why_not(sm_scale)
  if why:
    raise ValueError(why)
  dense = unmasked(causal, sliding_window, q_segment_ids)
  cfg = config or _pick_config(D, q.dtype, causal)
  need = smem_bytes(cfg, D, jnp.dtype(q.dtype).itemsize, dense=dense, has_lse=has_lse)
  limit = target_lib.current().ceilings.smem_per_block
  if not dsl.interpreting() and need > limit:
    if config is not None:
      raise ValueError(f"{config} needs about {need} bytes of SMEM for this call "
                       f"(head dim {D}, {'no mask' if dense else 'masked'}, "
                       f"lse {'on' if has_lse else 'off'}); the limit is {limit}")
    # A tabled config tuned without the lse (or the vectors) may not fit
    # with them: fall back to the heuristic's blocks (128 keys, 64 at
    # D = 256) in two stages, which always fit.
    cfg = dataclasses.replace(cfg, block_kv=128 if D <= 128 else 64, stages=2, p_smem=False)
  if dsl.interpreting() and (not cfg.p_smem or cfg.acc_in_place):
    cfg = dataclasses.replace(cfg, p_smem=True, acc_in_place=False)
  if dsl.interpreting() and cfg.overlap and cfg.pingpong:
    # The interpreter runs warpgroups on a small pool of CPU threads; under
    # load the turn passed between consumers can stall it (GPU tests cover it).
    cfg = dataclasses.replace(cfg, pingpong=False)
  vecs = _vectors(B, Sq, Skv, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
  scale = float(D ** -0.5 if sm_scale is None else sm_scale)
  return cfg, vecs, scale, dense


def attention_prefill_mosaic(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                             kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                             sliding_window=None, return_lse=False, config: Config | None = None,
                             plan: MosaicPlan | None = None):
  """``plan``: from ``attention_prefill_mosaic_plan`` (or ``op.plan``) with the
  same arguments but q, k, v, which need only their shapes there."""
  cfg, vecs, scale, dense = _mosaic_setup(
      q, k, v, causal, sm_scale, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
      sliding_window, config, bool(return_lse))
  make_plan = functools.partial(_mosaic_plan, cfg=cfg, causal=bool(causal),
                                window=sliding_window)
  if plan is None:
    plan = make_plan(*vecs)
  else:
    shapes = lambda p: [tuple(x.shape) for x in p]
    want = shapes(jax.eval_shape(make_plan, *vecs))
    got = shapes(plan) if isinstance(plan, MosaicPlan) else None
    if got != want:
      raise ValueError(f"the plan was made for other shapes or another config: {got} "
                       f"(this call needs {want})")
  return _attention_mosaic(q, k, v, plan, cfg=cfg, causal=bool(causal), scale=scale,
                           window=sliding_window, has_lse=bool(return_lse), dense=dense)


def attention_prefill_mosaic_plan(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                                  kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                                  sliding_window=None, return_lse=False,
                                  config: Config | None = None) -> MosaicPlan:
  """The mosaic call's metadata (block ranges, padded vectors), computed once."""
  cfg, vecs, _, _ = _mosaic_setup(q, k, v, causal, sm_scale, q_positions, kv_positions,
                                  q_segment_ids, kv_segment_ids, sliding_window, config,
                                  bool(return_lse))
  return _mosaic_plan(*vecs, cfg=cfg, causal=bool(causal), window=sliding_window)


def _mosaic_why_not(q, k, v) -> str | None:
  if not all(hasattr(x, "shape") and x.ndim == 4 for x in (q, k, v)):
    return "q, k, v must be 4D arrays"
  if jnp.dtype(q.dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(q.dtype).name} is not supported (supported: {', '.join(DTYPES)})"
  D = q.shape[-1]
  if D not in (64, 128, 256):
    return f"head dim {D} is not supported (supported: 64, 128, 256)"
  if target_lib.current().kind not in ("hopper", "cpu"):
    return f"the kernel uses Hopper wgmma; {target_lib.current().kind} is not supported"
  return None


def _mosaic_supports(q, k, v, *, sm_scale=None, **kwargs) -> str | None:
  del kwargs  # positions, segments, windows and a cached prefix are all supported
  return _mosaic_why_not(q, k, v) or scale_why_not(sm_scale)


def scale_why_not(sm_scale) -> str | None:
  """The mosaic kernels take the row max of the unscaled scores, then scale:
  that is the max of the scaled ones only for a positive scale."""
  if isinstance(sm_scale, (int, float)) and not sm_scale > 0:
    return f"{sm_scale=} must be > 0 (the kernel scales scores after their row max)"
  return None


# --------------------------------------------------------------------------
# Pallas Triton kernel (portable, used as a baseline and a fallback)


def _triton_kernel(meta_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, o_ref,
                   *lse_refs, c: float, causal: bool, window: int | None, block_k: int):
  q = q_ref[...]
  qp = qp_ref[...]
  qs = qs_ref[...]
  meta = meta_ref[...]
  sel = jnp.arange(4, dtype=jnp.int32)
  lo = jnp.sum(jnp.where(sel == 0, meta, 0))
  hi = jnp.sum(jnp.where(sel == 1, meta, 0))
  bq, D = q.shape

  def body(j, carry):
    acc, m_i, l_i = carry
    rows = pl.ds(j * block_k, block_k)
    kk = k_ref[rows, :]
    s = lax.dot_general(q, kk, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * c
    kp = kp_ref[rows]
    ks = ks_ref[rows]
    vis = (qs[:, None] == ks[None, :]) & (qs[:, None] != 0)
    if causal:
      vis &= kp[None, :] <= qp[:, None]
    if window is not None:
      vis &= (qp[:, None] - kp[None, :]) < window
    s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(kk.dtype), v_ref[rows, :],
                                         preferred_element_type=jnp.float32)
    return acc, m_new, l_i

  acc = jnp.zeros((bq, D), jnp.float32)
  m_i = jnp.full((bq,), -jnp.inf, jnp.float32)
  l_i = jnp.zeros((bq,), jnp.float32)
  acc, m_i, l_i = lax.fori_loop(lo, hi, body, (acc, m_i, l_i))
  l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  if lse_refs:
    lse_refs[0][...] = jnp.where(l_i == 0.0, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "window", "has_lse",
                                             "block_q", "block_k", "interpret"))
def _attention_triton(q, k, v, qp, qs, kp, ks, *, causal, scale, window, has_lse,
                      block_q=64, block_k=64, interpret=False):
  from jax.experimental.pallas import triton as pltriton

  B, Sq, Hq, D = q.shape
  _, Skv, Hkv, _ = k.shape
  G = Hq // Hkv
  Sq_p = dsl.round_up(Sq, block_q)
  Skv_p = dsl.round_up(Skv, block_k)
  q, qp, qs = _pad_to(q, 1, Sq_p), _pad_to(qp, 1, Sq_p), _pad_to(qs, 1, Sq_p)
  k, v = _pad_to(k, 1, Skv_p), _pad_to(v, 1, Skv_p)
  kp, ks = _pad_to(kp, 1, Skv_p), _pad_to(ks, 1, Skv_p)
  meta = _block_ranges(qp, qs, kp, ks, block_q, block_k, causal, window)
  nq = Sq_p // block_q
  kernel = functools.partial(_triton_kernel, c=scale * LOG2E, causal=causal, window=window,
                             block_k=block_k)
  in_specs = [
      pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
      pl.BlockSpec((None, block_q, None, D), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, Skv_p, None, D), lambda i, b, h: (b, 0, h // G, 0)),
      pl.BlockSpec((None, Skv_p, None, D), lambda i, b, h: (b, 0, h // G, 0)),
      pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
      pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
      pl.BlockSpec((None, Skv_p), lambda i, b, h: (b, 0)),
      pl.BlockSpec((None, Skv_p), lambda i, b, h: (b, 0)),
  ]
  out_shape = [jax.ShapeDtypeStruct((B, Sq_p, Hq, D), q.dtype)]
  out_specs = [pl.BlockSpec((None, block_q, None, D), lambda i, b, h: (b, i, h, 0))]
  if has_lse:
    out_shape.append(jax.ShapeDtypeStruct((B, Hq, Sq_p), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)))
  outs = pl.pallas_call(
      kernel,
      grid=(nq, B, Hq),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=4 if D <= 64 else 8, num_stages=2),
      interpret=interpret,
      name="attention_prefill_triton",
  )(meta, q, k, v, qp, qs, kp, ks)
  o = outs[0][:, :Sq]
  return (o, outs[1][:, :, :Sq]) if has_lse else o


def attention_prefill_triton(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                             kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                             sliding_window=None, return_lse=False):
  B, Sq, Hq, D, Skv, Hkv = _check(q, k, v, causal, sm_scale, q_positions, kv_positions,
                                  q_segment_ids, kv_segment_ids, sliding_window, REF_DTYPES)
  why = _triton_why_not(q)
  if why:
    raise ValueError(why)
  vecs = _vectors(B, Sq, Skv, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
  scale = float(D ** -0.5 if sm_scale is None else sm_scale)
  return _attention_triton(q, k, v, *vecs, causal=bool(causal), scale=scale,
                           window=sliding_window, has_lse=bool(return_lse),
                           interpret=not target_lib.on_gpu())


def _triton_why_not(q) -> str | None:
  if not hasattr(q, "shape") or q.ndim != 4:
    return "q must be a 4D array"
  D = q.shape[-1]
  if D not in (16, 32, 64, 128, 256):
    return f"head dim {D} is not supported (Triton blocks need a power of two in 16..256)"
  if jnp.dtype(q.dtype).name not in REF_DTYPES:
    return f"dtype {jnp.dtype(q.dtype).name} is not supported (supported: {REF_DTYPES})"
  return None


def _triton_supports(q, k, v, **kwargs) -> str | None:
  del k, v, kwargs
  return _triton_why_not(q)


# --------------------------------------------------------------------------
# cuDNN through jax.nn.dot_product_attention


def _cudnn_why_not(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                   kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                   sliding_window=None, return_lse=False) -> str | None:
  del sm_scale
  if not target_lib.on_gpu():
    return f"cuDNN needs a CUDA GPU (running on {target_lib.current().kind})"
  if not all(hasattr(x, "shape") and x.ndim == 4 for x in (q, k, v)):
    return "q, k, v must be 4D arrays"
  if jnp.dtype(q.dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(q.dtype).name} is not supported (supported: {', '.join(DTYPES)})"
  if q.shape[-1] % 8 or q.shape[-1] > 128:
    return f"head dim {q.shape[-1]} is not supported (a multiple of 8 up to 128)"
  if q_segment_ids is not None or kv_segment_ids is not None:
    return ("segment ids (packed ragged batches) are not supported by "
            "jax.nn.dot_product_attention's cuDNN path")
  if q_positions is not None or kv_positions is not None:
    return "explicit positions are not supported by jax.nn.dot_product_attention"
  if causal and q.shape[1] != k.shape[1]:
    return ("jax.nn.dot_product_attention's causal mask is top-left aligned; a cached prefix "
            "(Sq != Skv) needs bottom-right alignment")
  if sliding_window is not None and not causal:
    return "a sliding window is supported only with causal=True"
  if return_lse:
    return "jax.nn.dot_product_attention does not return the log-sum-exp"
  return None


def attention_prefill_cudnn(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                            kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                            sliding_window=None, return_lse=False):
  kw = dict(causal=causal, sm_scale=sm_scale, q_positions=q_positions,
            kv_positions=kv_positions, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, sliding_window=sliding_window, return_lse=return_lse)
  _check(q, k, v, causal, sm_scale, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
         sliding_window, DTYPES)
  why = _cudnn_why_not(q, k, v, **kw)
  if why:
    raise ValueError(why)
  window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=bool(causal),
                                      local_window_size=window, implementation="cudnn")


# --------------------------------------------------------------------------
# XLA (jnp, query-chunked) and the float32 reference


def _attend_dense(q, k, v, qp, qs, kp, ks, causal, scale, window, out_dtype):
  """Exact masked softmax attention for a (chunk of) queries, fp32 math, no K/V repeat."""
  B, Sq, Hq, D = q.shape
  Hkv = k.shape[2]
  G = Hq // Hkv
  qg = q.reshape(B, Sq, Hkv, G, D)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
  vis = _mask(qp, qs, kp, ks, causal, window)[:, None, None]
  s = jnp.where(vis, s, -jnp.inf)
  m = s.max(-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype) if out_dtype != jnp.float32 else p, v,
                 preferred_element_type=jnp.float32)
  l_t = jnp.moveaxis(l[..., 0], -1, 1)[..., None]  # [B, Sq, Hkv, G, 1]
  o = (o / jnp.where(l_t == 0, 1.0, l_t)).reshape(B, Sq, Hq, D).astype(out_dtype)
  lse = jnp.where(l[..., 0] == 0, -jnp.inf, m[..., 0] + jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0])))
  return o, lse.reshape(B, Hq, Sq)


def attention_prefill_reference(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                                kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                                sliding_window=None, return_lse=False):
  """The meaning of the op in float32 (outputs stay float32)."""
  B, Sq, Hq, D, Skv, Hkv = _check(q, k, v, causal, sm_scale, q_positions, kv_positions,
                                  q_segment_ids, kv_segment_ids, sliding_window, REF_DTYPES)
  vecs = _vectors(B, Sq, Skv, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
  scale = float(D ** -0.5 if sm_scale is None else sm_scale)
  f = lambda x: jnp.asarray(x, jnp.float32)
  o, lse = _attend_dense(f(q), f(k), f(v), *vecs, bool(causal), scale, sliding_window,
                         jnp.float32)
  return (o, lse) if return_lse else o


@functools.partial(jax.jit, static_argnames=("causal", "scale", "window", "has_lse", "chunk"))
def _attention_xla(q, k, v, qp, qs, kp, ks, *, causal, scale, window, has_lse, chunk):
  B, Sq, Hq, D = q.shape
  if Sq <= chunk:
    o, lse = _attend_dense(q, k, v, qp, qs, kp, ks, causal, scale, window, q.dtype)
    return (o, lse) if has_lse else o
  Sq_p = dsl.round_up(Sq, chunk)
  n = Sq_p // chunk
  qc = _pad_to(q, 1, Sq_p).reshape(B, n, chunk, Hq, D).swapaxes(0, 1)
  qpc = _pad_to(qp, 1, Sq_p).reshape(B, n, chunk).swapaxes(0, 1)
  qsc = _pad_to(qs, 1, Sq_p).reshape(B, n, chunk).swapaxes(0, 1)
  o, lse = lax.map(lambda a: _attend_dense(a[0], k, v, a[1], a[2], kp, ks, causal, scale,
                                           window, q.dtype), (qc, qpc, qsc))
  o = o.swapaxes(0, 1).reshape(B, Sq_p, Hq, D)[:, :Sq]
  lse = jnp.moveaxis(lse, 0, 2).reshape(B, Hq, Sq_p)[:, :, :Sq]
  return (o, lse) if has_lse else o


def attention_prefill_xla(q, k, v, *, causal=True, sm_scale=None, q_positions=None,
                          kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                          sliding_window=None, return_lse=False):
  B, Sq, Hq, D, Skv, Hkv = _check(q, k, v, causal, sm_scale, q_positions, kv_positions,
                                  q_segment_ids, kv_segment_ids, sliding_window, REF_DTYPES)
  vecs = _vectors(B, Sq, Skv, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
  scale = float(D ** -0.5 if sm_scale is None else sm_scale)
  # Scores of one chunk are B * Hq * chunk * Skv fp32: keep them near 512 MB.
  budget = (512 << 20) // (4 * B * Hq * Skv)
  chunk = max(16, min(Sq, 1 << max(4, budget.bit_length() - 1)))
  return _attention_xla(q, k, v, *vecs, causal=bool(causal), scale=scale, window=sliding_window,
                        has_lse=bool(return_lse), chunk=chunk)


# --------------------------------------------------------------------------
# Registration

op = registry.op("attention_prefill", "softmax(q k^T * scale + mask) v with GQA, causal, "
                 "segments, positions, sliding window")
op.register("mosaic", attention_prefill_mosaic, supports=_mosaic_supports,
            plan=attention_prefill_mosaic_plan,
            doc="Mosaic GPU FA3: TMA K/V ring, 2 consumer warpgroups, ping-pong, exp2")
op.register("cudnn", attention_prefill_cudnn, supports=_cudnn_why_not,
            doc="cuDNN via jax.nn.dot_product_attention")
op.register("triton", attention_prefill_triton, supports=_triton_supports,
            doc="Pallas Triton flash attention (interpreted on CPU)")
op.register("xla", attention_prefill_xla, doc="jnp, query-chunked, fp32 softmax")
op.register("reference", attention_prefill_reference, doc="float32 jnp; outputs stay float32")
op.set_defaults(hopper=("mosaic", "cudnn", "xla"), blackwell=("cudnn", "xla"),
                cuda=("triton", "xla"), default=("xla",))


def attention_prefill(q, k, v, *, backend: str | None = None, **kwargs):
  return op(q, k, v, backend=backend, **kwargs)
