"""matmul: ``out = act(a @ b (+ bias)) (+ residual)`` with fp32 accumulation.

a[M, K] and b[K, N] (weights stored [in_features, out_features]) are bf16 or
fp16; the output dtype defaults to a's and may be bf16, fp16 or fp32.
``activation="swiglu"`` fuses the SwiGLU gate of an MLP whose gate and up
projections are one matmul: b's columns come in blocks of SWIGLU_BLOCK gate
columns followed by the matching SWIGLU_BLOCK up columns (``swiglu_columns``
builds that layout), and out[:, f] = silu(gate_f) * up_f is [M, N / 2].
``rms_eps=eps`` normalizes a's rows first, ``a * rsqrt(mean(a**2) + eps)``:
an RMSNorm whose weight is folded into b's rows (``fold_rms_weight``), so the
norm needs no kernel (and no HBM round trip) of its own.

Hopper kernel (``mosaic`` backend), how data flows:

- A persistent grid of one CTA per SM walks the output tiles in a grouped
  ("planar snake") order so that neighbouring CTAs share A rows / B columns
  in L2.
- Each CTA has three warpgroups: one producer issues TMA copies of an A
  block [cta_m, tile_k] and a B block [tile_k, cta_n] into a ring of
  ``stages`` swizzled SMEM buffers; two consumers each own half of the CTA
  tile (split along N or M) and accumulate it with wgmma in fp32 registers.
- With ``Config.cluster`` the grid is of 2-CTA clusters whose CTAs own
  neighbouring tiles along M (or N): each K step's B (or A) block is the
  same for both, so each CTA's producer issues half of it and TMA multicasts
  it into both SMEM rings (the pipeline's consumed-slot barriers span the
  cluster, so neither CTA overwrites a slot its partner still reads).
- The epilogue adds the bias (one TMA copy of the tile's slice, broadcast in
  registers) and the residual (TMA-copied into the output staging buffer),
  casts, and stores through SMEM with TMA in [epi_m, epi_n] pieces, double
  buffered so the store of one piece overlaps the next.
- On Blackwell the same entry point runs kernels/matmul_blackwell.py
  (tcgen05 MMA into tensor memory).
- SwiGLU: each consumer's accumulator is one block pair [gate | up]
  (tile_n = 2 * SWIGLU_BLOCK), so the gate and its up value sit in the same
  thread's registers and silu(gate) * up is computed before the store; the
  [M, N] gate/up product never reaches HBM.
- A stack of weights: with ``layer=``, b is [L, K, N] (bias [L, N]) and the
  kernel reads layer ``layer`` in place (a device scalar, read in the kernel),
  so a layer scan hands every iteration the same buffers. XLA records each
  scan iteration as a command buffer and must re-record one whose kernel
  arguments moved; a sliced weight moves every layer, the stack never does.
- Ragged edges: TMA fills out-of-bounds loads with zeros (so a partial K
  block contributes nothing) and clips out-of-bounds stores, so any M, N, K
  is handled without padding copies.
- Small M (decode): the tile is 64 rows (the wgmma minimum; the missing rows
  are TMA zero fill, never read from memory) and K is split over ``split_k``
  CTAs so that every SM streams its share of the weights. Each split writes
  fp32 partial sums; one fused XLA reduction adds them up with the bias,
  the activation and the residual, and casts.
- Small M, swapped operands (``Config.swap_ab``): each CTA owns 64 or 128
  weight columns and computes out^T = b^T a^T, the weight block as the
  wgmma's M side and the token rows as its N side (8 to 64; 128 to 256 for
  the mixed step's decode rows plus a prompt chunk, whose weights then
  stream from N / 64 CTAs, or twice that with a cluster's split, rather than
  from the 32 tiles of a 192 x 128 warp-specialized tile), so no SMEM goes
  to zero-filled rows and a [tile_k, tile_n] weight block is 8-64 KB a step.
  One warpgroup keeps ``stages`` steps of copies in flight; N / tile_n CTAs
  need no split at the layer shapes, so no partial sums leave the kernel.
  With ``cluster="n"`` two CTAs of neighbouring weight tiles share each
  step's activation block, half copied by each and TMA-multicast into both
  rings, which halves the block's L2 reads (over 64 rows they outweigh the
  weight block's); a slot is refilled once both CTAs have read it. On the
  H100 that was 1-10% slower than unpaired tiles at every shape tried
  (bench/results/matmul_h100_run3_cluster_n_rms192/); not measured on the H200.
  The tile is stored transposed through an untiled SMEM buffer (the ring's
  SMEM, free once the K loop is done: the ring can be that much deeper), the bias,
  the SwiGLU gate (128 columns: one [gate | up] block pair, so the gate's
  rows and the up rows sit in the same thread) and the residual applied on
  the way. With ``cluster="k"`` a tile's K is split over a cluster of CTAs,
  twice or four times the SMs streaming: each split stores its float32
  accumulator into the first split's SMEM (st.async into distributed shared
  memory, completing on that CTA's barrier), which adds them in split order
  and runs the epilogue, so no partial sums leave the kernel.
- The fused RMSNorm (swapped operands, no split): a row's scale is
  rsqrt(mean(a_j**2) + eps) over all of K, which every CTA sees anyway as
  its a blocks stream by. Each a block lands in a 64-row SMEM slot (rows
  past tile_m never written), so the slot is also a wgmma A operand: a
  second accumulator gathers the Gram matrix G = a_64 a^T [64, tile_m] over
  K, whose diagonal is each row's sum of squares (no a block leaves SMEM
  for the registers; the unwritten rows only reach G's masked-off rows).
  The scale multiplies the accumulator's columns before the bias. Other
  configs normalize a in XLA first.
- fp8 (the ``matmul_fp8`` op, kernels/matmul_fp8.py, through ``_run``'s
  ``scales``): a and b are float8_e4m3fn and b is stored [N, K], since fp8
  wgmma reads both operands K-major (bf16's [K, N] blocks are read
  transposed, which 8-bit types cannot be). The same schedules run on it; the
  epilogue first multiplies the float32 accumulator by a's row scales and
  b's column scales (TMA-copied beside the bias while the K loop runs).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mosaic import dsl, registry, target as target_lib, tuning
from mosaic.dsl import pl, plgpu

OP = "matmul"
IN_DTYPES = ("bfloat16", "float16")
OUT_DTYPES = ("bfloat16", "float16", "float32")
ACTIVATIONS = (None, "swiglu")
# Gate/up column block of the fused SwiGLU layout: one consumer's tile_n is a
# [gate | up] pair of blocks, so the two halves of its accumulator line up.
SWIGLU_BLOCK = 64


# --------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class Config(tuning.KernelConfig):
  """Tile shape and schedule of the Hopper kernel.

  tile_m x tile_n is one consumer warpgroup's accumulator; the CTA tile is
  twice that along ``wg_dim`` ("m" or "n"). ``split_k`` > 1 splits the K loop
  over that many CTAs (fp32 partials, reduced outside the kernel).
  ``persistent=False`` launches one CTA per output tile instead of one per SM:
  the hardware then hands tiles to SMs as they free up, which balances a
  weight stream whose tile count is not a multiple of the SM count (decode
  shapes), where a persistent CTA with one tile more than its neighbours
  would finish last.
  ``cluster`` ("m" or "n") pairs CTAs in 2-CTA clusters that own
  neighbouring output tiles along that dimension, so they share the other
  operand's block: "m" pairs share each B block [tile_k, cta_n], "n" pairs
  each A block [cta_m, tile_k]. The shared block is read from L2 once and
  TMA-multicast into both CTAs' SMEM, halving its L2 traffic.
  With ``swap_ab``, ``cluster="k"`` makes a weight tile's ``split_k`` CTAs
  one cluster: each sends its float32 partial into the first one's SMEM
  (distributed shared memory), which adds them in a fixed order and runs the
  epilogue, so no partials reach HBM and no reduction kernel follows.
  With ``swap_ab``, ``cluster="n"`` pairs CTAs of neighbouring weight tiles
  (same rows, same split): each step's activation block is the same for
  both, so each issues half of it, TMA-multicast into both rings.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  epi_m: int = 64
  epi_n: int = 64
  wg_dim: str = "n"
  grid_minor: str = "n"
  grid_width: int = 8
  split_k: int = 1
  persistent: bool = True
  swap_ab: bool = False
  cluster: str | None = None

  def __post_init__(self):
    if not isinstance(self.swap_ab, bool):
      raise ValueError(f"{self.swap_ab=} must be a bool")
    if self.stages < 2:
      raise ValueError(f"{self.stages=} must be >= 2")
    if self.split_k < 1:
      raise ValueError(f"{self.split_k=} must be >= 1")
    if self.swap_ab:
      # One warpgroup, one CTA per tile; wg_dim, grid_*, epi_* and
      # persistent do not apply.
      if self.cluster not in (None, "k", "n"):
        raise ValueError(f"swap_ab: {self.cluster=} must be None, 'k' (the splits of a "
                         "weight tile as one cluster) or 'n' (pairs of neighbouring weight "
                         "tiles sharing each activation block)")
      if self.cluster == "k" and not 2 <= self.split_k <= MAX_CLUSTER_K:
        raise ValueError(f"swap_ab: cluster='k' needs split_k in [2, {MAX_CLUSTER_K}]; got "
                         f"{self.split_k=}")
      if self.tile_n not in (64, 128):
        raise ValueError(f"swap_ab: {self.tile_n=} must be 64 or 128 (the wgmma's M rows)")
      if self.tile_m not in SWAP_TILE_M:
        raise ValueError(f"swap_ab: {self.tile_m=} must be one of {SWAP_TILE_M} (the wgmma's N)")
      if self.tile_k not in (64, 128, 256):
        raise ValueError(f"swap_ab: {self.tile_k=} must be 64, 128 or 256 (a TMA box)")
      return
    if self.tile_m not in (64, 128, 192, 256):
      raise ValueError(f"{self.tile_m=} must be one of 64, 128, 192, 256 (wgmma rows)")
    if self.tile_n not in (64, 128, 192, 256):
      # Narrower B tiles have rows under 128 bytes, whose swizzle Mosaic GPU
      # cannot lower for wgmma (interpret mode runs them; the GPU does not).
      raise ValueError(f"{self.tile_n=} must be one of 64, 128, 192, 256 (narrower B tiles "
                       "do not lower for Hopper wgmma)")
    if self.tile_k not in (64, 128):
      # 32 (64-byte rows of bf16) runs in interpret mode, but Mosaic GPU finds
      # no register layout for its wgmma operands (tests/kernels/test_gpu_lowering.py).
      raise ValueError(f"{self.tile_k=} must be 64 or 128 (32 does not lower for Hopper wgmma)")
    if self.epi_m % 64 or self.tile_m % self.epi_m:
      raise ValueError(f"{self.epi_m=} must be a multiple of 64 dividing {self.tile_m=}")
    if self.epi_n % 16 or self.tile_n % self.epi_n:
      # 8 columns of bf16 would need a 16-byte swizzle, which TMA lacks.
      raise ValueError(f"{self.epi_n=} must be a multiple of 16 dividing {self.tile_n=}")
    if self.wg_dim not in ("m", "n"):
      raise ValueError(f"{self.wg_dim=} must be 'm' or 'n'")
    if self.grid_minor not in ("m", "n"):
      raise ValueError(f"{self.grid_minor=} must be 'm' or 'n'")
    if self.grid_width < 1:
      raise ValueError(f"{self.grid_width=} must be >= 1")
    if self.cluster not in (None, "m", "n"):
      raise ValueError(f"{self.cluster=} must be None, 'm' or 'n'")
    if self.cluster is not None and (self.split_k > 1 or not self.persistent):
      # The pair walks the tiles together on a persistent grid; a split's
      # partials or a CTA per tile have no partner to share a block with.
      raise ValueError(f"cluster={self.cluster!r} needs split_k=1 and persistent=True; got "
                       f"{self.split_k=}, {self.persistent=}")

  @property
  def cta_m(self) -> int:
    return self.tile_m * (2 if self.wg_dim == "m" and not self.swap_ab else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (2 if self.wg_dim == "n" and not self.swap_ab else 1)

  def smem_bytes(self, in_itemsize: int = 2, out_itemsize: int = 2, rms: bool = False,
                 swiglu: bool = False, residual: bool = False) -> int:
    # fp8 operands (1-byte items) come with float32 row and column scales
    # (and their barriers, and the alignment of both buffers).
    scales = (self.tile_m + self.tile_n) * 4 + 1024 if in_itemsize == 1 else 0
    if self.swap_ab:
      a_rows = max(self.tile_m, RMS_ROWS) if rms else self.tile_m
      ring = self.stages * (a_rows + self.tile_n) * self.tile_k * in_itemsize
      # A fused gate halves the stored tile (a plain split gates after the sum).
      partials = self.split_k > 1 and self.cluster != "k"
      out_tn = self.tile_n // 2 if swiglu and not partials else self.tile_n
      # The staging tile reuses the ring's SMEM; the bias and a prefetched
      # residual tile live beside both.
      stage = self.tile_m * out_tn * (4 if partials or residual else out_itemsize)
      n = max(ring, stage) + self.tile_n * 4 + 1024
      if residual and not partials:
        n += self.tile_m * out_tn * out_itemsize
      if self.cluster == "k":  # the leader's receive buffers: a partial (and Gram) a split
        n += (self.split_k - 1) * (self.tile_n + (RMS_ROWS if rms else 0)) * self.tile_m * 4
      return n + scales
    ring = self.stages * (self.cta_m + self.cta_n) * self.tile_k * in_itemsize
    out_isz = 4 if self.split_k > 1 else out_itemsize
    epi = 2 * 2 * self.epi_m * self.epi_n * out_isz
    return ring + epi + 2 * self.tile_n * 4 + 1024 + 2 * scales


SMEM_LIMIT = 227 * 1024
# Token rows of a swapped tile (the wgmma's N, at most 256): the decode
# batches, and the mixed step's decode rows plus a prompt chunk (128, 192).
SWAP_TILE_M = (8, 16, 32, 64, 128, 192, 256)
# Largest cluster of split-K CTAs (cluster="k"); the portable cluster limit is 8.
MAX_CLUSTER_K = 4
# Rows of the a block with the fused RMSNorm: the wgmma's minimum M, so the
# block is also the A operand of the Gram product (see the module docstring).
RMS_ROWS = 64


# --------------------------------------------------------------------------
# Kernel body


def _kernel(layer_gmem, a_gmem, b_gmem, bias_gmem, res_gmem, rs_gmem, cs_gmem, out_gmem, *,
            cfg: Config, k_iters: int, out_dtype, activation):
  """Warp-specialized persistent body; ``out_gmem`` is [M, N] ([M, N / 2] with
  swiglu) or [splits, M, N] split-K partials (the activation comes after their
  sum). b is a [L, K, N] stack (bias [L, N]) of which layer_gmem[0] is used.
  fp8 (``rs_gmem``/``cs_gmem`` given): b is a [L, N, K] stack, K-major as fp8
  wgmma needs, and the accumulator is scaled by rs[M] (a's rows) times
  cs[L, N] (b's columns) before the bias."""
  layer = dsl.layer_index(layer_gmem, b_gmem.shape[0])
  b_gmem = b_gmem.at[layer]
  if bias_gmem is not None:
    bias_gmem = bias_gmem.at[layer]
  scaled = rs_gmem is not None
  if scaled:
    cs_gmem = cs_gmem.at[layer]
  m, _ = a_gmem.shape
  n = b_gmem.shape[0 if scaled else 1]
  tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
  cta_m, cta_n = cfg.cta_m, cfg.cta_n
  walk_m, walk_n = _walk(cfg, m, n)
  splits = cfg.split_k
  kps = dsl.cdiv(k_iters, splits)  # k blocks per split
  split_out = splits > 1
  dtype = a_gmem.dtype
  acc_out_dtype = jnp.float32 if split_out else out_dtype
  swiglu = activation == "swiglu" and not split_out
  # Columns of one consumer's output tile: half of its accumulator with swiglu.
  out_tn = tn // 2 if swiglu else tn
  out_ratio = 2 if swiglu else 1  # accumulator columns per output column

  epi_m, epi_n = cfg.epi_m, cfg.epi_n
  n_epi = (tm // epi_m) * (out_tn // epi_n)
  slots = min(2, n_epi)
  # Barriers a warpgroup: a residual copy a staging slot, the bias, the two scales.
  per_wg = 3 if scaled else 1
  a_tr = dsl.smem_transforms((cta_m, tk), dtype)
  b_block = (cta_n, tk) if scaled else (tk, cta_n)
  b_tr = dsl.smem_transforms(b_block, dtype)
  out_tr = dsl.smem_transforms((epi_m, epi_n), acc_out_dtype)

  # The operand block a cluster's pair shares is multicast to both CTAs.
  shared = lambda dim: dict(collective_axes=("cluster",)) if cfg.cluster == dim else {}

  def make_pipeline(body, compute_context):
    return dsl.warp_specialized_pipeline(
        body,
        grid=(kps,),
        in_specs=[
            plgpu.BlockSpec((cta_m, tk), lambda k: (0, k), transforms=a_tr,
                            **shared("n")),
            plgpu.BlockSpec(b_block, (lambda k: (0, k)) if scaled else (lambda k: (k, 0)),
                            transforms=b_tr, **shared("m")),
        ],
        stages=min(cfg.stages, kps) if kps > 1 else 2,
        num_compute_wgs=2,
        wg_axis="wg",
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None
  scratch = dict(
      pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), acc_out_dtype, transforms=out_tr),
      bias_smem=None if bias_gmem is None else plgpu.SMEM((2, tn), bias_gmem.dtype),
      rs_smem=plgpu.SMEM((2, tm), jnp.float32) if scaled else None,
      cs_smem=plgpu.SMEM((2, tn), jnp.float32) if scaled else None,
      barriers=plgpu.Barrier(num_barriers=2 * (slots + per_wg)),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(pipeline_allocs, out_smem, bias_smem, rs_smem, cs_smem, barriers):
    wg = lax.axis_index("wg")
    res_bar = lambda slot: barriers.at[wg * (slots + per_wg) + slot]
    bias_bar = barriers.at[wg * (slots + per_wg) + slots]
    rs_bar, cs_bar = (barriers.at[wg * (slots + per_wg) + slots + i] for i in (1, 2))

    @plgpu.nd_loop((walk_m * walk_n * splits,), collective_axes="sm")
    def _tiles(info: plgpu.NDLoopInfo):
      (lin,) = info.index
      split = lin % splits
      mn = lin // splits
      mi, ni = plgpu.planar_snake(
          mn, (walk_m, walk_n), 1 if cfg.grid_minor == "n" else 0, cfg.grid_width)
      if cfg.cluster == "m":
        mi = 2 * mi + lax.axis_index("cluster")
      elif cfg.cluster == "n":
        ni = 2 * ni + lax.axis_index("cluster")
      cta_ms = pl.ds(mi * cta_m, cta_m)
      cta_ns = pl.ds(ni * cta_n, cta_n)
      out_cta_ns = pl.ds(ni * (cta_n // out_ratio), cta_n // out_ratio)
      if cfg.wg_dim == "m":
        wg_ms, wg_ns, out_wg_ns = pl.ds(wg * tm, tm), slice(None), slice(None)
        wg_n0 = ni * cta_n
      else:
        wg_ms, wg_ns, out_wg_ns = slice(None), pl.ds(wg * tn, tn), pl.ds(wg * out_tn, out_tn)
        wg_n0 = ni * cta_n + wg * tn
      out_tile = (out_gmem.at[split] if split_out else out_gmem).at[cta_ms, out_cta_ns].at[
          wg_ms, out_wg_ns]

      def store_tile(acc):
        if scaled:  # the fp8 operands' scales: rows (a's tokens) times columns (b's)
          plgpu.barrier_wait(rs_bar)
          plgpu.barrier_wait(cs_bar)
          rs = plgpu.load(rs_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
          cs = plgpu.load(cs_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(0))
          acc = (acc * lax.broadcast_in_dim(rs, (tm, tn), [0])
                 * lax.broadcast_in_dim(cs, (tm, tn), [1]))
        if bias_gmem is not None:
          plgpu.barrier_wait(bias_bar)
          bias = plgpu.load(bias_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
          acc = acc + lax.broadcast_in_dim(bias.astype(jnp.float32), (tm, tn), [1])
        if swiglu:
          gate, up = acc[:, :out_tn], acc[:, out_tn:]
          acc = gate / (1.0 + jnp.exp(-gate)) * up
        # The previous tile's stores must have read their staging buffers.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for emi in range(tm // epi_m):
          for eni in range(out_tn // epi_n):
            ems = slice(emi * epi_m, (emi + 1) * epi_m)
            ens = slice(eni * epi_n, (eni + 1) * epi_n)
            slot = (emi * (out_tn // epi_n) + eni) % slots
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
            piece = acc[ems, ens]
            if res_gmem is not None:
              plgpu.copy_gmem_to_smem(
                  res_gmem.at[cta_ms, out_cta_ns].at[wg_ms, out_wg_ns].at[ems, ens],
                  out_smem.at[wg, slot], res_bar(slot))
              plgpu.barrier_wait(res_bar(slot))
              piece = piece + out_smem[wg, slot].astype(jnp.float32)
            out_smem[wg, slot] = piece.astype(acc_out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[ems, ens])

      def compute_context(run_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
        def _acc(acc_ref):
          if bias_gmem is not None:
            # Issued before the K loop so the copy hides behind it.
            plgpu.copy_gmem_to_smem(bias_gmem.at[pl.ds(wg_n0, tn)], bias_smem.at[wg], bias_bar)
          if scaled:
            plgpu.copy_gmem_to_smem(rs_gmem.at[cta_ms].at[wg_ms], rs_smem.at[wg], rs_bar)
            plgpu.copy_gmem_to_smem(cs_gmem.at[pl.ds(wg_n0, tn)], cs_smem.at[wg], cs_bar)
          # The named scopes are the regions of the in-kernel timeline
          # (dsl.kernel_timeline); they cost nothing otherwise.
          with jax.named_scope("k_loop"):
            run_pipeline(acc_ref)
          with jax.named_scope("epilogue"):
            store_tile(acc_ref[...])

      def mma(_, a_smem, b_smem, acc_ref):
        b_wg = dsl.transpose(b_smem.at[wg_ns]) if scaled else b_smem.at[:, wg_ns]
        plgpu.wgmma(acc_ref, a_smem.at[wg_ms], b_wg)
        plgpu.wgmma_wait(0)
        return acc_ref

      k0 = split * (kps * tk)
      make_pipeline(mma, compute_context)(
          a_gmem.at[cta_ms, pl.ds(k0, kps * tk)],
          (b_gmem.at[cta_ns, pl.ds(k0, kps * tk)] if scaled
           else b_gmem.at[pl.ds(k0, kps * tk), cta_ns]),
          allocations=pipeline_allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _swap_kernel(layer_gmem, a_gmem, b_gmem, *refs, cfg: Config, k_iters: int,
                 has_bias: bool, has_res: bool, split_out: bool, swiglu: bool,
                 rms_eps: float | None, cluster_k: bool, cluster_n: bool, scaled: bool = False):
  """One CTA per (tile_n weight columns n, tile_m rows m, split s) with
  swapped operands: acc [tile_n, tile_m] = b[ks, cols]^T a[rows, ks]^T summed
  over the split's K blocks, i.e. the transposed output tile. A single
  warpgroup issues the copies of a step ``stages`` ahead of its wgmma, so
  the weight stream never waits on compute (M <= 64 is little compute;
  taller tiles refill a slot one step later, see ``lag``).
  With ``swiglu`` the tile is one [gate | up] block pair and the output
  tile is [tile_m, tile_n / 2]. With ``rms_eps`` (no split) the a block is
  RMS_ROWS rows (the copies fill tile_m of them) and the rows' RMSNorm scale
  multiplies acc's columns. With ``cluster_k`` the splits are one cluster
  (axis "s"): split i > 0 stores its acc (and Gram) into slot i - 1 of split
  0's receive buffers, and split 0 adds them before its epilogue. With
  ``cluster_n`` two CTAs of neighbouring weight tiles (axis "c") share each
  step's a block, half issued by each and multicast into both rings: a slot
  is refilled only once both have read it (the ``consumed`` cluster barrier,
  one arrival from each CTA). fp8 (``scaled``): b is a [L, N, K] stack (its
  [tile_n, tile_k] blocks are the K-major A operand fp8 wgmma needs) and the
  accumulator is scaled by rs[M] (a's rows) times cs[L, N] (b's columns)."""
  refs = list(refs)
  bias_gmem = refs.pop(0) if has_bias else None
  res_gmem = refs.pop(0) if has_res else None
  rs_gmem, cs_gmem = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
  out_gmem, bias_smem, (bars, epi_bars), *refs = refs
  res_smem = refs.pop(0) if has_res else None
  scale_smem = (refs.pop(0), refs.pop(0)) if scaled else None
  consumed = refs.pop(0) if cluster_n else None
  recv = refs
  layer = dsl.layer_index(layer_gmem, b_gmem.shape[0])
  b_gmem = b_gmem.at[layer]
  ni, mi, s = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
  if cluster_n:
    ni = 2 * ni + lax.axis_index("c")
  tm, tn, tk, stages = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.stages
  kps = dsl.cdiv(k_iters, cfg.split_k)
  first = s * kps
  n_steps = jnp.minimum(kps, k_iters - first)  # >= 1 (see _splits)
  out_tn = tn // 2 if swiglu else tn
  rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
  out_cols = pl.ds(ni * out_tn, out_tn)
  # With the norm a slot is RMS_ROWS rows, of which the copy fills the first
  # tm: the rest is never written (the Gram rows it makes are masked off), so
  # the TMA unit moves no more than without the norm (zero fill is not free:
  # a 64-row box at M = 1 made qkv 1.5x slower on the H200).
  a_rows = tm if rms_eps is None else max(tm, RMS_ROWS)
  ring = lambda shape: plgpu.SMEM((stages, *shape), a_gmem.dtype,
                                  transforms=dsl.smem_transforms(shape, a_gmem.dtype))

  # The epilogue's operands, copied while the K loop runs (by the CTA that
  # runs the epilogue: a cluster's other splits never wait for them).
  @pl.when(s == 0 if cluster_k else True)
  def _():
    if bias_gmem is not None:
      plgpu.copy_gmem_to_smem(bias_gmem.at[layer, cols], bias_smem, epi_bars.at[0])
    if res_gmem is not None:
      plgpu.copy_gmem_to_smem(res_gmem.at[rows, out_cols], res_smem, epi_bars.at[1])
    if scaled:
      plgpu.copy_gmem_to_smem(rs_gmem.at[rows], scale_smem[0], epi_bars.at[2])
      plgpu.copy_gmem_to_smem(cs_gmem.at[layer, cols], scale_smem[1], epi_bars.at[3])

  # Up to 64 rows a step's wgmmas are short, and waiting for them before
  # refilling the slot keeps all `stages` blocks of the weight stream in
  # flight. Taller tiles (the mixed step's 128-256 rows) make the wgmmas
  # long enough to matter: step i's wgmmas run while step i - 1's slot refills.
  lag = 0 if tm <= 64 else 1
  groups = 1 if rms_eps is None else 2  # wgmma groups committed a step

  # The ring lives only through the K loop: the epilogue's staging tile
  # reuses its SMEM (see _run_swap), so the ring may be that much deeper.
  def k_phase(a_smem, b_smem):
    a_slot = lambda slot: a_smem.at[slot] if rms_eps is None else a_smem.at[slot, pl.ds(0, tm)]

    def issue(step, slot):
      ks = pl.ds((first + step) * tk, tk)
      plgpu.copy_gmem_to_smem(b_gmem.at[cols, ks] if scaled else b_gmem.at[ks, cols],
                              b_smem.at[slot], bars.at[slot])
      plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_slot(slot), bars.at[slot],
                              collective_axes="c" if cluster_n else None)

    with jax.named_scope("prologue"):
      for i in range(stages):
        @pl.when(i < n_steps)
        def _():
          issue(i, i)

    def k_loop(acc_ref, gram_ref=None):
      def body(i, carry):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(bars.at[slot])
        a_t = dsl.transpose(a_slot(slot))
        b_t = b_smem.at[slot] if scaled else dsl.transpose(b_smem.at[slot])
        plgpu.wgmma(acc_ref, b_t, a_t)
        if gram_ref is not None:  # G += a_64 a^T: row j's sum of squares at (j, j)
          plgpu.wgmma(gram_ref, a_smem.at[slot], a_t)
        # Step i - lag's slot is read: free for the step `stages` after it
        # (with a pair, once the partner has read it too).
        plgpu.wgmma_wait(lag * groups)
        done = i - lag
        done_slot = lax.rem(done + stages, jnp.int32(stages))
        if cluster_n:
          @pl.when(done >= 0)
          def _():
            plgpu.barrier_arrive(consumed.at[done_slot])

        @pl.when((done >= 0) & (done + stages < n_steps))
        def _():
          if cluster_n:
            plgpu.barrier_wait(consumed.at[done_slot])
          issue(done + stages, done_slot)

        return carry

      lax.fori_loop(0, n_steps, body, jnp.int32(0))
      if lag:
        plgpu.wgmma_wait(0)
        if cluster_n:
          plgpu.barrier_arrive(consumed.at[lax.rem(n_steps - 1, jnp.int32(stages))])
      if cluster_n:
        # The last `stages` steps' slots are never refilled: wait for the
        # partner's arrivals on them too, so it never signals a CTA that exited.
        for t in range(stages):
          step = n_steps - stages + t

          @pl.when(step >= 0)
          def _():
            plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.int32(stages))])
      if gram_ref is None:
        return acc_ref[...]
      return acc_ref[...], gram_ref[...]

    with jax.named_scope("k_loop"):
      accs = [plgpu.ACC((tn, tm), jnp.float32)]
      if rms_eps is not None:
        accs.append(plgpu.ACC((RMS_ROWS, tm), jnp.float32))
      return pl.run_scoped(k_loop, *accs)

  out = pl.run_scoped(k_phase, ring((a_rows, tk)), ring((tn, tk) if scaled else (tk, tn)))
  acc, gram = (out, None) if rms_eps is None else out

  def epilogue(acc, gram, out, staged_f32):
    # The transposed store needs an untiled buffer; float32 when a partial
    # leaves the kernel or a residual is added to it.
    dtype = jnp.float32 if staged_f32 or has_res else out_gmem.dtype
    pl.run_scoped(functools.partial(
        _swap_epilogue, acc, gram, out, a_gmem=a_gmem, bias_gmem=bias_gmem,
        res_gmem=res_gmem, res_smem=res_smem, bias_smem=bias_smem, epi_bars=epi_bars,
        rows=rows, out_cols=out_cols, swiglu=swiglu, rms_eps=rms_eps, scale_smem=scale_smem),
        plgpu.SMEM((tm, out_tn), dtype))

  if not cluster_k:
    epilogue(acc, gram, out_gmem.at[s] if split_out else out_gmem, staged_f32=split_out)
    return
  recv_bufs, recv_bars = recv
  parts = list(zip((acc, gram), recv_bufs))  # (acc and its buffer), (Gram and its)
  for i in range(1, cfg.split_k):
    @pl.when(s == i)
    def _send():
      with jax.named_scope("send"):
        for j, (x, buf) in enumerate(parts):
          plgpu.async_store_smem(x, buf.at[i - 1], recv_bars.at[j * (cfg.split_k - 1) + i - 1],
                                 cluster_idx=0, cluster_dim="s")

  @pl.when(s == 0)
  def _lead():
    with jax.named_scope("receive"):
      # Added in split order, so the sum does not depend on arrival order.
      sums = []
      for j, (x, buf) in enumerate(parts):
        for i in range(1, cfg.split_k):
          plgpu.barrier_wait(recv_bars.at[j * (cfg.split_k - 1) + i - 1])
          x = x + buf[i - 1]
        sums.append(x)
    epilogue(sums[0], sums[1] if gram is not None else None, out_gmem, staged_f32=False)


def _swap_epilogue(acc, gram, out, staged, *, a_gmem, bias_gmem, res_gmem, res_smem,
                   bias_smem, epi_bars, rows, out_cols, swiglu, rms_eps, scale_smem=None):
  """The swapped kernel's acc [tile_n, tile_m] (and Gram) -> its output tile
  in ``out``: the fp8 scales, the norm's row scale, bias, gate, transposed
  store through ``staged``, residual (prefetched into ``res_smem``)."""
  out_tn = acc.shape[0] // 2 if swiglu else acc.shape[0]
  with jax.named_scope("epilogue"):
    if scale_smem is not None:  # acc is transposed: columns are a's rows
      plgpu.barrier_wait(epi_bars.at[2])
      plgpu.barrier_wait(epi_bars.at[3])
      rs = plgpu.load(scale_smem[0], (), layout=plgpu.Layout.WGMMA.reduce(0))
      cs = plgpu.load(scale_smem[1], (), layout=plgpu.Layout.WGMMA.reduce(1))
      acc = (acc * lax.broadcast_in_dim(rs, acc.shape, [1])
             * lax.broadcast_in_dim(cs, acc.shape, [0]))
    if rms_eps is not None:
      layout = plgpu.Layout.WGMMA
      diag = (plgpu.broadcasted_iota(jnp.int32, gram.shape, 0, layout=layout)
              == plgpu.broadcasted_iota(jnp.int32, gram.shape, 1, layout=layout))
      ssq = jnp.where(diag, gram, 0.0).sum(axis=0)  # [tm]: row j's sum of squares
      scale = lax.rsqrt(ssq * (1.0 / a_gmem.shape[1]) + rms_eps)
      acc = acc * lax.broadcast_in_dim(scale, acc.shape, [1])
    if bias_gmem is not None:
      plgpu.barrier_wait(epi_bars.at[0])
      bias = plgpu.load(bias_smem, (), layout=plgpu.Layout.WGMMA.reduce(1))
      acc = acc + lax.broadcast_in_dim(bias.astype(jnp.float32), acc.shape, [0])
    if swiglu:
      gate, up = acc[:out_tn], acc[out_tn:]
      acc = gate / (1.0 + jnp.exp(-gate)) * up
    # A residual is added after the transposed store, both read back in one
    # plain layout.
    dsl.transpose(staged)[...] = plgpu.layout_cast(acc.astype(staged.dtype),
                                                   plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    if res_gmem is not None:
      plgpu.barrier_wait(epi_bars.at[1])
      y = staged[...] + res_smem[...].astype(jnp.float32)
      res_smem[...] = y.astype(res_smem.dtype)
      plgpu.commit_smem()
      staged = res_smem
    plgpu.copy_smem_to_gmem(staged, out.at[rows, out_cols])
    plgpu.wait_smem_to_gmem(0)


def _run_swap(layer_arr, a, b, bias, residual, scales=None, *, cfg: Config, k_iters: int,
              out_dtype, activation=None, rms_eps=None):
  """The ``swap_ab`` launch: grid (N / tile_n, M tiles, splits); returns the
  [M, N] output ([M, N / 2] with swiglu), or [splits, M, N] float32 partials
  (split-K without a cluster). ``scales``: fp8 (row_scale [M], col_scale
  [L, N]) with b a [L, N, K] stack."""
  m, _ = a.shape
  n = b.shape[-2] if scales is not None else b.shape[-1]
  cluster_k, cluster_n = _cluster_k(cfg), _cluster_n(cfg)
  split_out = cfg.split_k > 1 and not cluster_k
  if rms_eps is not None and split_out:
    raise ValueError("the fused RMSNorm needs every K block in one CTA or cluster")
  swiglu = activation == "swiglu" and not split_out
  tm, tn = cfg.tile_m, cfg.tile_n
  out_tn = tn // 2 if swiglu else tn
  operands = [layer_arr, a, b] + [x for x in (bias, residual) if x is not None]
  operands += list(scales or ())
  body = functools.partial(_swap_kernel, cfg=cfg, k_iters=k_iters, has_bias=bias is not None,
                           has_res=residual is not None, split_out=split_out, swiglu=swiglu,
                           rms_eps=rms_eps, cluster_k=cluster_k, cluster_n=cluster_n,
                           scaled=scales is not None)
  out_type = (jax.ShapeDtypeStruct((cfg.split_k, m, n), jnp.float32) if split_out
              else jax.ShapeDtypeStruct((m, n // 2 if swiglu else n), out_dtype))
  # The K loop's ring and the epilogue's staging tile are scoped in the
  # kernel (one after the other, in the same SMEM); the prefetched bias and
  # residual live throughout.
  scratch = [
      plgpu.SMEM((tn,), jnp.float32 if bias is None else bias.dtype),
      # The epilogue's copies: bias, residual (and the fp8 scales).
      (plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
       plgpu.Barrier(num_barriers=2 if scales is None else 4)),
  ]
  if residual is not None:
    scratch.append(plgpu.SMEM((tm, out_tn), out_dtype))
  if scales is not None:
    scratch += [plgpu.SMEM((tm,), jnp.float32), plgpu.SMEM((tn,), jnp.float32)]
  grid = dict(grid=(n // tn, dsl.cdiv(m, tm), cfg.split_k), grid_names=("n", "m", "s"))
  if cluster_n:  # pairs of weight tiles; each slot's "both have read it" barrier
    scratch.append(plgpu.ClusterBarrier(collective_axes=("c",), num_barriers=cfg.stages))
    grid = dict(grid=(n // tn // 2, dsl.cdiv(m, tm), cfg.split_k), grid_names=("n", "m", "s"),
                cluster=(2,), cluster_names=("c",))
  if cluster_k:  # split 0's receive buffers, one slot per other split, and their barriers
    recv = lambda rows: plgpu.SMEM((cfg.split_k - 1, rows, tm), jnp.float32,
                                   transforms=dsl.smem_transforms((rows, tm), jnp.float32))
    bufs = (recv(tn),) if rms_eps is None else (recv(tn), recv(RMS_ROWS))
    scratch += [bufs, plgpu.Barrier(num_barriers=len(bufs) * (cfg.split_k - 1))]
    grid = dict(grid=(n // tn, dsl.cdiv(m, tm)), grid_names=("n", "m"),
                cluster=(cfg.split_k,), cluster_names=("s",))
  return dsl.kernel(body, out_type=out_type, scratch_types=scratch, **grid)(*operands)


def _cluster_k(cfg: Config) -> bool:
  """Whether ``cfg``'s splits sum in a cluster's SMEM. The interpreter has no
  distributed shared memory, so there a cluster="k" config runs as plain
  split-K (partials summed by XLA): the same K ranges, the same result."""
  return cfg.swap_ab and cfg.cluster == "k" and cfg.split_k > 1 and not dsl.interpreting()


def _cluster_n(cfg: Config) -> bool:
  """Whether ``cfg``'s swapped tiles run in pairs sharing each activation
  block (multicast). The interpreter has no clusters: there the tiles run
  alone, each copying the whole block (the same result)."""
  return cfg.swap_ab and cfg.cluster == "n" and not dsl.interpreting()


def _num_sms() -> int:
  if dsl.interpreting():
    return 4
  return target_lib.current().ceilings.sms


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "activation", "rms_eps"))
def _run(a, b, bias, residual, layer=None, scales=None, *, cfg: Config, out_dtype,
         activation=None, rms_eps=None):
  """b [K, N] (bias [N]), or with ``layer`` a [L, K, N] stack (bias [L, N]).
  fp8 (``scales`` = (row_scale [M], col_scale [N] or [L, N])): b is [N, K]
  (or [L, N, K]), K-major."""
  if layer is None:  # one code path: a stack of one (free reshapes, a constant index)
    b, bias = b[None], None if bias is None else bias[None]
    if scales is not None:
      scales = (scales[0], scales[1][None])
  if scales is not None and bias is not None:
    # A 16-bit bias beside the float32 scales deadlocked the interpreter's
    # barriers; a float32 bias (N values) is the same sum.
    bias = bias.astype(jnp.float32)
  layer_arr = dsl.layer_operand(layer)  # clamped in the kernel
  k = a.shape[1]
  k_iters = dsl.cdiv(k, cfg.tile_k)
  splits = _splits(cfg, k)
  # A K too short to split runs in one CTA, and an odd count of weight tiles
  # has no pairs: no cluster then.
  n = b.shape[-2] if scales is not None else b.shape[-1]
  lone = ((splits == 1 and cfg.cluster == "k")
          or (cfg.swap_ab and cfg.cluster == "n" and (n // cfg.tile_n) % 2))
  cfg = dataclasses.replace(cfg, split_k=splits, cluster=None if lone else cfg.cluster)
  split_out = cfg.split_k > 1 and not _cluster_k(cfg)
  if rms_eps is not None and not fuses_rms(cfg, k):
    a, rms_eps = rms_rows(a, rms_eps), None  # an XLA fusion ahead of the kernel
  # Split partials get the bias, residual and activation in the reduction
  # below; the fp8 scales, per row and column, may scale each partial.
  keep = lambda x: None if split_out else x
  if cfg.swap_ab:
    out = _run_swap(layer_arr, a, b, keep(bias), keep(residual), scales, cfg=cfg,
                    k_iters=k_iters, out_dtype=jnp.dtype(out_dtype), activation=activation,
                    rms_eps=rms_eps)
  else:
    out = _run_persistent(layer_arr, a, b, keep(bias), keep(residual), scales, cfg=cfg,
                          k_iters=k_iters, out_dtype=jnp.dtype(out_dtype), activation=activation)
  if split_out:
    bias = None if bias is None else dsl.take_layer(bias, layer_arr[0])
    out = _epilogue(out.sum(axis=0), bias, residual, out_dtype, activation)
  return out


def _run_persistent(layer_arr, a, b, bias, residual, scales=None, *, cfg: Config, k_iters: int,
                    out_dtype, activation=None):
  """The warp-specialized launch: one CTA per SM (or per tile); returns the
  [M, N] output ([M, N / 2] with swiglu), or [splits, M, N] float32 partials.
  ``scales``: fp8 (row_scale [M], col_scale [L, N]) with b a [L, N, K] stack."""
  m = a.shape[0]
  n = b.shape[-2] if scales is not None else b.shape[-1]
  split_out = cfg.split_k > 1
  walk_m, walk_n = _walk(cfg, m, n)
  tiles = walk_m * walk_n * cfg.split_k
  grid = tiles if not cfg.persistent else max(1, min(_num_sms(), tiles))
  cluster = {}
  if cfg.cluster is not None:  # one grid entry per 2-CTA cluster and its pair of tiles
    grid = max(1, min(_num_sms() // 2, tiles))
    cluster = dict(cluster=(2,), cluster_names=("cluster",))
  out_n = n // 2 if activation == "swiglu" else n
  out_shape = (cfg.split_k, m, n) if split_out else (m, out_n)
  body = functools.partial(_kernel, cfg=cfg, k_iters=k_iters, out_dtype=out_dtype,
                           activation=activation)
  operands = [layer_arr, a, b]
  names = ["layer", "a", "b"]
  rs, cs = scales or (None, None)
  for name, x in (("bias", bias), ("residual", residual), ("rs", rs), ("cs", cs)):
    if x is not None:
      operands.append(x)
      names.append(name)

  def entry(*refs):
    *ins, out_ref = refs
    r = dict(zip(names, ins))
    body(r["layer"], r["a"], r["b"], r.get("bias"), r.get("residual"), r.get("rs"), r.get("cs"),
         out_ref)

  return dsl.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32 if split_out else out_dtype),
      grid=(grid,),
      grid_names=("sm",),
      **cluster,
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(*operands)


def _walk(cfg: Config, m: int, n: int) -> tuple[int, int]:
  """Output tiles the grid walks along M and N: a 2-CTA cluster's pair counts
  once (with an odd count, the last pair's second tile lies past the edge:
  TMA reads it as zeros and clips its store, so the partner only idles along)."""
  m_iters, n_iters = dsl.cdiv(m, cfg.cta_m), dsl.cdiv(n, cfg.cta_n)
  return (dsl.cdiv(m_iters, 2) if cfg.cluster == "m" else m_iters,
          dsl.cdiv(n_iters, 2) if cfg.cluster == "n" else n_iters)


def _splits(cfg: Config, k: int) -> int:
  """The split count a call runs: every split gets at least one K block (the
  last may be partly zero fill), so a short K can leave fewer than asked."""
  if cfg.split_k == 1:
    return 1
  k_iters = dsl.cdiv(k, cfg.tile_k)
  return dsl.cdiv(k_iters, dsl.cdiv(k_iters, cfg.split_k))


def fuses_rms(cfg: Config, k: int) -> bool:
  """Whether ``cfg`` normalizes a's rows in the kernel (``rms_eps``): the
  swapped-operand kernel with every K block in one CTA, or in one cluster,
  and at most RMS_ROWS token rows (the Gram a_64 a^T holds the sums of
  squares of 64 rows; a taller one would cost more wgmmas than the tile)."""
  return (cfg.swap_ab and cfg.tile_m <= RMS_ROWS
          and (_splits(cfg, k) == 1 or _cluster_k(cfg)))


def rms_rows(a, eps: float):
  """a's rows divided by their root mean square (an RMSNorm without its
  weight), in float32, cast back to a's dtype."""
  x = a.astype(jnp.float32)
  return (x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(a.dtype)


def fold_rms_weight(weight, b):
  """b [..., K, N] with RMSNorm weight [..., K] folded into its rows:
  rms_norm(a, weight) @ b == rms_rows(a) @ fold_rms_weight(weight, b) (up to
  the rounding of the product to b's dtype)."""
  return (b.astype(jnp.float32) * weight.astype(jnp.float32)[..., :, None]).astype(b.dtype)


def _swiglu_tile_error(cfg: Config, k: int) -> str | None:
  """Why ``cfg`` cannot fuse the SwiGLU gate (None if it can): without split-K
  each consumer's tile must be one [gate | up] block pair."""
  if _splits(cfg, k) > 1 and cfg.cluster != "k":
    return None  # the gate runs after the partial sums, outside the kernel
  if cfg.swap_ab:
    if cfg.tile_n != 2 * SWIGLU_BLOCK:
      return (f"swiglu with swap_ab needs tile_n = 2 x SWIGLU_BLOCK = {2 * SWIGLU_BLOCK} (one "
              f"[gate | up] block pair); got {cfg.tile_n=}")
    return None
  if cfg.tile_n != 2 * SWIGLU_BLOCK or SWIGLU_BLOCK % cfg.epi_n:
    return (f"swiglu needs tile_n = 2 x SWIGLU_BLOCK = {2 * SWIGLU_BLOCK} and epi_n dividing "
            f"{SWIGLU_BLOCK}; got {cfg.tile_n=}, {cfg.epi_n=}")
  return None


# --------------------------------------------------------------------------
# Public wrapper


def swiglu_columns(gate, up):
  """gate/up [..., F] (numpy or jax) -> [..., 2F] in the fused SwiGLU column
  order: per block of SWIGLU_BLOCK features, their gate columns then their up
  columns. F must be a multiple of SWIGLU_BLOCK."""
  xp = np if isinstance(gate, np.ndarray) else jnp
  f = gate.shape[-1]
  if f % SWIGLU_BLOCK or up.shape != gate.shape:
    raise ValueError(f"gate and up must both be [..., F] with F a multiple of {SWIGLU_BLOCK}; "
                     f"got {gate.shape} and {up.shape}")
  lead = gate.shape[:-1]
  blocks = lambda x: x.reshape(*lead, f // SWIGLU_BLOCK, 1, SWIGLU_BLOCK)
  return xp.concatenate([blocks(gate), blocks(up)], axis=-2).reshape(*lead, 2 * f)


def swiglu_split(w):
  """Inverse of ``swiglu_columns``: (gate, up), each [..., F]."""
  lead, n = w.shape[:-1], w.shape[-1]
  y = w.reshape(*lead, n // (2 * SWIGLU_BLOCK), 2, SWIGLU_BLOCK)
  return y[..., 0, :].reshape(*lead, n // 2), y[..., 1, :].reshape(*lead, n // 2)


def swiglu(y):
  """silu(gate) * up of a float32 [..., N] in the ``swiglu_columns`` order -> [..., N / 2]."""
  gate, up = swiglu_split(y)
  return jax.nn.silu(gate) * up


def _layer_view(b, bias, layer):
  """(b, bias) as one layer's shapes for the checks below. With ``layer``
  (an int or an int32 scalar array, e.g. a layer scan's index), b must be a
  [L, K, N] stack and bias [L, N]; a traced index is clamped to [0, L)."""
  if layer is None:
    return b, bias
  if getattr(b, "ndim", None) != 3:
    raise ValueError(f"with layer=, b must be a [L, K, N] stack; got {jnp.shape(b)=}")
  dsl.check_layer(layer, b.shape[0])
  if bias is not None and (bias.ndim != 2 or bias.shape[0] != b.shape[0]):
    raise ValueError(f"with layer=, bias must be [L, N] with L={b.shape[0]}; got {bias.shape=}")
  one = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return one(b), one(bias)


def check_epilogue(m: int, n: int, bias, residual, activation) -> None:
  """The epilogue operands of an [M, N] product (also matmul_fp8's): the
  activation, bias [N] and residual [M, N] ([M, N / 2] with swiglu)."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")
  out_n = n
  if activation == "swiglu":
    if n % (2 * SWIGLU_BLOCK):
      raise ValueError(f"swiglu needs N={n} to be whole [gate | up] blocks of "
                       f"2 x {SWIGLU_BLOCK} columns (see swiglu_columns)")
    out_n = n // 2
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"bias must be [N]={n}; got {bias.shape=}")
  if residual is not None and tuple(residual.shape) != (m, out_n):
    raise ValueError(f"residual must be [M, N{' / 2' if activation else ''}]={(m, out_n)}; "
                     f"got {residual.shape=}")


def _check(a, b, bias, residual, out_dtype, activation=None, layer=None, rms_eps=None):
  """Shapes and dtypes every backend accepts; returns the output dtype."""
  if rms_eps is not None and not (isinstance(rms_eps, (int, float)) and 0 <= rms_eps < math.inf):
    raise ValueError(f"{rms_eps=} must be None or a finite float >= 0")
  b, bias = _layer_view(b, bias, layer)
  if getattr(a, "ndim", None) != 2 or getattr(b, "ndim", None) != 2:
    raise ValueError(f"matmul needs 2D a[M, K] and b[K, N]; got {jnp.shape(a)=}, {jnp.shape(b)=}")
  m, k = a.shape
  k2, n = b.shape
  if k != k2:
    raise ValueError(f"contracting dims differ: {a.shape=} {b.shape=}")
  if min(m, n, k) < 1:
    raise ValueError(f"empty matmul is not supported: {a.shape=} {b.shape=}")
  check_epilogue(m, n, bias, residual, activation)
  out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"{out_dtype=} must be a floating dtype")
  return out_dtype


def _mosaic_why_not(a, b, *, bias=None, residual=None, out_dtype=None, activation=None,
                    config=None, layer=None, rms_eps=None) -> str | None:
  try:
    out_dtype = _check(a, b, bias, residual, out_dtype, activation, layer, rms_eps)
  except ValueError as e:
    return str(e)
  b, bias = _layer_view(b, bias, layer)
  kind = target_lib.current().kind
  if kind not in ("hopper", "blackwell", "cpu"):
    return f"the mosaic matmul kernels target Hopper and Blackwell; this device is {kind}"
  if a.dtype != b.dtype or a.dtype.name not in IN_DTYPES:
    return f"inputs must both be one of {IN_DTYPES}; got {a.dtype=}, {b.dtype=}"
  if out_dtype.name not in OUT_DTYPES:
    return f"{out_dtype=} must be one of {OUT_DTYPES}"
  itemsize = a.dtype.itemsize
  # TMA needs 16-byte aligned row strides in global memory.
  for what, cols, isz in (("K", a.shape[1], itemsize), ("N", b.shape[1], itemsize),
                          ("N", b.shape[1], out_dtype.itemsize)):
    if (cols * isz) % 16:
      return f"{what}={cols} x {isz} bytes is not a multiple of 16 bytes (TMA row alignment)"
  # TMA's tiled copies to and from swizzled SMEM need each tiled global
  # dimension to be smaller than its tile or a multiple of it: rows tile by 8,
  # K and N by up to 64 elements (the H200 rejected N = K = 1000 at lowering).
  # Other shapes are left to another backend.
  m, k, n = a.shape[0], a.shape[1], b.shape[1]
  if m >= 8 and m % 8:
    return f"M={m} must be below 8 or a multiple of 8 (TMA tiles rows by 8)"
  for what, size in (("K", k), ("N", n)):
    if size % 64:
      return f"{what}={size} must be a multiple of 64 (TMA tiles of 64 elements)"
  if bias is not None and bias.dtype.name not in IN_DTYPES + ("float32",):
    return f"{bias.dtype=} must be one of {IN_DTYPES + ('float32',)}"
  if residual is not None and residual.dtype != out_dtype:
    return f"{residual.dtype=} must equal the output dtype {out_dtype}"
  if activation == "swiglu" and isinstance(config, Config):
    return _swiglu_tile_error(config, k)
  return None


def heuristic(m: int, n: int, k: int, num_sms: int = 132, itemsize: int = 2) -> Config:
  """A config from the shape alone: big tiles for big M, split-K to fill the SMs.
  fp8 (``itemsize`` 1) keeps a 128-byte K block (the swizzle fp8 wgmma reads)
  and streams small M's weights through swapped tiles, split in a cluster."""
  if itemsize == 1:
    if m <= 64:
      tile_m = next(t for t in SWAP_TILE_M if t >= m)
      split = max(1, min(MAX_CLUSTER_K, num_sms // max(1, n // 128), dsl.cdiv(k, 256)))
      return fit_smem(Config(tile_m=tile_m, tile_n=128, tile_k=256, stages=6, swap_ab=True,
                             split_k=split, cluster="k" if split > 1 else None), 1)
    cfg = heuristic(m, n, k, num_sms)
    return fit_smem(dataclasses.replace(cfg, tile_k=128), 1)
  if m <= 64:
    cfg = Config(tile_m=64, tile_n=128, tile_k=64, stages=4, wg_dim="n")
  elif m <= 128:
    cfg = Config(tile_m=64, tile_n=128, tile_k=64, stages=5, wg_dim="m")
  else:
    cfg = Config(tile_m=128, tile_n=128, tile_k=64, stages=4, wg_dim="n")
  tiles = dsl.cdiv(m, cfg.cta_m) * dsl.cdiv(n, cfg.cta_n)
  k_iters = dsl.cdiv(k, cfg.tile_k)
  if tiles < 0.75 * num_sms and k_iters >= 8:
    # One wave: a second, partial wave would cost as much as the first.
    split = max(1, min(k_iters // 4, num_sms // tiles))
    cfg = dataclasses.replace(cfg, split_k=split)
  return fit_smem(cfg)


def fit_smem(cfg: Config, in_itemsize: int = 2, out_itemsize: int = 2,
             rms: bool = False, swiglu: bool = False, residual: bool = False) -> Config:
  """``cfg`` with pipeline stages given up (down to 2) until it fits in SMEM:
  float32 outputs and split-K partials double the epilogue buffers, the
  fused RMSNorm's a blocks are 64 rows, and a swapped tile's residual is
  prefetched beside the ring."""
  while (cfg.smem_bytes(in_itemsize, out_itemsize, rms, swiglu, residual) > SMEM_LIMIT
         and cfg.stages > 2):
    cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
  return cfg


# Row buckets of the tuning table: the decode batches (1, 16, 64), the mixed
# step's decode batch plus a prompt chunk (64 + 64, 64 + 128, 64 + 256,
# 64 + 512), and prefill. Between 256 and 2,048 rows one config does not fit
# all: 128 x 256 CTAs over 320 rows of N = 6,144 are 72 CTAs on 132 SMs.
M_BUCKETS = (1, 16, 64, 128, 192, 256, 320, 576, 2048, 8192)


def tuning_key(m: int, n: int, k: int, dtype, activation=None, rms: bool = False) -> str:
  """The table key of a shape; a fused activation has entries of its own
  (``act=swiglu``), since its tile must hold whole [gate | up] pairs, and so
  does the fused RMSNorm (``norm=rms``), whose a blocks are 64 rows."""
  dims = dict(m=tuning.bucket(m, M_BUCKETS), n=n, k=k, dtype=jnp.dtype(dtype).name)
  if activation is not None:
    dims["act"] = activation
  if rms:
    dims["norm"] = "rms"
  return tuning.shape_key(**dims)


def pick_config(m: int, n: int, k: int, dtype, activation=None, rms: bool = False) -> Config:
  """The tuning table's config for the shape: the most specific entry of
  (activation and norm, activation, plain shape), else the heuristic's. A
  SwiGLU tile without split-K is fitted to one [gate | up] block pair per
  consumer, keeping the shape's schedule."""
  sms = 132 if dsl.interpreting() else _num_sms()
  plain = lambda: tuning.lookup(OP, tuning_key(m, n, k, dtype), Config,
                                lambda: heuristic(m, n, k, sms, jnp.dtype(dtype).itemsize))
  act = plain if activation is None else lambda: tuning.lookup(
      OP, tuning_key(m, n, k, dtype, activation), Config, plain)
  cfg = act() if not rms else tuning.lookup(
      OP, tuning_key(m, n, k, dtype, activation, rms=True), Config, act)
  if activation == "swiglu" and _swiglu_tile_error(cfg, k):
    cfg = dataclasses.replace(cfg, tile_n=2 * SWIGLU_BLOCK, epi_n=min(cfg.epi_n, SWIGLU_BLOCK))
  return cfg


def matmul_mosaic(a, b, *, bias=None, residual=None, out_dtype=None, activation=None,
                  config: Config | None = None, layer=None, rms_eps=None):
  """The Hopper kernel; ``config`` overrides the tuning table / heuristic."""
  why = _mosaic_why_not(a, b, bias=bias, residual=residual, out_dtype=out_dtype,
                        activation=activation, config=config, layer=layer, rms_eps=rms_eps)
  if why is not None:
    raise ValueError(f"matmul mosaic: {why}")
  out_dtype = _check(a, b, bias, residual, out_dtype, activation, layer, rms_eps)
  m, k = a.shape
  n = b.shape[-1]
  if target_lib.current().kind == "blackwell":
    if rms_eps is not None:  # the tcgen05 kernel has no fused norm: XLA's fusion first
      a = rms_rows(a, rms_eps)
    if layer is not None:  # the tcgen05 kernel takes one weight: XLA slices the layer
      b, bias = dsl.take_layer(b, layer), dsl.take_layer(bias, layer)
    from kernels import matmul_blackwell as bw

    if config is not None and not isinstance(config, bw.Config):
      raise ValueError(f"on Blackwell config must be a matmul_blackwell.Config; got {config=}")
    if activation is not None:  # the tcgen05 kernel has no fused activation yet
      y = bw.run(a, b, bias, None, cfg=config or bw.heuristic(m, n, k),
                 out_dtype=jnp.dtype(jnp.float32), num_sms=_num_sms())
      return _epilogue(y, None, residual, out_dtype, activation)
    return bw.run(a, b, bias, residual, cfg=config or bw.heuristic(m, n, k),
                  out_dtype=out_dtype, num_sms=_num_sms())
  if config is not None and not isinstance(config, Config):
    raise ValueError(f"on Hopper config must be a matmul.Config; got {config=}")
  rms = rms_eps is not None
  isz = (a.dtype.itemsize, out_dtype.itemsize)
  # A picked config (heuristic or table, chosen for bf16 out) is fitted to
  # this call's output dtype; an explicit one is the caller's to fix.
  swiglu = activation == "swiglu"
  res = residual is not None
  cfg = config or fit_smem(pick_config(m, n, k, a.dtype, activation, rms), *isz,
                           rms=rms, swiglu=swiglu, residual=res)
  need = cfg.smem_bytes(*isz, rms=rms and fuses_rms(cfg, k), swiglu=swiglu, residual=res)
  if need > SMEM_LIMIT:
    raise ValueError(f"{cfg=} needs {need} bytes of SMEM > {SMEM_LIMIT}")
  if activation == "swiglu" and (why := _swiglu_tile_error(cfg, k)):
    raise ValueError(f"matmul mosaic: {why}")
  return _run(a, b, bias, residual, layer, cfg=cfg, out_dtype=out_dtype, activation=activation,
              rms_eps=None if rms_eps is None else float(rms_eps))


def _epilogue(acc, bias, residual, out_dtype, activation):
  """float32 acc [M, N] -> act(acc + bias) + residual, cast."""
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)
  if activation == "swiglu":
    acc = swiglu(acc)
  if residual is not None:
    acc = acc + residual.astype(jnp.float32)
  return acc.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "activation", "rms_eps"))
def _xla(a, b, bias, residual, out_dtype, activation, rms_eps=None):
  if rms_eps is not None:
    a = rms_rows(a, rms_eps)
  acc = jnp.dot(a, b, preferred_element_type=jnp.float32)
  return _epilogue(acc, bias, residual, out_dtype, activation)


def matmul_xla(a, b, *, bias=None, residual=None, out_dtype=None, activation=None, layer=None,
               rms_eps=None):
  """cuBLAS (through XLA) with the norm and the epilogue left to XLA's fusions."""
  out_dtype = _check(a, b, bias, residual, out_dtype, activation, layer, rms_eps)
  if layer is not None:
    b, bias = dsl.take_layer(b, layer), dsl.take_layer(bias, layer)
  return _xla(a, b, bias, residual, out_dtype, activation,
              None if rms_eps is None else float(rms_eps))


# --------------------------------------------------------------------------
# Reference


def matmul_reference(a, b, *, bias=None, residual=None, out_dtype=None, activation=None,
                     layer=None, rms_eps=None):
  """The meaning of the op, in float32 (returned in float32)."""
  _check(a, b, bias, residual, out_dtype, activation, layer, rms_eps)
  if layer is not None:
    b, bias = dsl.take_layer(b, layer), dsl.take_layer(bias, layer)
  f = lambda x: jnp.asarray(x, jnp.float32)
  a = f(a)
  if rms_eps is not None:
    a = a * lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + rms_eps)
  out = jnp.dot(a, f(b), precision=lax.Precision.HIGHEST)
  return _epilogue(out, bias, residual, jnp.float32, activation)


def _reference_backend(a, b, *, bias=None, residual=None, out_dtype=None, activation=None,
                       layer=None, rms_eps=None):
  out_dtype = _check(a, b, bias, residual, out_dtype, activation, layer, rms_eps)
  return matmul_reference(a, b, bias=bias, residual=residual, activation=activation,
                          layer=layer, rms_eps=rms_eps).astype(out_dtype)


def _valid(a, b, *, bias=None, residual=None, out_dtype=None, activation=None,
           config=None, layer=None, rms_eps=None) -> str | None:
  if config is not None:
    return f"config= applies to the mosaic backend only; got {config=}"
  try:
    _check(a, b, bias, residual, out_dtype, activation, layer, rms_eps)
  except ValueError as e:
    return str(e)
  return None


# --------------------------------------------------------------------------
# Registration

_op = registry.op(OP, "act(a[M,K] @ b[K,N] (+ bias[N])) (+ residual), fp32 accumulation; "
                      "act: none or swiglu (fused gate/up, output [M, N/2]); with layer=, "
                      "b is a [L, K, N] stack (bias [L, N]) and b[layer] is used; with "
                      "rms_eps=, a's rows are RMS-normalized first (norm weight folded into b)")
_op.register("mosaic", matmul_mosaic, supports=_mosaic_why_not,
             doc="Hopper wgmma, warp-specialized, persistent; swapped operands or split-K "
                 "for small M")
_op.register("xla", matmul_xla, supports=_valid, doc="jnp.dot (cuBLAS on GPU)")
_op.register("reference", _reference_backend, supports=_valid, doc="float32 jnp")
# Blackwell keeps cuBLAS first until the tcgen05 kernel has run on a card.
_op.set_defaults(hopper=("mosaic", "xla"), blackwell=("xla", "mosaic"), cpu=("xla", "reference"),
                 default=("xla", "reference"))
