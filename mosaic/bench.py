"""Device timing done right, and side-by-side tables.

``time_jax(f, input_sets)`` jits ``f``, warms it up on every input set, then
times it with the device's own timers (CUPTI: the sum of the kernels' device
durations, no host gaps) cycling through the input sets so that no run finds
its inputs hot in L2. It returns a ``Timing`` with the median and spread. On
CPU, where there are no device timers, it falls back to wall clock around
``block_until_ready``. ``time_jax_kernels`` gives each kernel's median instead
of the call's, and ``cupti_kernels(f, inputs)`` one call's kernels.

Each timed call runs once, right after a call on the previous input set.
Mosaic GPU's ``profiler.measure`` is not used for this: it runs ``f`` once
more on the same inputs just before the call it times, which leaves up to an
L2 (50 MB) of them hot and makes a decode weight stream look faster than it
runs in the model.

``time_torch(fn, input_sets)`` does the same for torch with CUDA events.

Rows of results become a markdown table (``table``) and JSON (``write``).
Every benchmark checks its output against the reference before timing it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from mosaic import target as target_lib


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float
  min_s: float
  max_s: float
  n: int
  timer: str  # "cupti", "cuda_events" or "wall"

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _summ(samples: Sequence[float], timer: str) -> Timing:
  if not samples:
    raise RuntimeError("no timing samples were collected")
  return Timing(statistics.median(samples), min(samples), max(samples), len(samples), timer)


# L2 of the largest supported card (H100/H200: 50 MB); input sets rotated
# through at least twice this many bytes find nothing of theirs left in L2.
L2_BYTES = 50 * 2**20


def cold_sets(bytes_per_set: int, *, min_sets: int = 2, max_sets: int = 16) -> int:
  """How many rotating input sets of ``bytes_per_set`` keep every run L2-cold."""
  if bytes_per_set <= 0:
    raise ValueError(f"{bytes_per_set=} must be > 0")
  return max(min_sets, min(max_sets, -(-2 * L2_BYTES // bytes_per_set)))


def _warm(f, input_sets, warmup):
  if not input_sets:
    raise ValueError("timing needs at least one input set")
  jf = f if hasattr(f, "lower") else jax.jit(f)
  for inputs in input_sets:
    for _ in range(warmup):
      jax.block_until_ready(jf(*inputs))
  return jf


def time_jax(f: Callable[..., Any], input_sets: Sequence[Sequence[Any]], *, iters: int = 20,
             warmup: int = 2) -> Timing:
  """Median device time of ``f(*inputs)`` over ``iters`` runs on rotated inputs.

  Each run comes right after one on the previous input set (with a single
  set, after one on the same inputs: give two or more to time a cold call)."""
  jf = _warm(f, input_sets, warmup)
  if target_lib.on_gpu():
    samples = []
    for i in range(iters):
      kernels = cupti_kernels(jf, input_sets[i % len(input_sets)])
      samples.append(sum(s for _, s in kernels))
    return _summ(samples, "cupti")
  samples = []
  for i in range(iters):
    inputs = input_sets[i % len(input_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(jf(*inputs))
    samples.append(time.perf_counter() - t0)
  return _summ(samples, "wall")


def time_jax_kernels(f: Callable[..., Any], input_sets: Sequence[Sequence[Any]], *,
                     iters: int = 20, warmup: int = 2,
                     drop: Callable[[str], bool] | None = None) -> list[tuple[str, float]]:
  """(kernel name, median device seconds) of each kernel that ``f`` runs, in
  launch order, timed as ``time_jax`` times the whole call (GPU only). Kernels
  whose name ``drop`` accepts are left out (e.g. copies XLA adds only because
  the timing reuses inputs that the real call would donate)."""
  if not target_lib.on_gpu():
    raise RuntimeError("per-kernel device times need a GPU (CUPTI)")
  jf = _warm(f, input_sets, warmup)
  runs = [[k for k in cupti_kernels(jf, input_sets[i % len(input_sets)])
           if drop is None or not drop(k[0])] for i in range(iters)]
  names = [n for n, _ in runs[0]]
  if any([n for n, _ in r] != names for r in runs):
    raise RuntimeError(f"the calls ran different kernels: {[[n for n, _ in r] for r in runs[:2]]}")
  return [(n, statistics.median(r[i][1] for r in runs)) for i, n in enumerate(names)]


def cupti_kernels(f: Callable[..., Any], inputs: Sequence[Any]) -> list[tuple[str, float]]:
  """(kernel name, device seconds) of the kernels that one call ``f(*inputs)``
  runs, from CUPTI (GPU only). Unlike ``profiler.measure`` it calls ``f`` only
  once: whatever ran last on the device is what this call finds in L2."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

  ext = mosaic_gpu_lib._mosaic_gpu_ext
  ext._cupti_init()
  try:
    jax.block_until_ready(f(*inputs))
  finally:
    timings = ext._cupti_get_timings(True)
  if not timings:
    raise RuntimeError("CUPTI recorded no kernel: was the work optimized away?")
  return [(name, ms * 1e-3) for name, ms in timings]


def time_torch(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]], *, iters: int = 20,
               warmup: int = 2) -> Timing:
  """Median CUDA-event time of ``fn(*inputs)`` on rotated torch inputs."""
  import torch

  for inputs in input_sets:
    for _ in range(warmup):
      fn(*inputs)
  torch.cuda.synchronize()
  samples = []
  for i in range(iters):
    inputs = input_sets[i % len(input_sets)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*inputs)
    end.record()
    end.synchronize()
    samples.append(start.elapsed_time(end) * 1e-3)
  return _summ(samples, "cuda_events")


def environment() -> dict[str, Any]:
  t = target_lib.current()
  return {
      "device": t.name,
      "kind": t.kind,
      "jax": jax.__version__,
      "date": datetime.date.today().isoformat(),
      "ceilings": dataclasses.asdict(t.ceilings),
  }


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
  """A markdown table of ``rows`` restricted to ``columns``."""

  def fmt(v):
    if isinstance(v, float):
      return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)

  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
  return "\n".join(lines)


def write(path: str | pathlib.Path, name: str, rows: Sequence[dict[str, Any]],
          columns: Sequence[str], command: str) -> tuple[pathlib.Path, pathlib.Path]:
  """Writes ``<path>/<name>.json`` and ``<name>.md`` (env, command, table)."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  env = environment()
  j = path / f"{name}.json"
  j.write_text(json.dumps({"env": env, "command": command, "rows": list(rows)}, indent=1) + "\n")
  m = path / f"{name}.md"
  m.write_text(
      f"# {name}\n\ncard: {env['device']}, jax {env['jax']}, {env['date']}\n\n"
      f"command: `{command}`\n\n{table(rows, columns)}\n"
  )
  return j, m
