"""Registered ops on torch CUDA tensors, sharing buffers (GPU machine only)."""

import pytest

torch = pytest.importorskip("torch")

from mosaic import testing
from mosaic import torch as mtorch


@pytest.mark.gpu
def test_rms_norm_on_torch_tensors_without_copies():
  import kernels.rms_norm  # noqa: F401 -- registers the op

  x = torch.randn(512, 1024, dtype=torch.bfloat16, device="cuda")
  w = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
  assert mtorch.to_jax(x).unsafe_buffer_pointer() == x.data_ptr()  # shared, not copied
  out = mtorch.torch_op("rms_norm", backend="mosaic")(x, w, eps=1e-6)
  assert isinstance(out, torch.Tensor) and out.is_cuda and out.shape == x.shape
  xf = x.float()
  ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
  testing.assert_close(mtorch.to_jax(out.contiguous()), mtorch.to_jax(ref), "bfloat16")
