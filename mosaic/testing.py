"""Reference comparison for kernels: relative Frobenius error, NaN never passes.

``assert_close(out, ref)`` computes ||out - ref|| / ||ref|| in float64 on the
host against a per-dtype tolerance. ``random_inputs`` draws fresh inputs from
a key that changes every call unless a seed is given (so a test that passes by
accident on one draw does not pass forever), and never returns zeros.
``poisoned`` builds an output buffer full of NaN, for kernels that write into
a given buffer: any element the kernel forgets stays NaN and fails.

``lower_for_gpu(fn, *args, device=...)`` lowers ``fn`` for CUDA as it would
run on that GPU (kernels compiled, not interpreted, with that device's tuning
table), on any host: interpret mode checks a kernel's logic, this checks that
its Mosaic GPU lowering (layouts, TMA transforms, barriers, wgmma or tcgen05
shapes) goes through. It stops short of ptxas, which needs the GPU toolchain.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

# Relative Frobenius tolerances for one op against its float32 reference.
TOLERANCE = {
    "float32": 1e-5,
    "bfloat16": 1.6e-2,
    "float16": 2e-3,
    "float8_e4m3fn": 6e-2,
}

_counter = itertools.count()
_BASE_SEED = int(os.environ.get("MOSAIC_TEST_SEED", time.time_ns() % (2**31)))


def tolerance(dtype) -> float:
  name = jnp.dtype(dtype).name
  if name not in TOLERANCE:
    raise ValueError(f"no tolerance for dtype {name}; known: {sorted(TOLERANCE)}")
  return TOLERANCE[name]


def rel_error(out, ref) -> float:
  """||out - ref||_F / ||ref||_F in float64; inf if out has NaN/inf."""
  out = np.asarray(jnp.asarray(out, jnp.float32), dtype=np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), dtype=np.float64)
  if out.shape != ref.shape:
    raise AssertionError(f"shape mismatch: out {out.shape} vs ref {ref.shape}")
  if not np.all(np.isfinite(out)):
    return float("inf")
  denom = np.linalg.norm(ref)
  if denom == 0:
    raise AssertionError("reference is all zeros: the comparison would mean nothing")
  return float(np.linalg.norm(out - ref) / denom)


def assert_close(out, ref, dtype=None, tol: float | None = None, what: str = "output"):
  """Fails unless rel_error(out, ref) <= tol (default: per-dtype of ``dtype``)."""
  dtype = dtype if dtype is not None else jnp.asarray(out).dtype
  tol = tolerance(dtype) if tol is None else tol
  err = rel_error(out, ref)
  if not err <= tol:  # NaN-safe: NaN <= tol is False
    n_bad = int(np.sum(~np.isfinite(np.asarray(jnp.asarray(out, jnp.float32)))))
    raise AssertionError(
        f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"
        + (f" ({n_bad} non-finite elements)" if n_bad else "")
    )
  return err


def fresh_key(seed: int | None = None) -> jax.Array:
  """A PRNG key that differs on every call (and every run) unless seeded."""
  if seed is None:
    seed = _BASE_SEED + next(_counter)
  return jax.random.key(seed)


def packed_segments(lengths, total: int):
  """Segment ids and restarting positions, int32 [1, total], of sequences of
  ``lengths`` packed into one row; the rest is padding (segment 0)."""
  seg, pos = [], []
  for i, n in enumerate(lengths):
    seg += [i + 1] * n
    pos += list(range(n))
  if len(seg) > total:
    raise ValueError(f"{sum(lengths)=} tokens do not fit in {total=}")
  seg += [0] * (total - len(seg))
  pos += [0] * (total - len(pos))
  return jnp.array([seg], jnp.int32), jnp.array([pos], jnp.int32)


def random_inputs(shapes, dtype, seed: int | None = None, scale: float = 1.0):
  """Normal(0, scale) arrays of the given shapes; a fresh draw by default."""
  keys = jax.random.split(fresh_key(seed), len(shapes))
  outs = []
  for k, s in zip(keys, shapes):
    x = (jax.random.normal(k, s, jnp.float32) * scale).astype(dtype)
    outs.append(x)
  return outs


def poisoned(shape, dtype) -> jax.Array:
  """An output buffer of NaN: elements a kernel does not write fail the check."""
  return jnp.full(shape, jnp.nan, dtype)


# Devices lower_for_gpu knows by name: (jax device kind, compute capability, SMs).
GPUS = {
    "h200": ("NVIDIA H200", "9.0", 132),
    "b200": ("NVIDIA B200", "10.0", 148),
}


@dataclasses.dataclass(frozen=True)
class Lowered:
  """What lower_for_gpu made: the StableHLO text and its Mosaic GPU kernels."""

  text: str
  mosaic_kernels: int  # distinct Mosaic GPU kernels (a kernel called twice lowers once)
  host_callbacks: int  # custom calls back into Python (an interpreted kernel)
  kernel_results: tuple[str, ...]  # each kernel's result type, e.g. "tensor<64x6144xbf16>"


def lower_for_gpu(fn, *args, device: str = "h200", **kwargs) -> Lowered:
  """Lowers ``jax.jit(fn)(*args, **kwargs)`` for ``device`` (a key of GPUS);
  ``args`` may be jax.ShapeDtypeStruct. Raises what the lowering raises."""
  from mosaic import target as target_lib

  if device not in GPUS:
    raise ValueError(f"unknown device {device!r}; known: {sorted(GPUS)}")
  name, cc, sms = GPUS[device]
  with target_lib.override(target_lib.make("gpu", name, cc, sms)):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args, **kwargs)
    text = exported.mlir_module()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  results = tuple(re.sub(r"\s+loc\(.*$", "", line.rsplit("->", 1)[-1]).strip() for line in calls)
  return Lowered(text=text, mosaic_kernels=len(calls), host_callbacks=text.count("callback"),
                 kernel_results=results)
