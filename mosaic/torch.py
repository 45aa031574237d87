"""Calling registered ops with PyTorch CUDA tensors, without copies.

``torch_op(op_name)`` returns a function that takes torch tensors, hands them
to jax through DLPack (the buffer is shared, not copied), runs the op through
the registry and hands the result back the same way. jax and torch use
different CUDA streams; DLPack's stream handshake plus a synchronize on the
jax result keeps the order right. torch is imported lazily: this module is
optional and the rest of the project never needs torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mosaic import registry


def to_jax(t: Any) -> jax.Array:
  if not t.is_contiguous():
    raise ValueError("torch tensor must be contiguous to share its buffer with jax")
  return jax.dlpack.from_dlpack(t)


def to_torch(x: jax.Array) -> Any:
  import torch

  return torch.utils.dlpack.from_dlpack(x)


def torch_op(op_name: str, backend: str | None = None) -> Callable[..., Any]:
  """The registered op ``op_name`` as a torch-in, torch-out function."""
  op = registry.get_op(op_name)

  def call(*tensors, **kwargs):
    import torch

    args = [to_jax(t) if isinstance(t, torch.Tensor) else t for t in tensors]
    out = op(*args, backend=backend, **kwargs)
    out = jax.block_until_ready(out)
    return jax.tree.map(to_torch, out)

  call.__name__ = f"torch_{op_name}"
  return call
