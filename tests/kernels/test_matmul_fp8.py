"""matmul_fp8: every backend against the float32 reference of the dequantized
operands, on fresh random inputs quantized by the op's own quantizers.

On CPU the mosaic kernel runs in Mosaic GPU interpret mode at the smallest
shapes that reach each fp8 code path: the persistent kernel (both warpgroup
splits, ragged M, several tiles per CTA), split-K partials, the swapped
small-M kernel (alone, split, as a cluster's splits), the SwiGLU gate, bias
and residual epilogues, and a layer of a stack. The scales are applied in
the epilogue, so a wrong row or column scale shows as a large error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import matmul as mm
from kernels import matmul_fp8 as mf
from mosaic import dsl, registry, testing

C = mm.Config
OP = "matmul_fp8"
# Output rounding only: the operands are the same fp8 values on both sides.
TOL = 1.6e-2


def _inputs(m, n, k, layers=None, activation=None):
  x, w, bias, res = testing.random_inputs(
      [(m, k), (k, n) if layers is None else (layers, k, n),
       (n,) if layers is None else (layers, n), (m, n // 2 if activation else n)], jnp.float32)
  # Rows and channels of different magnitudes, so a misplaced scale shows.
  x = x * jnp.exp(jnp.linspace(-2.0, 2.0, m))[:, None]
  w = w * jnp.exp(jnp.linspace(-1.0, 1.0, n))
  a, a_scale = mf.quantize_rows(x)
  wq, w_scale = mf.quantize_weight(w)
  return a, a_scale, wq, w_scale, bias.astype(jnp.bfloat16), res.astype(jnp.bfloat16)


def test_registered_backends_and_defaults():
  op = registry.get_op(OP)
  assert {"mosaic", "xla", "reference"} <= set(op.names)
  assert op.defaults["hopper"][0] == "mosaic" and op.defaults["cpu"][0] == "xla"


def test_quantizers():
  x = testing.random_inputs([(6, 256)], jnp.float32)[0] * 3.0
  x = x.at[2].set(0.0)  # a row of zeros: scale MIN_SCALE, values 0, no NaN
  q, s = mf.quantize_rows(x)
  assert q.dtype == mf.FP8 and s.dtype == jnp.float32 and s.shape == (6,)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == mf.FP8_MAX
  deq = q.astype(jnp.float32) * s[:, None]
  assert np.isfinite(np.asarray(deq)).all() and float(jnp.abs(deq[2]).max()) == 0.0
  testing.assert_close(deq, x, tol=4e-2)  # e4m3: 3 mantissa bits
  # With rms_eps the scale carries the norm: q * s == rms_rows(x) up to fp8 rounding.
  q2, s2 = mf.quantize_rows(x, rms_eps=1e-5)
  np.testing.assert_array_equal(np.asarray(q2, np.float32), np.asarray(q, np.float32))
  rms = mm.rms_rows(x, 1e-5)
  testing.assert_close(q2.astype(jnp.float32) * s2[:, None], rms, tol=4e-2)
  w = testing.random_inputs([(3, 256, 128)], jnp.float32)[0]
  wq, ws = mf.quantize_weight(w)
  assert wq.shape == (3, 128, 256) and ws.shape == (3, 128)
  testing.assert_close(mf.dequantize_weight(wq, ws), w, tol=4e-2)


def test_an_activation_scale_bound_saturates_the_rows_above_it():
  # fbgemm's input_scale_ub: a row whose amax exceeds the bound gets scale
  # ub / 448 and its larger values saturate at 448; rows under it are as
  # without a bound. With rms_eps the bound is on the normalized row.
  x = testing.random_inputs([(4, 256)], jnp.float32)[0]
  x = x * jnp.array([0.5, 3.0, 40.0, 1.0])[:, None]
  amax = np.abs(np.asarray(x)).max(axis=1)
  ub = float(np.sort(amax)[1]) * 1.01  # rows 0 and 3 under it, 1 and 2 over
  q, s = mf.quantize_rows(x, scale_ub=ub)
  q0, s0 = mf.quantize_rows(x)
  over = amax > ub
  assert over.sum() == 2
  np.testing.assert_allclose(np.asarray(s)[over], ub / mf.FP8_MAX, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(s)[~over], np.asarray(s0)[~over])
  np.testing.assert_array_equal(np.asarray(q, np.float32)[~over],
                                np.asarray(q0, np.float32)[~over])
  deq = np.asarray(q, np.float32) * np.asarray(s)[:, None]
  want = np.clip(np.asarray(x), -ub, ub)  # what the bound means: values clip at ub
  assert np.isfinite(deq).all()
  np.testing.assert_allclose(deq, want, rtol=0.07, atol=ub * 2 ** -9)
  # With rms_eps: the normalized rows, bounded.
  rms = np.asarray(mm.rms_rows(x, 1e-5))
  q2, s2 = mf.quantize_rows(x, rms_eps=1e-5, scale_ub=1.5)
  np.testing.assert_allclose(np.asarray(q2, np.float32) * np.asarray(s2)[:, None],
                             np.clip(rms, -1.5, 1.5), rtol=0.07, atol=1.5 * 2 ** -9)
  for bad in (0.0, -1.0, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="scale_ub"):
      mf.quantize_rows(x, scale_ub=bad)


CASES = [
    # m, n, k, config, activation, bias, residual
    pytest.param(72, 256, 256, C(tile_m=64, tile_n=64, tile_k=128, stages=2), None, True, True,
                 id="persistent-ragged-m-multi-tile"),
    pytest.param(72, 128, 256, C(tile_m=64, tile_n=64, tile_k=128, epi_n=32, stages=2,
                                 wg_dim="m"), None, False, True, id="persistent-wg-split-m"),
    pytest.param(8, 128, 512, C(tile_m=64, tile_n=64, tile_k=128, stages=2, split_k=2), None,
                 True, True, id="persistent-split-k"),
    pytest.param(136, 256, 256, C(tile_m=64, tile_n=128, tile_k=128, stages=2), "swiglu", True,
                 True, id="persistent-swiglu"),
    pytest.param(5, 256, 384, C(tile_m=8, tile_n=64, tile_k=128, stages=2, swap_ab=True), None,
                 True, True, id="swap-ragged-m"),
    pytest.param(16, 256, 512, C(tile_m=16, tile_n=128, tile_k=256, stages=2, swap_ab=True),
                 "swiglu", True, True, id="swap-swiglu"),
    pytest.param(16, 128, 512, C(tile_m=16, tile_n=64, tile_k=128, stages=2, swap_ab=True,
                                 split_k=2), None, True, True, id="swap-split-k"),
    # Interpret mode has no clusters: cluster="k" runs its splits as partials.
    pytest.param(16, 256, 512, C(tile_m=16, tile_n=128, tile_k=128, stages=2, swap_ab=True,
                                 split_k=2, cluster="k"), "swiglu", False, False,
                 id="swap-cluster-k-swiglu"),
]


@pytest.mark.parametrize("m,n,k,cfg,activation,use_bias,use_res", CASES)
def test_mosaic_kernel(m, n, k, cfg, activation, use_bias, use_res):
  a, a_scale, w, w_scale, bias, res = _inputs(m, n, k, activation=activation)
  kw = dict(a_scale=a_scale, w_scale=w_scale, bias=bias if use_bias else None,
            residual=res if use_res else None, activation=activation)
  out = registry.get_op(OP)(a, w, config=cfg, backend="mosaic", **kw)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n // 2 if activation else n)
  testing.assert_close(out, mf.matmul_fp8_reference(a, w, **kw), tol=TOL)
  if dsl.interpreting():
    assert not dsl.races_found()


@pytest.mark.parametrize("backend", ["mosaic", "xla", "reference"])
def test_layer_of_a_stack(backend):
  # Under a scan, as the model calls it: each layer's output is that layer's.
  m, n, k, layers = 8, 128, 256, 3
  a, a_scale, w, w_scale, bias, res = _inputs(m, n, k, layers=layers)
  cfg = dict(config=C(tile_m=8, tile_n=64, tile_k=128, stages=2, swap_ab=True)) \
      if backend == "mosaic" else {}

  def body(_, layer):
    y = registry.get_op(OP)(a, w, a_scale=a_scale, w_scale=w_scale, bias=bias, residual=res,
                            layer=layer, backend=backend, **cfg)
    return None, y

  _, ys = jax.lax.scan(body, None, jnp.arange(layers, dtype=jnp.int32))
  for i in range(layers):
    ref = mf.matmul_fp8_reference(a, w[i], a_scale=a_scale, w_scale=w_scale[i], bias=bias[i],
                                  residual=res)
    testing.assert_close(ys[i], ref, tol=TOL)


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_xla_and_reference_backends(backend, activation):
  a, a_scale, w, w_scale, bias, res = _inputs(24, 256, 384, activation=activation)
  kw = dict(a_scale=a_scale, w_scale=w_scale, bias=bias, residual=res, activation=activation)
  out = registry.get_op(OP)(a, w, backend=backend, **kw)
  testing.assert_close(out, mf.matmul_fp8_reference(a, w, **kw), tol=TOL)


def test_against_the_bf16_product():
  # What the model sees: fp8 operands of bf16-range data stay within e4m3's
  # rounding of the unquantized product (two 3-bit mantissas: a few percent).
  x, w = testing.random_inputs([(32, 512), (512, 256)], jnp.float32)
  a, a_scale = mf.quantize_rows(x)
  wq, w_scale = mf.quantize_weight(w)
  out = registry.get_op(OP)(a, wq, a_scale=a_scale, w_scale=w_scale, out_dtype=jnp.float32)
  err = testing.rel_error(out, x @ w)
  assert 1e-3 < err < 6e-2, err


def test_bad_inputs_are_refused_by_name():
  a, a_scale, w, w_scale, _, _ = _inputs(8, 128, 256)
  op = registry.get_op(OP)
  bad = [
      (dict(a=a.astype(jnp.bfloat16)), "float8_e4m3fn"),
      (dict(w=w[:, :128]), "contracting dims"),
      (dict(a_scale=a_scale[:4]), "a_scale must be float32 \\[8\\]"),
      (dict(w_scale=w_scale.astype(jnp.bfloat16)), "w_scale must be float32"),
      (dict(activation="gelu"), "activation"),
      (dict(residual=jnp.zeros((8, 64), jnp.bfloat16)), "residual must be"),
      (dict(out_dtype=jnp.int8), "out_dtype"),
      (dict(layer=0), "w must be a \\[L, N, K\\] stack"),
  ]
  for change, match in bad:
    kw = dict(a=a, w=w, a_scale=a_scale, w_scale=w_scale) | change
    x, y = kw.pop("a"), kw.pop("w")
    for backend in ("mosaic", "xla", "reference"):
      with pytest.raises(ValueError, match=match):
        op(x, y, backend=backend, **kw)
  # Shapes only the kernel refuses: the reason names the dimension.
  a2, s2, w2, ws2, _, _ = _inputs(8, 128, 192)
  with pytest.raises(ValueError, match="K=192 must be a multiple of 128"):
    op(a2, w2, a_scale=s2, w_scale=ws2, backend="mosaic")
  with pytest.raises(ValueError, match="tile_k"):
    op(a, w, a_scale=a_scale, w_scale=w_scale, backend="mosaic",
       config=C(tile_m=8, tile_n=64, tile_k=64, swap_ab=True))
  with pytest.raises(ValueError, match="config= applies to the mosaic backend only"):
    op(a, w, a_scale=a_scale, w_scale=w_scale, backend="xla", config=C())
  for backend in ("mosaic", "xla", "reference"):
    with pytest.raises(ValueError, match="a_scale= is required"):
      op(a, w, w_scale=w_scale, backend=backend)
  # The quantizers name their operand's expected shape.
  for bad_x in (jnp.ones((8,)), jnp.ones((2, 3, 4)), jnp.ones((4, 0))):
    with pytest.raises(ValueError, match=r"quantize_rows' x \[M, K\] must be a non-empty 2-D"):
      mf.quantize_rows(bad_x)
  with pytest.raises(ValueError, match=r"quantize_weight's w \[\.\.\., K, N\]"):
    mf.quantize_weight(jnp.ones((16,)))


def test_fp8_heuristic_configs():
  # Small M streams the weights through swapped tiles split in a cluster;
  # every K block is at least 128 bytes.
  small = mm.heuristic(1, 4096, 4096, 132, itemsize=1)
  assert small.swap_ab and small.tile_m == 8 and small.tile_k >= 128 and small.cluster == "k"
  big = mm.heuristic(2048, 4096, 4096, 132, itemsize=1)
  assert not big.swap_ab and big.tile_k == 128
  for cfg in (small, big):
    assert cfg.smem_bytes(1) <= mm.SMEM_LIMIT


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (2048, 6144, 4096), (1, 28672, 4096),
                                   (16, 6144, 4096), (64, 4096, 14336), (320, 4096, 4096),
                                   (5, 4096, 4096)])
def test_mosaic_gpu_full_size(m, n, k):
  a, a_scale, w, w_scale, bias, res = _inputs(m, n, k)
  kw = dict(a_scale=a_scale, w_scale=w_scale, bias=bias, residual=res)
  out = registry.get_op(OP)(a, w, backend="mosaic", **kw)
  testing.assert_close(out, mf.matmul_fp8_reference(a, w, **kw), tol=TOL)
  out = registry.get_op(OP)(a, w, backend="mosaic", activation="swiglu",
                            **(kw | dict(residual=None)))
  testing.assert_close(out, mf.matmul_fp8_reference(a, w, activation="swiglu",
                                                    **(kw | dict(residual=None))), tol=TOL)
