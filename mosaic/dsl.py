"""The Pallas / Mosaic GPU primitives our kernels use, in one place.

Kernels import ``pl``, ``plgpu`` and the helpers from here, never from jax
directly, so a jax API move is fixed once. On a machine without a GPU every
kernel built with ``kernel()`` runs in Mosaic GPU interpret mode (set by
``interpret_params()``; tests turn race detection on with
``MOSAIC_DETECT_RACES=1``).

The supported jax range is 0.10.2 through 0.12.x. Where the API differs:
- ``InterpretGPUParams`` is exported by ``plgpu`` from 0.11; in 0.10 it lives
  in ``jax._src.pallas.mosaic_gpu.interpret.params``.
- ``reset_gpu_interpret_mode_state`` lives in the interpreter module in both.

Interpret mode is a subset: ``pl.program_id`` returns 0 there, so kernels read
their grid position with ``lax.axis_index(name)``; ``emit_pipeline`` with
``out_specs`` and ``pl.run_state`` are not interpreted.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mosaic import target as target_lib

try:  # jax >= 0.11
  InterpretGPUParams = plgpu.InterpretGPUParams
except AttributeError:  # jax 0.10
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # type: ignore

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _interp

__all__ = [
    "pl", "plgpu", "jax", "jnp", "lax", "InterpretGPUParams", "kernel",
    "interpret_params", "interpreting", "reset_interpret_state", "races_found",
    "smem_transforms", "swizzle_bytes", "transpose", "block_spec", "pipeline",
    "warp_specialized_pipeline",
    "WARPGROUP_THREADS", "IN_BOUNDS", "cdiv", "round_up", "kernel_timeline",
]

WARPGROUP_THREADS = 128  # a Pallas Mosaic GPU "thread" is one warpgroup

# oob_mode for copies the caller guarantees in bounds: a contiguous one then
# lowers to a plain bulk copy (no tensor map, no 256-element box limit).
IN_BOUNDS = plgpu.OOBFillMode.PROMISE_IN_BOUNDS


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


# --------------------------------------------------------------------------
# Layer stacks: an op given ``layer=`` reads one layer of a [L, ...] stack in
# place, so a layer scan hands its kernels the same buffers every iteration
# (XLA re-records a command buffer whose kernel arguments moved).


def check_layer(layer, num_layers: int) -> None:
  """``layer`` is an int in [0, num_layers) or an integer scalar array (a
  traced index is clamped where it is used)."""
  if isinstance(layer, (int, np.integer)):
    if not 0 <= layer < num_layers:
      raise ValueError(f"{layer=} is out of range for a stack of {num_layers}")
  elif (not hasattr(layer, "dtype") or jnp.shape(layer) != ()
        or not jnp.issubdtype(layer.dtype, jnp.integer)):
    raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")


def take_layer(x, layer):
  """x[layer] of a stack, sliced by XLA (clamped); ``x`` itself when layer or x
  is None (an optional operand, e.g. a bias)."""
  if layer is None or x is None:
    return x
  return lax.dynamic_index_in_dim(x, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def layer_operand(layer):
  """The int32[1] kernel operand holding ``layer`` (a constant 0 for None)."""
  if layer is None:
    return np.zeros((1,), np.int32)
  return jnp.asarray(layer, jnp.int32).reshape(1)


def layer_index(layer_ref, num_layers: int):
  """In a kernel: the layer of ``layer_operand``, clamped to [0, num_layers)."""
  return jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)


# --------------------------------------------------------------------------
# Interpret mode


def interpreting() -> bool:
  """True when kernels run in the interpreter (no GPU, or forced by env);
  never while tracing for another machine (``target.override``)."""
  if target_lib.overridden():
    return not target_lib.on_gpu()
  if os.environ.get("MOSAIC_INTERPRET", "") == "1":
    return True
  return not target_lib.on_gpu()


def interpret_params() -> InterpretGPUParams | None:
  """The ``interpret=`` argument for a kernel launched now (None on GPU)."""
  if not interpreting():
    return None
  return InterpretGPUParams(
      detect_races=os.environ.get("MOSAIC_DETECT_RACES", "") == "1",
      # NaN-filled scratch makes a read of memory nothing wrote visible.
      uninitialized_memory="nan",
  )


def reset_interpret_state() -> None:
  """Must be called after an exception inside an interpreted kernel."""
  _interp.reset_gpu_interpret_mode_state()


def races_found() -> bool:
  """Whether the interpreter's race detector saw a race since the last reset."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  races = getattr(gpu_callbacks, "_races", None)  # None: nothing interpreted yet
  return bool(getattr(races, "races_found", False))


_TIMELINE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "kernel_timeline", default=None)


@contextlib.contextmanager
def kernel_timeline(directory: str | os.PathLike, events: int = 512):
  """Kernels built inside record an on-device timeline of their named regions.

  A region is a ``jax.named_scope`` in the kernel body; Mosaic GPU's profiler
  stamps its start and end with the SM clock, per warpgroup, and each run of
  the kernel writes ``<name>-<ns>-trace.json`` (Chrome / Perfetto JSON: one
  process per SM, one thread per CTA warpgroup) into ``directory``. Up to
  ``events`` regions per warpgroup are kept; later ones are dropped. The
  jit caches are cleared on entry and exit so that kernels are rebuilt with
  and then without the recording. GPU only: interpreted kernels record nothing.
  """
  if events < 1:
    raise ValueError(f"{events=} must be >= 1")
  os.makedirs(directory, exist_ok=True)
  jax.clear_caches()
  token = _TIMELINE.set((os.fspath(directory), int(events)))
  try:
    yield pathlib.Path(directory)
  finally:
    _TIMELINE.reset(token)
    jax.clear_caches()


def kernel(body: Callable[..., None], **kwargs: Any):
  """``plgpu.kernel`` that interprets itself when there is no GPU.

  Same arguments as ``plgpu.kernel`` (``out_type``, ``grid``, ``grid_names``,
  ``scratch_types``, ``num_threads``, ``thread_name``, ``compiler_params``).
  Inside ``kernel_timeline`` the kernel also records its named regions.
  """
  kwargs.setdefault("interpret", interpret_params())
  timeline = _TIMELINE.get()
  if timeline is not None and kwargs["interpret"] is None:
    params = kwargs.get("compiler_params") or plgpu.CompilerParams()
    extra = {"profile_bounds_check": True} if any(
        f.name == "profile_bounds_check" for f in dataclasses.fields(params)) else {}
    kwargs["compiler_params"] = dataclasses.replace(
        params, profile_dir=timeline[0], profile_space=timeline[1], **extra)
  return plgpu.kernel(body, **kwargs)


# --------------------------------------------------------------------------
# Shared memory layout


def swizzle_bytes(minor_dim: int, dtype: Any) -> int:
  """Largest TMA/wgmma swizzle (128/64/32/16 bytes) for a row of ``minor_dim``."""
  bits = minor_dim * jnp.dtype(dtype).itemsize * 8
  for sw in (128, 64, 32, 16):
    if bits % (sw * 8) == 0:
      return sw
  raise ValueError(
      f"no swizzle for a minor dimension of {minor_dim} x {jnp.dtype(dtype).name}: "
      f"{bits} bits is not a multiple of 128 (16 bytes)"
  )


def smem_transforms(block_shape: Sequence[int], dtype: Any) -> tuple[Any, ...]:
  """Tiling + swizzle for a 2D SMEM block that wgmma / TMA will read.

  The tile is (8 rows, one swizzle width of elements): the layout wgmma
  expects, and the widest swizzle keeps TMA writes free of bank conflicts.
  """
  if len(block_shape) < 2:
    raise ValueError(f"{block_shape=} must have at least 2 dims for an MMA layout")
  sw = swizzle_bytes(block_shape[-1], dtype)
  elems = sw // jnp.dtype(dtype).itemsize
  if block_shape[-2] % 8:
    raise ValueError(f"{block_shape=}: rows must be a multiple of 8 for a tiled layout")
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(sw))


def transpose(ref):
  """The [N, M] view of a 2D SMEM ref [M, N] (a wgmma operand, or the target
  of a store in the ``WGMMA_TRANSPOSED`` layout). jax 0.11 deprecates
  ``plgpu.transpose_ref`` in favour of ``ref.transpose``; a ref without the
  method (older jax) takes the old call."""
  if hasattr(ref, "transpose"):
    return ref.transpose((1, 0))
  return plgpu.transpose_ref(ref, (1, 0))


# --------------------------------------------------------------------------
# Pipelines


def block_spec(block_shape, index_map, *, in_bounds: bool = False, **kwargs):
  """``plgpu.BlockSpec``; ``in_bounds`` promises every block lies inside the
  array, so a contiguous block becomes one plain bulk copy (jax >= 0.11; older
  versions ignore the promise and use a tensor map)."""
  if in_bounds and "oob_fill_mode" in _BLOCKSPEC_FIELDS:
    kwargs["oob_fill_mode"] = IN_BOUNDS
  return plgpu.BlockSpec(block_shape, index_map, **kwargs)


_BLOCKSPEC_FIELDS = {f.name for f in dataclasses.fields(plgpu.BlockSpec)}


def pipeline(
    body: Callable[..., Any],
    *,
    grid: Sequence[int],
    in_specs: Sequence[Any],
    stages: int = 2,
    init_carry: Any = None,
):
  """A TMA-fed loop: ``body(indices, *smem_refs[, carry])`` per grid step.

  Thin over ``plgpu.emit_pipeline``: ``stages`` SMEM buffers per input are in
  flight, so the copy of step i+1.. overlaps the compute of step i. Outputs
  are written by the caller (``emit_pipeline`` with ``out_specs`` is not
  interpreted).
  """
  if stages < 1:
    raise ValueError(f"{stages=} must be >= 1")
  kw = {} if init_carry is None else {"init_carry": init_carry}
  return plgpu.emit_pipeline(
      body, grid=tuple(grid), in_specs=tuple(in_specs), max_concurrent_steps=stages, **kw
  )


def warp_specialized_pipeline(
    body: Callable[..., Any],
    *,
    grid: Sequence[int],
    in_specs: Sequence[Any],
    out_specs: Sequence[Any] = (),
    stages: int = 2,
    num_compute_wgs: int,
    wg_axis: str,
    memory_registers: int = 40,
    **kwargs: Any,
):
  """A producer warpgroup issuing TMA, ``num_compute_wgs`` consumers computing.

  Thin over ``plgpu.emit_pipeline_warp_specialized``; ``memory_registers``
  is what the producer keeps after ``setmaxnreg`` (40 suits Hopper).
  """
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=tuple(grid),
      in_specs=tuple(in_specs),
      out_specs=tuple(out_specs),
      max_concurrent_steps=stages,
      num_compute_wgs=num_compute_wgs,
      wg_axis=wg_axis,
      memory_registers=memory_registers,
      **kwargs,
  )
