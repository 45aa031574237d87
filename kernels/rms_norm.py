"""RMSNorm: y = x / sqrt(mean(x^2, -1) + eps) * weight.

Data flow of the Mosaic GPU kernel: the input is viewed as [rows, D] and cut
into row blocks of ``block_rows`` rows. Two schedules, chosen by the tuning
table: one row block per CUDA block (TMA in, normalize in place in SMEM, TMA
out; many blocks resident per SM hide each other's latency), or a persistent grid of a few blocks per
SM loads the weight into SMEM once, then walks its share of row blocks
through a ``stages``-deep TMA pipeline. Per row the single warpgroup reads
the row into registers in float32, reduces its sum of squares, scales it,
and writes the result into one of two output slots in SMEM, which a TMA
store sends out while the next rows are computed. The op is bound by HBM:
each element is read once and written once.

With ``layer=``, weight is a [L, D] stack and the kernel reads row ``layer``
in place (a device scalar): a layer scan then passes every iteration the
same buffers, which XLA's command buffers need to replay without re-recording
(see kernels/matmul.py).
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
  block_rows: int = 1  # rows per pipeline step (per block if not persistent)
  persistent: bool = False
  stages: int = 3  # persistent only: row blocks in flight per block (TMA ring)
  blocks_per_sm: int = 2  # persistent only: grid = min(row blocks, SMs * this)

  def __post_init__(self):
    if self.block_rows not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.block_rows=} must be one of 1, 2, 4, 8, 16")
    if not 1 <= self.stages <= 8:
      raise ValueError(f"{self.stages=} must be in [1, 8]")
    if not 1 <= self.blocks_per_sm <= 8:
      raise ValueError(f"{self.blocks_per_sm=} must be in [1, 8]")


def _normalize_rows(src, dst, w, eps: float):
  """dst[r] = src[r] * rsqrt(mean(src[r]^2) + eps) * w, each row in fp32 registers."""
  inv_d = 1.0 / src.shape[-1]
  for r in range(src.shape[0]):
    x = src[r].astype(jnp.float32)
    scale = lax.rsqrt(jnp.sum(x * x) * inv_d + eps)
    dst[r] = (x * scale * w).astype(dst.dtype)
  plgpu.commit_smem()  # register->SMEM stores visible to the TMA engine


def _weight_row(layer_gmem, w_gmem):
  """The weight [D] of the [L, D] stack's row layer_gmem[0] (clamped)."""
  return w_gmem.at[dsl.layer_index(layer_gmem, w_gmem.shape[0])]


def _kernel_one_block(layer_gmem, x_gmem, w_gmem, o_gmem, x_smem, w_smem, bars, *, eps: float,
                      block_rows: int):
  # One row block per CUDA block: many small blocks resident per SM overlap
  # each other's copies and arithmetic, with no pipeline bookkeeping.
  w_gmem = _weight_row(layer_gmem, w_gmem)
  rows = pl.ds(lax.axis_index("blocks") * block_rows, block_rows)
  plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem, bars.at[0], oob_mode=dsl.IN_BOUNDS)
  plgpu.copy_gmem_to_smem(w_gmem, w_smem, bars.at[1], oob_mode=dsl.IN_BOUNDS)
  plgpu.barrier_wait(bars.at[1])
  w = w_smem[...].astype(jnp.float32)
  plgpu.barrier_wait(bars.at[0])
  _normalize_rows(x_smem, x_smem, w, eps)  # in place
  plgpu.copy_smem_to_gmem(x_smem, o_gmem.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _kernel_persistent(layer_gmem, x_gmem, w_gmem, o_gmem, w_smem, out_smem, bar, *, eps: float,
                       block_rows: int, stages: int, num_blocks: int, row_blocks: int):
  # Persistent: block c handles row blocks c, c + G, c + 2G, ... (G blocks).
  w_gmem = _weight_row(layer_gmem, w_gmem)
  cta = lax.axis_index("blocks")
  plgpu.copy_gmem_to_smem(w_gmem, w_smem, bar, oob_mode=dsl.IN_BOUNDS)
  plgpu.barrier_wait(bar)
  w = w_smem[...].astype(jnp.float32)

  def step(indices, x_smem):
    (i,) = indices
    slot = lax.rem(i, 2)
    # The store that used this output slot two steps ago must have read it.
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    _normalize_rows(x_smem, out_smem.at[slot], w, eps)
    rows = pl.ds((cta + i * num_blocks) * block_rows, block_rows)
    plgpu.copy_smem_to_gmem(out_smem.at[slot], o_gmem.at[rows])

  my_steps = (row_blocks - cta + num_blocks - 1) // num_blocks
  # In bounds by construction (block_rows divides rows): one plain bulk copy
  # per step, no tensor map and no 256-element box limit.
  spec = dsl.block_spec((block_rows, x_gmem.shape[-1]), lambda i: (cta + i * num_blocks, 0),
                        in_bounds=True)
  dsl.pipeline(step, grid=(my_steps,), in_specs=[spec], stages=stages)(x_gmem)
  plgpu.wait_smem_to_gmem(0)


def _pick_config(rows: int, cols: int, dtype) -> Config:
  key = tuning.shape_key(cols=cols, dtype=jnp.dtype(dtype).name)
  cfg = tuning.lookup("rms_norm", key, Config, Config)
  # The block must divide the rows: no padding copy, no out-of-bounds tile.
  br = cfg.block_rows
  while rows % br:
    br //= 2
  return dataclasses.replace(cfg, block_rows=br)


@functools.partial(jax.jit, static_argnames=("eps", "config"))
def _rms_norm_mosaic(x, weight, eps: float, config: Config | None = None, layer=None):
  layer_arr = dsl.layer_operand(layer)  # clamped in the kernel
  if layer is None:  # one code path: a stack of one (a free reshape, a constant index)
    weight = weight[None]
  shape = x.shape
  cols = shape[-1]
  x2 = x.reshape(-1, cols)
  rows = x2.shape[0]
  cfg = config or _pick_config(rows, cols, x.dtype)
  if rows % cfg.block_rows:
    raise ValueError(f"{cfg.block_rows=} must divide {rows=}")
  br = cfg.block_rows
  row_blocks = rows // br
  out_type = jax.ShapeDtypeStruct((rows, cols), x.dtype)
  if not cfg.persistent:
    out = dsl.kernel(
        functools.partial(_kernel_one_block, eps=eps, block_rows=br),
        out_type=out_type, grid=(row_blocks,), grid_names=("blocks",),
        scratch_types=[plgpu.SMEM((br, cols), x.dtype), plgpu.SMEM((cols,), weight.dtype),
                       plgpu.Barrier(num_barriers=2)],
    )(layer_arr, x2, weight)
    return out.reshape(shape)
  num_blocks = min(row_blocks, target_lib.current().ceilings.sms * cfg.blocks_per_sm)
  if dsl.interpreting():
    num_blocks = min(row_blocks, 2)  # still more than one step per block
  out = dsl.kernel(
      functools.partial(_kernel_persistent, eps=eps, block_rows=br, stages=cfg.stages,
                        num_blocks=num_blocks, row_blocks=row_blocks),
      out_type=out_type, grid=(num_blocks,), grid_names=("blocks",),
      scratch_types=[plgpu.SMEM((cols,), weight.dtype), plgpu.SMEM((2, br, cols), x.dtype),
                     plgpu.Barrier()],
  )(layer_arr, x2, weight)
  return out.reshape(shape)


def _check(x, weight, layer=None):
  if not hasattr(x, "shape") or not hasattr(weight, "shape"):
    raise ValueError(f"x and weight must be arrays, got {type(x).__name__} and "
                     f"{type(weight).__name__}")
  if x.ndim < 1:
    raise ValueError(f"rms_norm needs x with a feature axis, got {x.shape=}")
  if layer is None and weight.shape != (x.shape[-1],):
    raise ValueError(f"{weight.shape=} must be ({x.shape[-1]},) to match {x.shape=}")
  if layer is not None:
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
      raise ValueError(f"with layer=, weight must be a [L, {x.shape[-1]}] stack; "
                       f"got {weight.shape=}")
    dsl.check_layer(layer, weight.shape[0])
  if jnp.dtype(x.dtype).name not in DTYPES:
    raise ValueError(f"{x.dtype=} is not supported; supported: {DTYPES}")


def rms_norm_mosaic(x, weight, *, eps: float = 1e-6, config: Config | None = None,
                    layer=None):
  _check(x, weight, layer)
  return _rms_norm_mosaic(x, weight, float(eps), config, layer)


def rms_norm_xla(x, weight, *, eps: float = 1e-6, layer=None):
  _check(x, weight, layer)
  weight = dsl.take_layer(weight, layer)
  xf = x.astype(jnp.float32)
  ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return (xf * lax.rsqrt(ms + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def rms_norm_reference(x, weight, *, eps: float = 1e-6, layer=None):
  """The meaning of the op, in float32 (the result stays float32)."""
  _check(x, weight, layer)
  weight = dsl.take_layer(weight, layer)
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
  if x.size == 0:
    return "x has no rows (the kernel's grid needs at least one)"
  return None


op = registry.op("rms_norm", "y = x * rsqrt(mean(x^2, -1) + eps) * weight; with layer=, "
                "weight is a [L, D] stack and weight[layer] is used")
op.register("mosaic", rms_norm_mosaic, supports=_mosaic_supports,
            doc="Mosaic GPU: TMA row blocks, fp32 math in registers")
op.register("xla", rms_norm_xla, doc="jnp, fused by XLA")
op.register("reference", rms_norm_reference, doc="float32 jnp; output stays float32")
op.set_defaults(hopper=("mosaic", "xla"), blackwell=("mosaic", "xla"), default=("xla",))


def rms_norm(x, weight, *, eps: float = 1e-6, layer=None, backend: str | None = None):
  return op(x, weight, eps=eps, layer=layer, backend=backend)
