"""RMSNorm: y = x / sqrt(mean(x^2, -1) + eps) * weight.

Data flow of the Mosaic GPU kernel: the input is viewed as [rows, D]; each
block owns ``block_rows`` consecutive rows. One TMA copy brings the rows into
SMEM (a second brings the weight), the single warpgroup reads a row into
registers in float32, reduces its sum of squares, scales it, and writes the
result back over the row in SMEM; one TMA store sends the block out. The op
is bound by HBM: each element is read once and written once. Blocks are small
(a few rows) so that several are resident per SM and one block's copies
overlap another's arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools

from mosaic import registry, tuning
from mosaic import target as target_lib
from mosaic.dsl import jax, jnp, lax, pl, plgpu
from mosaic import dsl

DTYPES = ("bfloat16", "float16", "float32")
MAX_COLS = 8192  # a row and the weight both live in registers (fp32)


@dataclasses.dataclass(frozen=True)
class Config(tuning.KernelConfig):
  block_rows: int = 4

  def __post_init__(self):
    if self.block_rows not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.block_rows=} must be one of 1, 2, 4, 8, 16")


def _kernel(x_gmem, w_gmem, o_gmem, x_smem, w_smem, bars, *, eps: float, block_rows: int):
  blk = lax.axis_index("rows")
  rows = pl.ds(blk * block_rows, block_rows)
  # In bounds by construction (block_rows divides rows), which lets the copy be
  # one plain bulk transfer with no tensor map and no 256-element box limit.
  plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem, bars.at[0], oob_mode=dsl.IN_BOUNDS)
  plgpu.copy_gmem_to_smem(w_gmem, w_smem, bars.at[1], oob_mode=dsl.IN_BOUNDS)
  plgpu.barrier_wait(bars.at[1])
  w = w_smem[...].astype(jnp.float32)
  plgpu.barrier_wait(bars.at[0])
  inv_d = 1.0 / x_smem.shape[-1]
  for r in range(block_rows):
    x = x_smem[r].astype(jnp.float32)
    scale = lax.rsqrt(jnp.sum(x * x) * inv_d + eps)
    x_smem[r] = (x * scale * w).astype(x_smem.dtype)
  plgpu.commit_smem()  # make the register->SMEM stores visible to TMA
  plgpu.copy_smem_to_gmem(x_smem, o_gmem.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _pick_config(rows: int, cols: int, dtype) -> Config:
  key = tuning.shape_key(cols=cols, dtype=jnp.dtype(dtype).name)

  def heuristic():
    # ~16 KB of input per block keeps several blocks resident per SM.
    want = max(1, min(16, (16 * 1024) // (cols * jnp.dtype(dtype).itemsize)))
    return Config(block_rows=1 << (want.bit_length() - 1))

  cfg = tuning.lookup("rms_norm", key, Config, heuristic)
  # The block must divide the rows: no padding copy, no out-of-bounds tile.
  br = cfg.block_rows
  while rows % br:
    br //= 2
  return dataclasses.replace(cfg, block_rows=br)


@functools.partial(jax.jit, static_argnames=("eps", "config"))
def _rms_norm_mosaic(x, weight, eps: float, config: Config | None = None):
  shape = x.shape
  cols = shape[-1]
  x2 = x.reshape(-1, cols)
  rows = x2.shape[0]
  cfg = config or _pick_config(rows, cols, x.dtype)
  if rows % cfg.block_rows:
    raise ValueError(f"{cfg.block_rows=} must divide {rows=}")
  br = cfg.block_rows
  out = dsl.kernel(
      functools.partial(_kernel, eps=eps, block_rows=br),
      out_type=jax.ShapeDtypeStruct((rows, cols), x.dtype),
      grid=(rows // br,),
      grid_names=("rows",),
      scratch_types=[
          plgpu.SMEM((br, cols), x.dtype),
          plgpu.SMEM((cols,), weight.dtype),
          plgpu.Barrier(num_barriers=2),
      ],
  )(x2, weight)
  return out.reshape(shape)


def _check(x, weight):
  if x.ndim < 1:
    raise ValueError(f"rms_norm needs x with a feature axis, got {x.shape=}")
  if weight.shape != (x.shape[-1],):
    raise ValueError(f"{weight.shape=} must be ({x.shape[-1]},) to match {x.shape=}")
  if jnp.dtype(x.dtype).name not in DTYPES:
    raise ValueError(f"{x.dtype=} is not supported; supported: {DTYPES}")


def rms_norm_mosaic(x, weight, *, eps: float = 1e-6, config: Config | None = None):
  _check(x, weight)
  return _rms_norm_mosaic(x, weight, float(eps), config)


def rms_norm_xla(x, weight, *, eps: float = 1e-6):
  _check(x, weight)
  xf = x.astype(jnp.float32)
  ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return (xf * lax.rsqrt(ms + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def rms_norm_reference(x, weight, *, eps: float = 1e-6):
  """The meaning of the op, in float32 (the result stays float32)."""
  xf = jnp.asarray(x, jnp.float32)
  ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return xf / jnp.sqrt(ms + eps) * jnp.asarray(weight, jnp.float32)


def _mosaic_supports(x, weight, **kwargs) -> str | None:
  del kwargs
  if not hasattr(x, "shape") or not hasattr(weight, "shape"):
    return "inputs must be arrays"
  cols = x.shape[-1] if x.ndim else 0
  name = jnp.dtype(x.dtype).name
  if name not in DTYPES:
    return f"dtype {name} is not supported (supported: {', '.join(DTYPES)})"
  if jnp.dtype(weight.dtype).name not in DTYPES:
    return f"weight dtype {jnp.dtype(weight.dtype).name} is not supported"
  if cols % 128 or cols > MAX_COLS:
    return f"the feature size must be a multiple of 128 and <= {MAX_COLS}, got {cols}"
  return None


op = registry.op("rms_norm", "y = x * rsqrt(mean(x^2, -1) + eps) * weight")
op.register("mosaic", rms_norm_mosaic, supports=_mosaic_supports,
            doc="Mosaic GPU: TMA row blocks, fp32 math in registers")
op.register("xla", rms_norm_xla, doc="jnp, fused by XLA")
op.register("reference", rms_norm_reference, doc="float32 jnp; output stays float32")
op.set_defaults(hopper=("mosaic", "xla"), blackwell=("mosaic", "xla"), default=("xla",))


def rms_norm(x, weight, *, eps: float = 1e-6, backend: str | None = None):
  return op(x, weight, eps=eps, backend=backend)
