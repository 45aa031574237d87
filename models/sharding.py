"""Tensor parallelism in the Megatron layout, over the mesh axis 'tp'.

The params: qkv, gate_up and lm_head split their output features, wo and
w_down their input features, the rest is replicated (``param_spec``); the KV
cache splits its kv heads (``cache_sharding``). A step traced under
``jax.shard_map`` sets ``tensor_parallel()``, so the layers see their local
shard of heads and features and end wo and w_down with an all-reduce over
``tp_axis()`` (models/jitted.py runs the steps that way).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from kernels.matmul import SWIGLU_BLOCK
from models.config import ModelConfig

# Set while tracing a step under tensor parallelism: the axis the layers'
# all-reduces run over.
_TP_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("tp_axis", default=None)


def tp_axis() -> str | None:
  """The mesh axis of the step being traced, or None without tensor parallelism."""
  return _TP_AXIS.get()


@contextlib.contextmanager
def tensor_parallel(axis: str = "tp"):
  """Traces the layers inside as one shard of a tensor-parallel step."""
  token = _TP_AXIS.set(axis)
  try:
    yield
  finally:
    _TP_AXIS.reset(token)


def param_spec(path: tuple[str, ...], ndim: int) -> P:
  """PartitionSpec of one parameter over the 'tp' mesh axis (Megatron layout):
  qkv, gate_up and lm_head split their output features, wo and w_down their
  input features; norms and the embedding table are replicated."""
  names = [str(p) for p in path]
  leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
  if leaf == "in_scale":  # [L]: one static input scale per layer
    return P()
  lead = (None,) * (ndim - (2 if leaf in ("w", "w_q") else 1))
  # fp8 weights are [.., out, in] (quantize_params): their out features lead.
  if owner in ("wqkv", "w_gate_up", "lm_head"):
    return {"w": P(*lead, None, "tp"), "w_q": P(*lead, "tp", None)}.get(leaf, P(*lead, "tp"))
  if owner in ("wo", "w_down"):
    return {"w": P(*lead, "tp", None), "w_q": P(*lead, None, "tp")}.get(leaf, P())
  return P()


def check_tp(cfg: ModelConfig, tp: int) -> None:
  for what, n in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads),
                  ("intermediate_size (padded)", cfg.ffn_size),
                  ("vocab_size", cfg.vocab_size)):
    if n % tp:
      raise ValueError(f"tensor parallelism {tp=} must divide {what}={n}")
  if (cfg.ffn_size // tp) % SWIGLU_BLOCK:
    raise ValueError(f"with {tp=} each device holds {cfg.ffn_size // tp} FFN features, "
                     f"not whole fused gate/up blocks of {SWIGLU_BLOCK}")


def param_specs(params):
  """The PartitionSpec of every leaf of ``params`` (same tree), by its path."""
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  specs = []
  for path, leaf in paths_leaves:
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    specs.append(param_spec(tuple(k for k in keys if k != "value"), leaf.ndim))
  return jax.tree.unflatten(treedef, specs)


def shard_params(params, mesh):
  """Places params on ``mesh`` (axis 'tp') with the layout of ``param_spec``."""
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params,
                      param_specs(params))


def cache_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P(None, "tp"))  # split the kv heads
