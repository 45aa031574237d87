"""The model's jitted steps: one function per step layout of
models.llama.Llama (prefill, packed prefill, decode, mixed, packed mixed).

Each takes the model's graph definition and params (``nnx.split``), the KV
cache (donated: updated in place) and the step's int32 arrays, padded by the
caller to the bucket ladders below so few shapes compile. ``backends`` (the
ops' implementation names, ``backends()``) is static: it is part of the
compilation key. With a mesh a step runs under shard_map over the axis 'tp'
(models/sharding.py), so every kernel sees local shapes.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import llama, sharding
from models.kv_cache import KVCache
from models.llama import FP8_OP
from mosaic import registry

# Bucket ladders: a call is padded up to the next entry so the jitted functions
# see few distinct shapes. Beyond the last entry, the next power of two is used.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# At least 2 pages per row: with one, XLA:CPU fails to run the bf16 batched dot
# of attention_decode's xla backend for B >= 2 ("Unsupported element type for
# DotThunk::Execute: BF16 x BF16 = F32"); a second (scratch) page costs nothing.
PAGE_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def bucket(n: int, ladder) -> int:
  for b in ladder:
    if n <= b:
      return b
  return 1 << max(0, int(n - 1).bit_length())


def backends(**names: str | None) -> tuple[tuple[str, str], ...]:
  """Static, hashable backend choice for the jitted steps: ``op=name`` pairs.

  A name not given falls back to the registry's explicit choice at call time
  (``registry.use`` context, MOSAIC_BACKEND_<OP>), resolved here, outside jit,
  so that it is part of the compilation key; else the op's default order.
  """
  llama.ops()
  out = {}
  for op in llama.OPS + (FP8_OP,):
    name = registry.get_op(op).explicit_choice(names.get(op))
    if name is not None:
      registry.get_op(op).get(name)  # fails now on a typo
      out[op] = name
  # The matmul's name chooses the fp8 projections' backend too, unless the
  # fp8 op has a choice of its own (llama.fp8_backend).
  if "matmul" in out and FP8_OP not in out and out["matmul"] in registry.get_op(FP8_OP).names:
    out[FP8_OP] = out["matmul"]
  return tuple(out.items())


@functools.partial(jax.jit, static_argnames=("graphdef", "backends", "all_logits", "fresh", "mesh"),
                   donate_argnames=("cache",))
def prefill_step(graphdef, params, cache, tokens, positions, lengths, page_table, *,
                 backends=(), all_logits=False, fresh=False, mesh=None):
  def step(params, cache, *rest):
    model = nnx.merge(graphdef, params)
    with registry.use(**dict(backends)):
      return model.prefill(cache, *rest, all_logits=all_logits, fresh=fresh)

  return _maybe_sharded(step, mesh, params, cache, tokens, positions, lengths, page_table)


@functools.partial(jax.jit, static_argnames=("graphdef", "backends", "fresh", "mesh"),
                   donate_argnames=("cache",))
def prefill_packed_step(graphdef, params, cache, tokens, tpos, seg, last, page_table, *,
                        backends=(), fresh=True, mesh=None):
  """Llama.prefill_packed: prompt chunks in one row -> (logits [R, vocab], cache)."""
  def step(params, cache, *rest):
    model = nnx.merge(graphdef, params)
    with registry.use(**dict(backends)):
      return model.prefill_packed(cache, *rest, fresh=fresh)

  return _maybe_sharded(step, mesh, params, cache, tokens, tpos, seg, last, page_table)


@functools.partial(jax.jit, static_argnames=("graphdef", "backends", "mesh"),
                   donate_argnames=("cache",))
def decode_step(graphdef, params, cache, tokens, lengths, page_table, *, backends=(), mesh=None):
  def step(params, cache, *rest):
    model = nnx.merge(graphdef, params)
    with registry.use(**dict(backends)):
      return model.decode(cache, *rest)

  return _maybe_sharded(step, mesh, params, cache, tokens, lengths, page_table)


@functools.partial(jax.jit, static_argnames=("graphdef", "backends", "fresh", "mesh"),
                   donate_argnames=("cache",))
def mixed_step(graphdef, params, cache, dec_tokens, dec_lengths, dec_table, tokens, positions,
               lengths, page_table, *, backends=(), fresh=False, mesh=None):
  """Llama.mixed: decode rows and prefill chunks in one call -> (logits [Bd + B, vocab], cache)."""
  def step(params, cache, *rest):
    model = nnx.merge(graphdef, params)
    with registry.use(**dict(backends)):
      return model.mixed(cache, *rest, fresh=fresh)

  return _maybe_sharded(step, mesh, params, cache, dec_tokens, dec_lengths, dec_table, tokens,
                        positions, lengths, page_table)


@functools.partial(jax.jit, static_argnames=("graphdef", "backends", "fresh", "mesh"),
                   donate_argnames=("cache",))
def mixed_packed_step(graphdef, params, cache, dec_tokens, dec_lengths, dec_table, tokens, tpos,
                      seg, last, page_table, *, backends=(), fresh=False, mesh=None):
  """Llama.mixed_packed: decode rows and packed chunks -> (logits [Bd + R, vocab], cache)."""
  def step(params, cache, *rest):
    model = nnx.merge(graphdef, params)
    with registry.use(**dict(backends)):
      return model.mixed_packed(cache, *rest, fresh=fresh)

  return _maybe_sharded(step, mesh, params, cache, dec_tokens, dec_lengths, dec_table, tokens,
                        tpos, seg, last, page_table)


def _maybe_sharded(step, mesh, params, cache, *rest):
  """``step`` as is, or under shard_map over mesh axis 'tp': every op then runs
  on local shards (so our kernels run per device, not behind a gather) with
  the two all-reduces per layer of the Megatron layout."""
  if mesh is None:
    return step(params, cache, *rest)
  specs = sharding.param_specs(params)
  cache_spec = KVCache(P(None, "tp"), P(None, "tp"))

  def local(params, cache, *rest):
    with sharding.tensor_parallel("tp"):
      return step(params, cache, *rest)

  return jax.shard_map(local, mesh=mesh, in_specs=(specs, cache_spec) + (P(),) * len(rest),
                       out_specs=(P(), cache_spec), check_vma=False)(params, cache, *rest)


