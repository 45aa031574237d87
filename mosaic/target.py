"""What machine we run on, and its ceilings.

``current()`` looks at ``jax.devices()[0]`` once and returns a frozen
``Target``: its kind (``cpu``, ``hopper`` = sm_90a, ``blackwell`` = sm_100a,
``cuda`` = any other NVIDIA GPU), its name, and its ceilings (dense bf16
TFLOP/s, HBM GB/s, SM count, SMEM per block). Datasheet ceilings are the
starting point; a measured calibration file overrides them:
``mosaic/calibration/<device_key>.json`` in the tree, or the file named by
``MOSAIC_CALIBRATION``. Utilization figures (mosaic.cost) divide by these.

``override(target)`` makes ``current()`` answer another machine inside a
``with`` block: kernels then trace for that machine (compiled, its tuning
table) on any host, which is how ``mosaic.testing.lower_for_gpu`` checks the
GPU lowering of every kernel on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import pathlib
import re

KINDS = ("cpu", "hopper", "blackwell", "cuda")
CALIBRATION_DIR = pathlib.Path(__file__).parent / "calibration"


@dataclasses.dataclass(frozen=True)
class Ceilings:
  bf16_tflops: float  # dense, tensor cores
  hbm_gbps: float  # device memory bandwidth, bytes read + written
  sms: int
  smem_per_block: int  # bytes usable by one block
  source: str = "datasheet"

  def __post_init__(self):
    for f in ("bf16_tflops", "hbm_gbps", "sms", "smem_per_block"):
      if getattr(self, f) <= 0:
        raise ValueError(f"ceiling {f} must be positive, got {getattr(self, f)!r}")


@dataclasses.dataclass(frozen=True)
class Target:
  kind: str  # one of KINDS
  name: str  # device kind as jax reports it, e.g. "NVIDIA H200"
  compute_capability: str | None  # "9.0"; None on CPU
  ceilings: Ceilings

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"{self.kind=} is not one of {KINDS}")

  @property
  def is_gpu(self) -> bool:
    return self.kind != "cpu"

  @property
  def key(self) -> str:
    """File-name key for per-device data (tuning tables, calibration)."""
    return device_key(self.name)


def device_key(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


# Datasheet figures (SXM parts). HBM is the vendor's figure; calibration files
# replace it with what a copy actually reaches.
_DATASHEET: dict[str, Ceilings] = {
    "nvidia_h200": Ceilings(989.0, 4800.0, 132, 227 * 1024),
    "nvidia_h100_80gb_hbm3": Ceilings(989.0, 3350.0, 132, 227 * 1024),
    "nvidia_h100": Ceilings(989.0, 3350.0, 132, 227 * 1024),
    "nvidia_h100_pcie": Ceilings(756.0, 2000.0, 114, 227 * 1024),
    "nvidia_b200": Ceilings(2250.0, 8000.0, 148, 227 * 1024),
    "nvidia_gb200": Ceilings(2500.0, 8000.0, 152, 227 * 1024),
}
# A CPU has no tensor cores; these are order-of-magnitude figures for a small
# x86 host, so CPU "utilization" is labelled as such and never compared.
_CPU = Ceilings(0.1, 20.0, 1, 1 << 20, "nominal cpu")
_GENERIC_GPU = Ceilings(100.0, 1000.0, 80, 99 * 1024, "generic gpu guess")


def kind_of(platform: str, compute_capability: str | None) -> str:
  if platform != "gpu" or compute_capability is None:
    return "cpu"
  major = int(compute_capability.split(".")[0])
  if major == 9:
    return "hopper"
  if major == 10:
    return "blackwell"
  return "cuda"


def load_calibration(key: str) -> Ceilings | None:
  path = os.environ.get("MOSAIC_CALIBRATION")
  candidates = [pathlib.Path(path)] if path else [CALIBRATION_DIR / f"{key}.json"]
  for p in candidates:
    if p.is_file():
      data = json.loads(p.read_text())
      try:
        return Ceilings(
            bf16_tflops=float(data["bf16_tflops"]),
            hbm_gbps=float(data["hbm_gbps"]),
            sms=int(data["sms"]),
            smem_per_block=int(data["smem_per_block"]),
            source=f"measured ({p.name})",
        )
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"calibration file {p} is malformed: {e}") from e
  return None


def make(platform: str, name: str, compute_capability: str | None,
         sms: int | None = None) -> Target:
  """The Target of a device; ``sms`` (the device's own count) replaces the
  datasheet's, which does not know every part."""
  kind = kind_of(platform, compute_capability)
  key = device_key(name)
  ceilings = load_calibration(key)
  if ceilings is None:
    ceilings = _CPU if kind == "cpu" else _DATASHEET.get(key, _GENERIC_GPU)
  if sms and kind != "cpu" and sms != ceilings.sms:
    ceilings = dataclasses.replace(ceilings, sms=int(sms))
  return Target(kind, name, compute_capability, ceilings)


_OVERRIDE: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "mosaic_target_override", default=None)


@functools.cache
def _device_target() -> Target:
  import jax

  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  sms = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
  return make(dev.platform, dev.device_kind, cc, sms)


def current() -> Target:
  return _OVERRIDE.get() or _device_target()


def overridden() -> bool:
  """True inside ``override``."""
  return _OVERRIDE.get() is not None


@contextlib.contextmanager
def override(target: Target):
  """``current()`` is ``target`` inside the block. jax's trace caches are
  cleared on entry and exit, so that nothing traced for one machine is
  reused for the other."""
  import jax

  if not isinstance(target, Target):
    raise TypeError(f"override takes a Target (target.make(...)), got {type(target).__name__}")
  jax.clear_caches()
  token = _OVERRIDE.set(target)
  try:
    yield target
  finally:
    _OVERRIDE.reset(token)
    jax.clear_caches()


def on_gpu() -> bool:
  return current().is_gpu
