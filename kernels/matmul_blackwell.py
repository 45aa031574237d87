"""matmul on Blackwell (sm_100a): tcgen05 MMA into tensor memory.

Same op and meaning as kernels/matmul.py (``a @ b (+ bias) (+ residual)``,
fp32 accumulation); ``kernels.matmul.matmul_mosaic`` calls this file when the
target is Blackwell. How data flows:

- A persistent grid of one CTA per SM walks the output tiles in planar-snake
  order. Each CTA has two warpgroups.
- Warpgroup 0 splits into warps: warp 0 issues TMA copies of A [tile_m,
  tile_k] and B [tile_k, tile_n] blocks into a ring of ``stages`` swizzled
  SMEM slots; warp 1 issues ``tcgen05_mma`` on each slot into one of two
  fp32 accumulators in tensor memory (TMEM), releasing the slot through the
  MMA's completion barrier and signalling the tile's end with a commit.
- Warpgroup 1 is the epilogue: it waits for a tile's accumulator, reads it
  from TMEM in [tile_m, epi_n] pieces, adds bias and residual (TMA-copied into
  the staging buffer), casts and stores through SMEM with TMA. Two TMEM
  accumulators let the MMAs of tile i+1 run while tile i is stored.
- Ragged M, N, K: TMA fills out-of-bounds loads with zeros and clips stores.

Status: checked in Mosaic GPU interpret mode (the interpreter runs tcgen05)
and lowered for the B200 (sm_100a) on CPU in CI (tests/kernels/test_gpu_lowering.py);
no Blackwell card was available to run ptxas on it or time it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mosaic import dsl, tuning
from mosaic.dsl import pl, plgpu

_TMA_WARP, _MMA_WARP = 0, 1
_MMA_WG, _STORE_WG = 0, 1


@dataclasses.dataclass(frozen=True)
class Config(tuning.KernelConfig):
  tile_m: int = 128
  tile_n: int = 256
  tile_k: int = 64
  stages: int = 4
  epi_n: int = 64
  grid_minor: str = "n"
  grid_width: int = 8

  def __post_init__(self):
    if self.tile_m != 128:
      raise ValueError(f"{self.tile_m=} must be 128 (one CTA's tcgen05 M)")
    if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
      raise ValueError(f"{self.tile_n=} must be a multiple of 16 in [16, 256]")
    if self.tile_k not in (64, 128) and not (self.tile_k == 32 and self.tile_n < 64):
      # Mosaic GPU lowers 32-element K blocks for tcgen05 only with narrow N tiles.
      raise ValueError(f"{self.tile_k=} must be 64 or 128 (32 does not lower for tcgen05 "
                       f"with {self.tile_n=} >= 64)")
    if self.stages < 2:
      raise ValueError(f"{self.stages=} must be >= 2")
    if self.epi_n % 16 or self.tile_n % self.epi_n:
      # 8 columns of bf16 would need a 16-byte swizzle, which TMA lacks.
      raise ValueError(f"{self.epi_n=} must be a multiple of 16 dividing {self.tile_n=}")
    if self.grid_minor not in ("m", "n"):
      raise ValueError(f"{self.grid_minor=} must be 'm' or 'n'")
    if self.grid_width < 1:
      raise ValueError(f"{self.grid_width=} must be >= 1")


def _kernel(a_gmem, b_gmem, bias_gmem, res_gmem, out_gmem, *, cfg: Config):
  m, k = a_gmem.shape
  n = b_gmem.shape[1]
  tm, tn, tk, epi_n = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.epi_n
  m_iters, n_iters, k_iters = dsl.cdiv(m, tm), dsl.cdiv(n, tn), dsl.cdiv(k, tk)
  stages = cfg.stages
  dtype, out_dtype = a_gmem.dtype, out_gmem.dtype

  scratch = dict(
      a_smem=plgpu.SMEM((stages, tm, tk), dtype, transforms=dsl.smem_transforms((tm, tk), dtype)),
      b_smem=plgpu.SMEM((stages, tk, tn), dtype, transforms=dsl.smem_transforms((tk, tn), dtype)),
      acc_tmem=plgpu.TMEM((tm, 2 * tn), jnp.float32),
      out_smem=plgpu.SMEM((2, tm, epi_n), out_dtype,
                          transforms=dsl.smem_transforms((tm, epi_n), out_dtype)),
      bias_smem=None if bias_gmem is None else plgpu.SMEM((tn,), bias_gmem.dtype),
      load_bar=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      consumed_bar=plgpu.Barrier(num_arrivals=1, num_barriers=stages, orders_tensor_core=True),
      mma_done_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
      store_done_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
      epi_bar=plgpu.Barrier(num_arrivals=1, num_barriers=3),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(a_smem, b_smem, acc_tmem, out_smem, bias_smem, load_bar, consumed_bar,
             mma_done_bar, store_done_bar, epi_bar):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tiles(info: plgpu.NDLoopInfo):
      (lin,) = info.index
      local = info.local_index
      mi, ni = plgpu.planar_snake(
          lin, (m_iters, n_iters), 1 if cfg.grid_minor == "n" else 0, cfg.grid_width)
      ms, ns = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
      acc_slot = lax.rem(local, 2)
      acc = acc_tmem.at[:, pl.ds(acc_slot * tn, tn)]
      # Global K-step counter: ring slots and barrier phases continue across tiles.
      step0 = local * k_iters

      @pl.when(wg == _MMA_WG)
      def _():
        @plgpu.warp_map
        def _per_warp(warp):
          @pl.when(warp == _TMA_WARP)
          def _load():
            def body(ki, _):
              step = step0 + ki
              slot = lax.rem(step, stages)

              @pl.when(step >= stages)
              def _():
                plgpu.barrier_wait(consumed_bar.at[slot])

              ks = pl.ds(ki * tk, tk)
              plgpu.copy_gmem_to_smem(a_gmem.at[ms, ks], a_smem.at[slot], load_bar.at[slot])
              plgpu.copy_gmem_to_smem(b_gmem.at[ks, ns], b_smem.at[slot], load_bar.at[slot])

            lax.fori_loop(0, k_iters, body, None)

          @pl.when(warp == _MMA_WARP)
          def _mma():
            # The accumulator slot is free once the epilogue two tiles back read it.
            @pl.when(local >= 2)
            def _():
              plgpu.barrier_wait(store_done_bar.at[acc_slot])

            def body(ki, _):
              slot = lax.rem(step0 + ki, stages)
              plgpu.barrier_wait(load_bar.at[slot])
              plgpu.tcgen05_mma(acc, a_smem.at[slot], b_smem.at[slot], consumed_bar.at[slot],
                                accumulate=ki > 0)

              @pl.when(ki == k_iters - 1)
              def _():
                plgpu.tcgen05_commit_arrive(mma_done_bar.at[acc_slot])

            lax.fori_loop(0, k_iters, body, None)

      @pl.when(wg == _STORE_WG)
      def _():
        out_tile = out_gmem.at[ms, ns]
        bias = None
        if bias_gmem is not None:
          plgpu.copy_gmem_to_smem(bias_gmem.at[ns], bias_smem, epi_bar.at[2])
          plgpu.barrier_wait(epi_bar.at[2])
        plgpu.barrier_wait(mma_done_bar.at[acc_slot])
        for ei in range(tn // epi_n):
          slot = ei % 2
          cs = pl.ds(ei * epi_n, epi_n)
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          piece = plgpu.async_load_tmem(acc.at[:, cs])
          if bias_gmem is not None:
            bias = plgpu.load(bias_smem.at[cs], layout=plgpu.Layout.TCGEN05.reduce(0))
            piece = piece + lax.broadcast_in_dim(bias.astype(jnp.float32), (tm, epi_n), [1])
          if res_gmem is not None:
            plgpu.copy_gmem_to_smem(res_gmem.at[ms, ns].at[:, cs], out_smem.at[slot],
                                    epi_bar.at[slot])
            plgpu.barrier_wait(epi_bar.at[slot])
            piece = piece + out_smem[slot].astype(jnp.float32)
          out_smem[slot] = piece.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem.at[slot], out_tile.at[:, cs])
        plgpu.wait_load_tmem()
        plgpu.barrier_arrive(store_done_bar.at[acc_slot])
        # The bias buffer is refilled for the next tile only after it was read.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # Every barrier arrival must be observed before the CTA exits: the last
    # ``stages`` slot releases and the last two epilogue hand-backs were not.
    sm, grid = lax.axis_index("sm"), lax.axis_size("sm")
    n_local = lax.div(m_iters * n_iters - sm + grid - 1, grid)
    total = n_local * k_iters

    @pl.when(wg == _MMA_WG)
    def _():
      @plgpu.warp_map
      def _drain(warp):
        @pl.when(warp == _TMA_WARP)
        def _():
          def body(step, _):
            plgpu.barrier_wait(consumed_bar.at[lax.rem(step, stages)])
          lax.fori_loop(jnp.maximum(total - stages, 0), total, body, None)

        @pl.when(warp == _MMA_WARP)
        def _():
          def body(t, _):
            plgpu.barrier_wait(store_done_bar.at[lax.rem(t, 2)])
          lax.fori_loop(jnp.maximum(n_local - 2, 0), n_local, body, None)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "num_sms"))
def run(a, b, bias, residual, *, cfg: Config, out_dtype, num_sms: int):
  """Launches the kernel; the caller (kernels.matmul) has validated the inputs."""
  m = a.shape[0]
  n = b.shape[1]
  tiles = dsl.cdiv(m, cfg.tile_m) * dsl.cdiv(n, cfg.tile_n)
  names, operands = ["a", "b"], [a, b]
  for name, x in (("bias", bias), ("residual", residual)):
    if x is not None:
      names.append(name)
      operands.append(x)

  def entry(*refs):
    *ins, out_ref = refs
    r = dict(zip(names, ins))
    _kernel(r["a"], r["b"], r.get("bias"), r.get("residual"), out_ref, cfg=cfg)

  return dsl.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(max(1, min(num_sms, tiles)),),
      grid_names=("sm",),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(*operands)


def heuristic(m: int, n: int, k: int) -> Config:
  del k
  tn = 256 if n >= 256 and m > 64 else 128
  return Config(tile_n=tn, stages=4 if tn == 256 else 6)
