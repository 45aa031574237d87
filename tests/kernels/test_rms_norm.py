"""rms_norm: every backend against the float32 reference.

On CPU the mosaic backend runs the real kernel in Mosaic GPU interpret mode
with race detection; the gpu-marked cases run the full size on the GPU.
"""

import jax
import jax.numpy as jnp
import pytest

from kernels import rms_norm as rn
from mosaic import dsl, registry, testing

BACKENDS = ["mosaic", "xla"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(8, 128), (2, 3, 256), (7, 384)])
def test_matches_reference(backend, dtype, shape):
  x, w = testing.random_inputs([shape, shape[-1:]], dtype)
  x = x * 3.0 + 0.5  # a non-zero mean exercises the sum of squares
  out = rn.rms_norm(x, w, eps=1e-5, backend=backend)
  assert out.shape == x.shape and out.dtype == x.dtype
  testing.assert_close(out, rn.rms_norm_reference(x, w, eps=1e-5), dtype)
  assert not dsl.races_found()


@pytest.mark.parametrize("block_rows,stages,persistent",
                         [(1, 1, True), (2, 3, True), (4, 2, True), (1, 1, False), (4, 1, False)])
def test_each_config(block_rows, stages, persistent):
  # 8 rows over 2 persistent blocks: each walks several pipeline steps, and
  # with 3 stages the ring wraps around.
  x, w = testing.random_inputs([(8, 128), (128,)], "bfloat16")
  out = rn.rms_norm_mosaic(x, w, config=rn.Config(block_rows=block_rows, stages=stages,
                                                   persistent=persistent))
  testing.assert_close(out, rn.rms_norm_reference(x, w), "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("persistent", [False, True])
def test_layer_of_a_stack(backend, persistent):
  # Under a scan over the layer index, as the model calls it.
  layers = 3
  x, ws = testing.random_inputs([(4, 128), (layers, 128)], "bfloat16")
  kw = {"config": rn.Config(block_rows=2, persistent=persistent)} if backend == "mosaic" else {}
  op = registry.get_op("rms_norm")

  @jax.jit
  def run(x, ws):
    return jax.lax.scan(lambda c, i: (c, op(x, ws, eps=1e-5, layer=i, backend=backend, **kw)),
                        None, jnp.arange(layers, dtype=jnp.int32))[1]

  outs = run(x, ws)
  for i in range(layers):
    testing.assert_close(outs[i], rn.rms_norm_reference(x, ws[i], eps=1e-5), "bfloat16")
  if backend == "mosaic":
    assert not dsl.races_found()


def test_layer_bad_inputs():
  x, ws = testing.random_inputs([(4, 128), (2, 128)], "float32")
  for backend in ("mosaic", "xla"):
    with pytest.raises((ValueError, registry.BackendError), match="out of range"):
      rn.rms_norm(x, ws, layer=2, backend=backend)
    with pytest.raises((ValueError, registry.BackendError), match="stack"):
      rn.rms_norm(x, ws[0], layer=0, backend=backend)


def test_weight_dtype_may_differ():
  x, = testing.random_inputs([(4, 256)], "bfloat16")
  w, = testing.random_inputs([(256,)], "float32")
  out = rn.rms_norm(x, w, backend="mosaic")
  testing.assert_close(out, rn.rms_norm_reference(x, w), "bfloat16")


def test_cpu_default_is_xla():
  x, w = testing.random_inputs([(4, 128), (128,)], "float32")
  assert registry.get_op("rms_norm").select(x, w).name == "xla"


def test_unsupported_feature_size_is_explained():
  x, w = testing.random_inputs([(4, 576), (576,)], "bfloat16")
  with pytest.raises(registry.BackendError, match="multiple of 128"):
    rn.rms_norm(x, w, backend="mosaic")
  # The xla backend takes it.
  testing.assert_close(rn.rms_norm(x, w, backend="xla"), rn.rms_norm_reference(x, w), "bfloat16")


def test_bad_inputs():
  x, w = testing.random_inputs([(4, 128), (64,)], "float32")
  with pytest.raises(ValueError, match="weight.shape"):
    rn.rms_norm(x, w, backend="xla")
  with pytest.raises(registry.BackendError, match="int32 is not supported"):
    rn.rms_norm(jnp.ones((4, 128), jnp.int32), jnp.ones((128,)), backend="mosaic")
  with pytest.raises(registry.BackendError, match="valid: mosaic, reference, xla"):
    rn.rms_norm(x, x[0], backend="cuda")
  with pytest.raises(ValueError, match="block_rows"):
    rn.Config(block_rows=3)
  with pytest.raises(ValueError, match="stages"):
    rn.Config(stages=0)
  # No rows: mosaic says why (it raised ZeroDivisionError inside Pallas); the
  # others return the empty output. A list is refused by name on every backend.
  empty, w = jnp.ones((0, 256), jnp.bfloat16), jnp.ones((256,), jnp.bfloat16)
  with pytest.raises(registry.BackendError, match="no rows"):
    rn.rms_norm(empty, w, backend="mosaic")
  for backend in ("xla", "reference"):
    assert rn.rms_norm(empty, w, backend=backend).shape == (0, 256)
    with pytest.raises(ValueError, match="must be arrays, got list"):
      rn.rms_norm([1.0, 2.0], jnp.ones((2,)), backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 8192), (4096, 4096), (1000, 4096), (3, 5, 2048)])
def test_full_size_gpu(shape):
  x, w = testing.random_inputs([shape, shape[-1:]], "bfloat16")
  out = rn.rms_norm(x, w, backend="mosaic")
  testing.assert_close(out, rn.rms_norm_reference(x, w), "bfloat16")
