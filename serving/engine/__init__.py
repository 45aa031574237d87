"""The engine behind the service: interface (api), batching engine, runners,
and ``process.ProcessEngine``, which runs any of them in a process of its own.

Constructors:
  tiny_engine(...)   the counting model (next byte = previous + 1): known output
  toy_engine(...)    a small random jnp decoder with the models serving API
  model_engine(spec) a models.load(spec) model (None = the embedded default)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from serving.engine.api import (  # noqa: F401
    Delta, Draining, Engine, EngineFailed, EngineInfo, EngineStats, Failed, Final, FinishReason,
    InvalidRequest, QueueFull, Request, RequestHandle, SamplingParams, StructuredOutputs,
    TokenLogprob)
from serving.engine.config import EngineConfig, auto_compile_threads  # noqa: F401

if TYPE_CHECKING:
  from serving.engine.engine import BatchingEngine

log = logging.getLogger(__name__)

# Imported when first named, so that the engine's pure-Python parts (scheduler,
# KV cache manager, config) import without jax.
_LAZY = {"BatchingEngine": "serving.engine.engine", "StepRecord": "serving.engine.timing",
         "CountingRunner": "serving.engine.runners", "ModelRunner": "serving.engine.runners"}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tiny_engine(*, num_pages: int = 64, page_size: int = 4, max_context: int = 1024,
                step_delay: float = 0.0, **config) -> BatchingEngine:
  from serving.engine.engine import BatchingEngine
  from serving.engine.runners import CountingRunner

  config.setdefault("warmup", False)
  runner = CountingRunner(num_pages=num_pages, page_size=page_size, max_context=max_context,
                          step_delay=step_delay)
  return BatchingEngine(runner, EngineConfig(**config))


def toy_engine(*, num_pages: int = 128, page_size: int = 8, seed: int = 0,
               **config) -> BatchingEngine:
  from serving.engine.engine import BatchingEngine
  from serving.engine.runners import ModelRunner
  from serving.engine.toy_model import ToyModel

  runner = ModelRunner(ToyModel(seed=seed), num_pages=num_pages, page_size=page_size)
  return BatchingEngine(runner, EngineConfig(**config))


def default_page_size() -> int:
  try:
    from kernels.attention_decode import DEFAULT_PAGE_SIZE
    return int(DEFAULT_PAGE_SIZE)
  except ImportError:
    return 64


DEFAULT_NUM_PAGES = 1024  # where the device reports no memory (the CPU)


def _memory_stats() -> dict | None:
  import jax

  return jax.devices()[0].memory_stats()


def kv_pages(stats: dict | None, page_bytes: int, fraction: float) -> int | None:
  """KV pages that fit in ``fraction`` of a device's memory beside what it
  already holds (the weights): SGLang's static memory fraction. The rest is
  left to activations and compiler scratch. The memory is what jax may use
  there (``bytes_limit``: with jax's default preallocation, its
  XLA_PYTHON_CLIENT_MEM_FRACTION share of the card). None where the device
  reports no memory limit."""
  if not 0 < fraction <= 1:
    raise ValueError(f"gpu_memory_utilization={fraction} must be in (0, 1]")
  if not stats or not stats.get("bytes_limit"):
    return None
  free = fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return max(int(free // page_bytes), 0)


def fit_num_pages(model, page_size: int, gpu_memory_utilization: float | None, *,
                  kv_cache_dtype: str | None = None, tp: int = 1) -> int:
  """KV pages of ``model``'s cache that fit beside what the device already
  holds in ``gpu_memory_utilization`` (None: 0.8) of its memory (``kv_pages``),
  or DEFAULT_NUM_PAGES where it reports no memory; there a fraction given is
  refused, as it would size nothing."""
  import jax

  explicit = gpu_memory_utilization is not None
  gpu_memory_utilization = gpu_memory_utilization if explicit else 0.8

  two = jax.eval_shape(lambda: model.init_cache(2, page_size=page_size, dtype=kv_cache_dtype))
  # Per device: the cache splits its heads over the tp devices.
  page_bytes = sum(x.size * x.dtype.itemsize for x in two) // (2 * tp)
  stats = _memory_stats()
  num_pages = kv_pages(stats, page_bytes, gpu_memory_utilization)
  if num_pages is None:
    if explicit:
      raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: the device "
                       f"({jax.devices()[0].platform}) reports no memory limit to take a share "
                       "of; pass num_pages")
    return DEFAULT_NUM_PAGES
  if num_pages < 2:
    raise ValueError(
        f"no room for a KV cache in {gpu_memory_utilization:.0%} of the device's "
        f"{stats['bytes_limit'] / 2**30:.1f} GiB beside the "
        f"{stats.get('bytes_in_use', 0) / 2**30:.1f} GiB it holds; raise "
        "gpu_memory_utilization or pass num_pages")
  return num_pages


def model_engine(spec: str | None = None, *, dtype: str | None = None,
                 num_pages: int | None = DEFAULT_NUM_PAGES,
                 gpu_memory_utilization: float | None = None,
                 page_size: int | None = None, attention: str | None = None,
                 decode_attention: str | None = None, matmul: str | None = None,
                 step_delay: float = 0.0, kv_cache_dtype: str | None = None,
                 decode_unroll: int | None = None, tp: int = 1, residual_dtype: str | None = None,
                 quantization: str | None = None, **config) -> BatchingEngine:
  """An engine over ``models.load(spec)``; "toy" and "counting" are the test models.
  ``tp`` > 1: the model's weights and KV cache split over that many devices
  (Megatron layout), each step running per shard. ``dtype`` None: float32 on
  the CPU, bfloat16 elsewhere (models.load). ``num_pages=None``: as many
  KV pages as fit in ``gpu_memory_utilization`` (None: 0.8) of the device's
  memory once the weights are on it (``kv_pages``), or DEFAULT_NUM_PAGES where
  the device reports no memory; with a page count given, a fraction is refused
  (it would size nothing). ``residual_dtype``: models.Model's (None: the model's dtype).
  ``quantization``: models.Model's ("fp8": W8A8 linears)."""
  if page_size is not None and page_size < 1:
    raise ValueError(f"page_size={page_size} must be >= 1 (None: the kernel's)")
  if num_pages is not None and num_pages < 2:
    raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved; None: as many "
                     "as fit)")
  if gpu_memory_utilization is not None and num_pages is not None:
    raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} sizes the KV cache only "
                     f"when num_pages is not given (num_pages={num_pages}): pass one of them")
  if step_delay < 0 or (step_delay and spec != "counting"):
    raise ValueError(f"step_delay={step_delay}: seconds >= 0, for the counting model only")
  if spec in ("toy", "counting"):
    for what, value in (("dtype", dtype), ("KV cache dtype", kv_cache_dtype),
                        ("GPU memory utilization", gpu_memory_utilization),
                        ("decode_unroll", decode_unroll),
                        ("residual dtype", residual_dtype),
                        ("quantization", quantization),
                        ("tensor parallelism", None if tp == 1 else tp),
                        ("attention backend", attention),
                        ("decode attention backend", decode_attention),
                        ("matmul backend", matmul)):
      if value is not None:
        raise ValueError(f"the {spec} model has no {what} option")
  if spec == "toy":
    return toy_engine(num_pages=DEFAULT_NUM_PAGES if num_pages is None else num_pages,
                      page_size=page_size or 8,
                      **config)
  if spec == "counting":
    return tiny_engine(num_pages=DEFAULT_NUM_PAGES if num_pages is None else num_pages,
                       page_size=page_size or 4,
                       step_delay=step_delay, **config)
  import jax

  import models
  from serving.engine.engine import BatchingEngine
  from serving.engine.runners import ModelRunner

  model = models.load(spec, dtype=dtype, decode_unroll=decode_unroll, tp=tp,
                      residual_dtype=residual_dtype, quantization=quantization)
  page_size = page_size or default_page_size()
  if num_pages is None:
    num_pages = fit_num_pages(model, page_size, gpu_memory_utilization,
                              kv_cache_dtype=kv_cache_dtype, tp=tp)
  runner = ModelRunner(model, num_pages=num_pages, page_size=page_size,
                       attention=attention, decode_attention=decode_attention, matmul=matmul,
                       kv_cache_dtype=kv_cache_dtype)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.cache)) // tp
  log.info("KV cache: %d pages of %d tokens (%.2f GiB a device)", num_pages, page_size,
           cache_bytes / 2**30)
  log.info("model: %r%s", model, " (the checkpoint's fp8 weights)" if model.quantization
           and quantization is None else "")
  return BatchingEngine(runner, EngineConfig(**config))
