"""The engine behind the service: interface (api), batching engine, runners,
and ``process.ProcessEngine``, which runs any of them in a process of its own.

Constructors:
  tiny_engine(...)   the counting model (next byte = previous + 1): known output
  toy_engine(...)    a small random jnp decoder with the models serving API
  model_engine(spec) a models.load(spec) model (None = the embedded default)
"""

from __future__ import annotations

from serving.engine.api import (  # noqa: F401
    Delta, Draining, Engine, EngineFailed, EngineInfo, EngineStats, Failed, Final, FinishReason,
    InvalidRequest, QueueFull, Request, RequestHandle, SamplingParams, StructuredOutputs,
    TokenLogprob)
from serving.engine.engine import (  # noqa: F401
    BatchingEngine, EngineConfig, StepRecord, auto_compile_threads)
from serving.engine.runners import CountingRunner, ModelRunner  # noqa: F401


def tiny_engine(*, num_pages: int = 64, page_size: int = 4, max_context: int = 1024,
                step_delay: float = 0.0, **config) -> BatchingEngine:
  config.setdefault("warmup", False)
  runner = CountingRunner(num_pages=num_pages, page_size=page_size, max_context=max_context,
                          step_delay=step_delay)
  return BatchingEngine(runner, EngineConfig(**config))


def toy_engine(*, num_pages: int = 128, page_size: int = 8, seed: int = 0,
               **config) -> BatchingEngine:
  from serving.engine.toy_model import ToyModel

  runner = ModelRunner(ToyModel(seed=seed), num_pages=num_pages, page_size=page_size)
  return BatchingEngine(runner, EngineConfig(**config))


def default_page_size() -> int:
  try:
    from kernels.attention_decode import DEFAULT_PAGE_SIZE
    return int(DEFAULT_PAGE_SIZE)
  except ImportError:
    return 64


def model_engine(spec: str | None = None, *, dtype: str = "bfloat16", num_pages: int = 1024,
                 page_size: int | None = None, attention: str | None = None,
                 decode_attention: str | None = None, matmul: str | None = None,
                 step_delay: float = 0.0, kv_cache_dtype: str | None = None,
                 decode_unroll: int | None = None, tp: int = 1, **config) -> BatchingEngine:
  """An engine over ``models.load(spec)``; "toy" and "counting" are the test models.
  ``tp`` > 1: the model's weights and KV cache split over that many devices
  (Megatron layout), each step running per shard."""
  if spec in ("toy", "counting"):
    for what, value in (("KV cache dtype", kv_cache_dtype), ("decode_unroll", decode_unroll),
                        ("tensor parallelism", None if tp == 1 else tp)):
      if value is not None:
        raise ValueError(f"the {spec} model has no {what} option")
  if spec == "toy":
    return toy_engine(num_pages=num_pages, page_size=page_size or 8, **config)
  if spec == "counting":
    return tiny_engine(num_pages=num_pages, page_size=page_size or 4, step_delay=step_delay,
                       **config)
  import models

  model = models.load(spec, dtype=dtype, decode_unroll=decode_unroll, tp=tp)
  runner = ModelRunner(model, num_pages=num_pages, page_size=page_size or default_page_size(),
                       attention=attention, decode_attention=decode_attention, matmul=matmul,
                       kv_cache_dtype=kv_cache_dtype)
  return BatchingEngine(runner, EngineConfig(**config))
