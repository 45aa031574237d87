"""Kernel configs, their search spaces, the autotuner, and tuning tables.

A kernel's ``Config`` subclasses ``KernelConfig``: a frozen dataclass whose
``__post_init__`` validates it. A tuning table is data: JSON files under
``kernels/tuning/<op>/<device_key>.json`` mapping a shape-bucket key to the
fields of the best config found there::

    {"op": "rms_norm", "device": "NVIDIA H200",
     "entries": {"rows=8192,cols=8192,dtype=bfloat16": {"block_rows": 4}}}

``lookup(op, key, config_cls, heuristic)`` returns the table's config for the
key when one exists, else ``heuristic()``. ``autotune`` measures each
candidate, first checking it against the reference (a wrong-but-fast config
is never chosen), and ``save`` writes the winners back as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from mosaic import target as target_lib

log = logging.getLogger("mosaic.tuning")

TABLE_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels" / "tuning"

C = TypeVar("C", bound="KernelConfig")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Base for kernel configs: frozen, validated, (de)serializable."""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}; valid: {sorted(names)}")
    return cls(**d)


def search_space(config_cls: type[C], **axes: Iterable[Any]) -> list[C]:
  """All valid configs of the cartesian product of ``axes``; invalid ones dropped."""
  names = list(axes)
  out = []
  for values in itertools.product(*(list(axes[n]) for n in names)):
    try:
      out.append(config_cls(**dict(zip(names, values))))
    except ValueError:
      continue
  return out


def bucket(n: int, buckets: Iterable[int] = (1, 16, 64, 256, 2048, 8192)) -> int:
  """The smallest bucket >= n (or the largest), for shape-bucketed keys."""
  bs = sorted(buckets)
  for b in bs:
    if n <= b:
      return b
  return bs[-1]


def shape_key(**dims: Any) -> str:
  return ",".join(f"{k}={v}" for k, v in dims.items())


def table_path(op: str, device_key: str | None = None) -> pathlib.Path:
  device_key = device_key or target_lib.current().key
  return TABLE_DIR / op / f"{device_key}.json"


@functools.cache
def _load(path: pathlib.Path) -> dict[str, dict[str, Any]]:
  if not path.is_file():
    return {}
  data = json.loads(path.read_text())
  if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
    raise ValueError(f"tuning table {path} must be an object with an 'entries' object")
  return data["entries"]


def entries(op: str, device_key: str | None = None) -> dict[str, dict[str, Any]]:
  """The tuning table of ``op`` on a device (this one by default): key -> config dict."""
  return dict(_load(table_path(op, device_key)))


def lookup(op: str, key: str, config_cls: type[C], heuristic: Callable[[], C],
           device_key: str | None = None) -> C:
  """The tuned config for ``key`` on this device, else ``heuristic()``."""
  entries = _load(table_path(op, device_key))
  if key in entries:
    return config_cls.from_dict(entries[key])
  return heuristic()


def save(op: str, results: Mapping[str, KernelConfig], device_name: str | None = None,
         extra: Mapping[str, Any] | None = None, path: pathlib.Path | None = None) -> pathlib.Path:
  """Merges ``results`` (key -> config) into the op's table for this device."""
  device_name = device_name or target_lib.current().name
  path = path or table_path(op, target_lib.device_key(device_name))
  path.parent.mkdir(parents=True, exist_ok=True)
  entries = dict(_load(path)) if path.is_file() else {}
  entries.update({k: v.to_dict() for k, v in results.items()})
  # Keys beside the entries (a "note" on where they were measured) are kept.
  kept = {k: v for k, v in json.loads(path.read_text()).items()
          if k not in ("op", "device", "entries")} if path.is_file() else {}
  data = {"op": op, "device": device_name, "entries": dict(sorted(entries.items())), **kept}
  if extra:
    data.update(extra)
  path.write_text(json.dumps(data, indent=1) + "\n")
  _load.cache_clear()
  return path


@dataclasses.dataclass(frozen=True)
class TuneResult:
  config: KernelConfig
  seconds: float | None  # None: failed to build or wrong
  error: str | None = None


def autotune(
    candidates: Iterable[C],
    run: Callable[[C], Any],
    check: Callable[[Any], None],
    time_fn: Callable[[C], float],
) -> tuple[C, list[TuneResult]]:
  """Returns the fastest correct candidate and every candidate's outcome.

  ``run(cfg)`` computes the op with ``cfg``; ``check(out)`` raises if the
  output is wrong; ``time_fn(cfg)`` returns the op's seconds with ``cfg``
  (e.g. mosaic.bench.time_jax on rotated inputs).
  A candidate that fails to compile or fails the check is never timed.
  """
  results: list[TuneResult] = []
  for cfg in candidates:
    try:
      check(run(cfg))
    except Exception as e:  # noqa: BLE001 -- a bad candidate is data, not a crash
      results.append(TuneResult(cfg, None, f"{type(e).__name__}: {e}"[:300]))
      continue
    results.append(TuneResult(cfg, time_fn(cfg)))
  ok = [r for r in results if r.seconds is not None]
  if not ok:
    raise RuntimeError("autotune: no candidate was correct: "
                       + "; ".join(f"{r.config}: {r.error}" for r in results))
  best = min(ok, key=lambda r: r.seconds)
  return best.config, results  # type: ignore[return-value]
