"""matmul: every backend against the float32 reference on fresh random inputs.

On CPU the mosaic kernel runs in Mosaic GPU interpret mode (race detection
on, see conftest) at the smallest shapes that reach each code path: ragged
M / N / K (TMA zero fill and clipped stores), bias and residual epilogues,
split-K partials, both warpgroup splits, several tiles per persistent CTA,
fp16 / fp32 outputs, and the swapped-operand small-M path.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kernels import matmul as mm
from mosaic import dsl, registry, testing

C = mm.Config


def _inputs(m, n, k, dtype=jnp.bfloat16, res_dtype=None):
  a, b, bias, res = testing.random_inputs([(m, k), (k, n), (n,), (m, n)], dtype)
  return a, b, bias, res.astype(res_dtype or dtype)


def test_registered_backends_and_cpu_default():
  op = registry.get_op("matmul")
  assert {"mosaic", "xla", "reference"} <= set(op.names)
  assert op.defaults["cpu"][0] == "xla"
  assert op.defaults["hopper"][0] == "mosaic"


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual", "both"])
def test_xla_and_reference_backends(backend, epilogue):
  a, b, bias, res = _inputs(33, 48, 40)
  bias = bias if epilogue in ("bias", "both") else None
  res = res if epilogue in ("residual", "both") else None
  out = registry.get_op("matmul")(a, b, bias=bias, residual=res, backend=backend)
  assert out.dtype == a.dtype and out.shape == (33, 48)
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias, residual=res), jnp.bfloat16)


def test_default_backend_on_cpu_is_not_interpreted():
  a, b, _, _ = _inputs(8, 16, 24)
  impl = registry.get_op("matmul").select(a, b)
  assert impl.name in ("xla", "mosaic")
  if not dsl.interpreting():
    return
  assert impl.name == "xla"


MOSAIC_CASES = [
    # m, n, k, config, bias, residual, out_dtype, in_dtype
    pytest.param(128, 256, 128, C(tile_m=64, tile_n=64, stages=2), False, False, None,
                 jnp.bfloat16, id="aligned-multi-tile"),
    pytest.param(72, 192, 192, C(tile_m=64, tile_n=128, stages=3), True, True, None,
                 jnp.bfloat16, id="partial-mn-tiles-bias-residual"),
    pytest.param(1, 256, 512, C(tile_m=64, tile_n=64, stages=3, split_k=3), True, True, None,
                 jnp.bfloat16, id="decode-split-k"),
    pytest.param(72, 64, 64, C(tile_m=64, tile_n=64, epi_n=32, stages=2, wg_dim="m"), False,
                 True, jnp.float32, jnp.bfloat16, id="wg-split-m-f32-out"),
    pytest.param(64, 128, 256, C(tile_m=64, tile_n=64, stages=2), True, False,
                 jnp.float16, jnp.float16, id="fp16"),
    pytest.param(136, 128, 64, C(tile_m=128, tile_n=64, epi_n=32, stages=2, grid_minor="m",
                                 grid_width=2), True, False, None, jnp.bfloat16,
                 id="multi-epilogue-pieces"),
    pytest.param(16, 320, 128, C(tile_m=64, tile_n=64, stages=2, persistent=False), True, True,
                 None, jnp.bfloat16, id="one-cta-per-tile-partial-n"),
    # The mixed step's rows (decode batch + prompt chunk) in one 192-row tile.
    pytest.param(136, 128, 128, C(tile_m=192, tile_n=64, stages=2), False, True, None,
                 jnp.bfloat16, id="192-row-tile"),
    # 192-column tiles (SmolLM2's N = 576 in three), the warpgroups split by M.
    pytest.param(136, 384, 128, C(tile_m=64, tile_n=192, epi_n=64, stages=2, wg_dim="m"), True,
                 False, None, jnp.bfloat16, id="192-column-tile"),
    # 2-CTA clusters sharing a multicast block: B for pairs along M, A along N.
    # 3 x 2 tiles: the pair over the 3 row tiles has a partner past the edge.
    pytest.param(136, 256, 192, C(tile_m=64, tile_n=64, stages=2, cluster="m"), True, True,
                 None, jnp.bfloat16, id="cluster-m-odd-pairs-bias-residual"),
    pytest.param(72, 384, 128, C(tile_m=64, tile_n=64, stages=2, cluster="n", grid_minor="m"),
                 False, False, None, jnp.bfloat16, id="cluster-n-odd-pairs"),
    # The mixed step's 192-row tile, pairs along N sharing its activation block.
    pytest.param(136, 384, 128, C(tile_m=192, tile_n=64, stages=2, cluster="n"), True, False,
                 None, jnp.bfloat16, id="cluster-n-192-row-tile-bias"),
    # swap_ab: weight columns as the wgmma's M, token rows as its N.
    # 4.5 K blocks: the 2-slot ring wraps, the last block is half zero fill.
    pytest.param(1, 128, 576, C(tile_m=8, tile_n=64, tile_k=128, stages=2, swap_ab=True), True,
                 True, None, jnp.bfloat16, id="swap-m1-ring-wraps-partial-k-bias-residual"),
    pytest.param(40, 192, 256, C(tile_m=32, tile_n=64, stages=3, split_k=2, swap_ab=True), True,
                 True, None, jnp.bfloat16, id="swap-partial-m-tile-split-k"),
    pytest.param(16, 64, 512, C(tile_m=16, tile_n=64, tile_k=256, stages=2, swap_ab=True), False,
                 False, jnp.float32, jnp.float16, id="swap-fp16-f32-out-256-k"),
    pytest.param(5, 128, 192, C(tile_m=8, tile_n=64, stages=4, swap_ab=True), False, True,
                 jnp.float32, jnp.bfloat16, id="swap-ring-deeper-than-k-f32-residual"),
    pytest.param(16, 256, 192, C(tile_m=16, tile_n=128, stages=2, swap_ab=True), True, True,
                 None, jnp.bfloat16, id="swap-128-columns"),
    # Tall swapped tiles (the mixed step's rows): each slot is refilled one
    # step late, so 5 K blocks through a 2-slot ring check the refill order.
    pytest.param(136, 128, 320, C(tile_m=192, tile_n=64, tile_k=64, stages=2, swap_ab=True),
                 True, True, None, jnp.bfloat16, id="swap-192-rows-ring-wraps-bias-residual"),
    pytest.param(72, 128, 512, C(tile_m=128, tile_n=64, tile_k=64, stages=3, split_k=2,
                                 swap_ab=True, cluster="k"), False, True, None, jnp.bfloat16,
                 id="swap-cluster-k-128-rows-residual"),
    # Splits summed in a cluster's SMEM (on the GPU; the interpreter sums them
    # in XLA): 2 splits, and 4 over a K whose last split is part zero fill.
    pytest.param(16, 128, 512, C(tile_m=16, tile_n=64, tile_k=128, stages=2, split_k=2,
                                 swap_ab=True, cluster="k"), True, True, None, jnp.bfloat16,
                 id="swap-cluster-k-bias-residual"),
    pytest.param(1, 64, 448, C(tile_m=8, tile_n=64, tile_k=64, stages=2, split_k=4,
                               swap_ab=True, cluster="k"), False, True, jnp.float32,
                 jnp.bfloat16, id="swap-cluster-k-4-partial-f32-residual"),
    # One K block: nothing to split, so one CTA and no cluster.
    pytest.param(8, 64, 64, C(tile_m=8, tile_n=64, tile_k=64, stages=2, split_k=2,
                              swap_ab=True, cluster="k"), True, False, None, jnp.bfloat16,
                 id="swap-cluster-k-short-k"),
    # Pairs of weight tiles sharing each activation block (multicast on the
    # GPU; the interpreter runs each tile alone): a split pair, and an odd
    # count of weight tiles, which has no pairs and runs unclustered.
    pytest.param(72, 256, 320, C(tile_m=128, tile_n=64, tile_k=64, stages=2, split_k=2,
                                 swap_ab=True, cluster="n"), True, True, None, jnp.bfloat16,
                 id="swap-cluster-n-split-bias-residual"),
    pytest.param(16, 192, 256, C(tile_m=16, tile_n=64, tile_k=64, stages=3, swap_ab=True,
                                 cluster="n"), False, True, None, jnp.bfloat16,
                 id="swap-cluster-n-odd-tiles-residual"),
]


@pytest.mark.parametrize("m,n,k,cfg,use_bias,use_res,out_dtype,dtype", MOSAIC_CASES)
def test_mosaic_kernel(m, n, k, cfg, use_bias, use_res, out_dtype, dtype):
  a, b, bias, res = _inputs(m, n, k, dtype, out_dtype)
  bias = bias if use_bias else None
  res = res if use_res else None
  out = registry.get_op("matmul")(a, b, bias=bias, residual=res, out_dtype=out_dtype,
                                  config=cfg, backend="mosaic")
  want_dtype = jnp.dtype(out_dtype or dtype)
  assert out.dtype == want_dtype and out.shape == (m, n)
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias, residual=res), want_dtype)
  if dsl.interpreting():
    assert not dsl.races_found()


LAYER_CASES = [
    # m, n, k, config, bias, residual: the kernel reads the layer's weights (and
    # bias) from the stack in place, with and without split-K partials.
    pytest.param(72, 128, 128, C(tile_m=64, tile_n=64, stages=2), True, True, id="plain"),
    pytest.param(1, 128, 256, C(tile_m=64, tile_n=64, stages=2, split_k=2), True, False,
                 id="split-k"),
    pytest.param(8, 128, 128, C(tile_m=8, tile_n=64, stages=2, swap_ab=True), True, True,
                 id="swap-ab"),
    pytest.param(136, 128, 128, C(tile_m=64, tile_n=64, stages=2, cluster="m"), True, True,
                 id="cluster"),
]


@pytest.mark.parametrize("backend", ["mosaic", "xla", "reference"])
@pytest.mark.parametrize("m,n,k,cfg,use_bias,use_res", LAYER_CASES)
def test_layer_of_a_stack(backend, m, n, k, cfg, use_bias, use_res):
  # Under a scan over the layer index, as the model calls it: each layer's
  # output must be that layer's weights' product (distinct random layers).
  layers = 3
  a, bs, biases, res = testing.random_inputs([(m, k), (layers, k, n), (layers, n), (m, n)],
                                             jnp.bfloat16)
  biases = biases if use_bias else None
  res = res if use_res else None
  kw = dict(config=cfg) if backend == "mosaic" else {}
  op = registry.get_op("matmul")

  @jax.jit
  def run(a, bs, biases, res):
    return jax.lax.scan(lambda c, i: (c, op(a, bs, bias=biases, residual=res, layer=i,
                                            backend=backend, **kw)),
                        None, jnp.arange(layers, dtype=jnp.int32))[1]

  outs = run(a, bs, biases, res)
  assert outs.shape == (layers, m, n) and outs.dtype == jnp.bfloat16
  for i in range(layers):
    want = mm.matmul_reference(a, bs[i], bias=None if biases is None else biases[i],
                               residual=res)
    testing.assert_close(outs[i], want, jnp.bfloat16)
  # A plain int picks the same layer.
  testing.assert_close(op(a, bs, bias=biases, residual=res, layer=2, backend=backend, **kw),
                       outs[2].astype(jnp.float32), jnp.bfloat16)
  if backend == "mosaic" and dsl.interpreting():
    assert not dsl.races_found()


def test_layer_bad_inputs():
  a, bs, b2 = testing.random_inputs([(4, 64), (2, 64, 64), (64, 64)], jnp.bfloat16)
  for backend in ("mosaic", "xla"):
    with pytest.raises((ValueError, registry.BackendError), match="out of range"):
      registry.get_op("matmul")(a, bs, layer=2, backend=backend)
    with pytest.raises((ValueError, registry.BackendError), match="stack"):
      registry.get_op("matmul")(a, b2, layer=0, backend=backend)
    with pytest.raises((ValueError, registry.BackendError), match="bias must be"):
      registry.get_op("matmul")(a, bs, bias=bs[0, 0], layer=0, backend=backend)
    with pytest.raises((ValueError, registry.BackendError), match="integer scalar"):
      registry.get_op("matmul")(a, bs, layer=jnp.zeros((2,), jnp.int32), backend=backend)


SWIGLU_CASES = [
    # m, n, k, config, bias, residual: both warpgroup splits, a partial last CTA
    # (its second consumer entirely past N), several epilogue pieces per
    # consumer, and split-K (the gate then runs after the partial sums).
    pytest.param(72, 384, 128, C(tile_m=64, tile_n=128, epi_n=32, stages=2), True, True,
                 id="wg-split-n-partial-cta-bias-residual"),
    pytest.param(16, 256, 256, C(tile_m=64, tile_n=128, stages=2, wg_dim="m"), False, False,
                 id="wg-split-m"),
    pytest.param(1, 256, 512, C(tile_m=64, tile_n=64, stages=3, split_k=3), True, True,
                 id="decode-split-k"),
    # swap_ab: a 128-column tile is one [gate | up] pair, gated before the store.
    pytest.param(1, 256, 320, C(tile_m=8, tile_n=128, tile_k=128, stages=2, swap_ab=True), True,
                 True, id="swap-fused-gate-bias-residual"),
    pytest.param(40, 384, 128, C(tile_m=32, tile_n=128, stages=2, swap_ab=True), False, True,
                 id="swap-partial-m-tile"),
    pytest.param(16, 256, 256, C(tile_m=16, tile_n=64, stages=2, split_k=2, swap_ab=True), True,
                 False, id="swap-split-k"),
    pytest.param(8, 256, 256, C(tile_m=8, tile_n=128, stages=2, split_k=2, swap_ab=True,
                                cluster="k"), True, True, id="swap-cluster-k"),
]


@pytest.mark.parametrize("backend", ["mosaic", "xla", "reference"])
@pytest.mark.parametrize("m,n,k,cfg,use_bias,use_res", SWIGLU_CASES)
def test_swiglu(backend, m, n, k, cfg, use_bias, use_res):
  # Built from separate gate and up weights, so the column layout is checked
  # too, not only the kernel against a reference that shares it.
  f = n // 2
  a, gate, up, bias, res = testing.random_inputs([(m, k), (k, f), (k, f), (n,), (m, f)],
                                                 jnp.bfloat16)
  bias = bias if use_bias else None
  res = res if use_res else None
  b = mm.swiglu_columns(gate, up)
  g2, u2 = mm.swiglu_split(b)
  assert (g2 == gate).all() and (u2 == up).all()
  f32 = lambda x: x.astype(jnp.float32)
  bg, bu = mm.swiglu_split(bias) if use_bias else (0.0, 0.0)
  want = jax.nn.silu(f32(a) @ f32(gate) + bg) * (f32(a) @ f32(up) + bu)
  if use_res:
    want = want + f32(res)
  kw = dict(config=cfg) if backend == "mosaic" else {}
  out = registry.get_op("matmul")(a, b, bias=bias, residual=res, activation="swiglu",
                                  backend=backend, **kw)
  assert out.shape == (m, f) and out.dtype == jnp.bfloat16
  testing.assert_close(out, want, jnp.bfloat16)
  if backend == "mosaic" and dsl.interpreting():
    assert not dsl.races_found()


def test_swiglu_fits_a_picked_tile(monkeypatch):
  # A tuned entry with 64-column consumer tiles and no split-K (the H200 has
  # such): with the fused gate the tile becomes one [gate | up] block pair and
  # keeps the entry's schedule; a split-K entry is kept as it is.
  tuned = C(tile_m=64, tile_n=64, tile_k=64, stages=8, persistent=False)
  monkeypatch.setattr(mm.tuning, "lookup", lambda *a, **k: tuned)
  assert mm.pick_config(64, 6144, 4096, jnp.bfloat16) == tuned
  fused = mm.pick_config(64, 6144, 4096, jnp.bfloat16, "swiglu")
  assert fused == dataclasses.replace(tuned, tile_n=2 * mm.SWIGLU_BLOCK)
  tuned = dataclasses.replace(tuned, split_k=4)
  assert mm.pick_config(64, 6144, 4096, jnp.bfloat16, "swiglu") == tuned


def _fake_table(monkeypatch, entries):
  """The tuning table as ``entries`` (key -> Config; add to it later), each
  missing key falling back as the real lookup does."""
  lookup = lambda op, key, cls, fallback, **_: entries[key] if key in entries else fallback()
  monkeypatch.setattr(mm.tuning, "lookup", lookup)
  return entries


def test_swiglu_entries_and_swapped_tiles(monkeypatch):
  # The fused gate's own table entry (act=swiglu) comes before the plain
  # shape's; a swap_ab entry of 64 columns becomes one [gate | up] pair.
  plain = C(tile_m=16, tile_n=64, tile_k=256, stages=5, swap_ab=True)
  fused = C(tile_m=64, tile_n=128, tile_k=128, stages=2, persistent=False)
  entries = _fake_table(monkeypatch, {mm.tuning_key(16, 28672, 4096, jnp.bfloat16): plain})
  assert mm.pick_config(16, 28672, 4096, jnp.bfloat16) == plain
  assert (mm.pick_config(16, 28672, 4096, jnp.bfloat16, "swiglu")
          == dataclasses.replace(plain, tile_n=2 * mm.SWIGLU_BLOCK))
  entries[mm.tuning_key(16, 28672, 4096, jnp.bfloat16, "swiglu")] = fused
  assert mm.pick_config(16, 28672, 4096, jnp.bfloat16, "swiglu") == fused
  assert mm.tuning_key(16, 28672, 4096, jnp.bfloat16, "swiglu").endswith(",act=swiglu")
  a, b, _, _ = _inputs(1, 256, 128)
  with pytest.raises(ValueError, match="gate"):
    mm.matmul_mosaic(a, b, activation="swiglu", config=plain)


def test_the_mixed_steps_rows_have_table_entries_of_their_own(monkeypatch):
  # 64 decode rows + a 256- or 512-token chunk: not prefill's 2,048-row entry.
  key = lambda m: mm.tuning_key(m, 6144, 4096, jnp.bfloat16).split(",")[0]
  assert [key(m) for m in (257, 320, 321, 576, 577)] == [
      "m=320", "m=320", "m=576", "m=576", "m=2048"]
  mid = C(tile_m=64, tile_n=128, tile_k=64, stages=4, wg_dim="n")
  big = C(tile_m=128, tile_n=128, tile_k=64, stages=4, wg_dim="n")
  _fake_table(monkeypatch, {mm.tuning_key(320, 6144, 4096, jnp.bfloat16): mid,
                            mm.tuning_key(2048, 6144, 4096, jnp.bfloat16): big})
  assert mm.pick_config(320, 6144, 4096, jnp.bfloat16) == mid
  assert mm.pick_config(1024, 6144, 4096, jnp.bfloat16) == big


def test_picked_config_is_fitted_to_the_residual(monkeypatch):
  # A table's 7-stage tall tile fits beside no residual tile; with the
  # model's residual (o, down) it runs one stage shallower, not refused.
  deep = C(tile_m=192, tile_n=64, tile_k=64, stages=7, swap_ab=True)
  assert deep.smem_bytes() <= mm.SMEM_LIMIT < deep.smem_bytes(residual=True)
  _fake_table(monkeypatch, {mm.tuning_key(136, 128, 320, jnp.bfloat16): deep})
  ran = []
  run = mm._run
  monkeypatch.setattr(mm, "_run", lambda *a, cfg, **k: ran.append(cfg) or run(*a, cfg=cfg, **k))
  a, b, _, res = _inputs(136, 128, 320)
  out = mm.matmul_mosaic(a, b, residual=res)
  testing.assert_close(out, mm.matmul_reference(a, b, residual=res), jnp.bfloat16)
  assert ran == [dataclasses.replace(deep, stages=6)]
  mm.matmul_mosaic(a, b)
  assert ran[-1] == deep


def test_swiglu_bad_inputs():
  op = registry.get_op("matmul")
  a, b, _, _ = _inputs(8, 192, 64)
  with pytest.raises(ValueError, match="gate"):  # 192 is not whole blocks of 2 x 64
    op(a, b, activation="swiglu", backend="xla")
  with pytest.raises(ValueError, match="activation"):
    op(a, b, activation="gelu", backend="reference")
  a, b, _, res = _inputs(8, 256, 64)
  with pytest.raises(ValueError, match="residual"):
    op(a, b, residual=res, activation="swiglu", backend="xla")  # [M, N], not [M, N / 2]
  with pytest.raises(registry.BackendError, match="tile_n"):
    op(a, b, activation="swiglu", config=C(tile_m=64, tile_n=64), backend="mosaic")
  with pytest.raises(ValueError, match="multiple of 64"):
    mm.swiglu_columns(b[:, :96], b[:, :96])


RMS_CASES = [
    # m, n, k, config, activation, bias: the fused norm (swap_ab, no split) at
    # one row, ragged rows (zero fill in the 64-row a block), a ring that wraps
    # over a partial K block, a 128-column tile with the gate, a full 64-row
    # tile and two row tiles; a split-K and a non-swap config normalize in XLA.
    pytest.param(1, 128, 576, C(tile_m=8, tile_n=64, tile_k=128, stages=2, swap_ab=True), None,
                 True, id="swap-m1-ring-wraps-partial-k-bias"),
    pytest.param(5, 256, 320, C(tile_m=8, tile_n=128, tile_k=128, stages=2, swap_ab=True),
                 "swiglu", False, id="swap-ragged-m-swiglu"),
    pytest.param(64, 128, 128, C(tile_m=64, tile_n=64, stages=2, swap_ab=True), None, False,
                 id="swap-64-rows"),
    pytest.param(24, 64, 256, C(tile_m=16, tile_n=64, stages=3, swap_ab=True), None, True,
                 id="swap-two-row-tiles"),
    pytest.param(16, 128, 256, C(tile_m=16, tile_n=64, stages=2, split_k=2, swap_ab=True), None,
                 False, id="swap-split-k-normalizes-first"),
    # A cluster's splits fuse it on the GPU: the Gram partials are summed too.
    pytest.param(5, 256, 512, C(tile_m=8, tile_n=128, tile_k=128, stages=2, split_k=2,
                                swap_ab=True, cluster="k"), "swiglu", True,
                 id="swap-cluster-k-swiglu-bias"),
    pytest.param(8, 128, 128, C(tile_m=64, tile_n=64, stages=2), None, True,
                 id="warp-specialized-normalizes-first"),
    pytest.param(72, 64, 128, C(tile_m=128, tile_n=64, stages=2, swap_ab=True), None, True,
                 id="swap-128-rows-normalizes-first"),
]


@pytest.mark.parametrize("backend", ["mosaic", "xla", "reference"])
@pytest.mark.parametrize("m,n,k,cfg,activation,use_bias", RMS_CASES)
def test_fused_rms_norm(backend, m, n, k, cfg, activation, use_bias):
  # Against RMSNorm with its weight, then the product: the weight is folded
  # into b, so the fold is checked too. Rows of different scales, so a wrong
  # row's (or no) scale shows.
  a, b, bias, w = testing.random_inputs([(m, k), (k, n), (n,), (k,)], jnp.bfloat16)
  a = (a.astype(jnp.float32) * (1.0 + jnp.arange(m, dtype=jnp.float32)[:, None])).astype(a.dtype)
  bias = bias if use_bias else None
  eps = 1e-5
  f32 = lambda x: x.astype(jnp.float32)
  h = f32(a) * jax.lax.rsqrt(jnp.mean(f32(a) ** 2, axis=-1, keepdims=True) + eps) * f32(w)
  want = mm.matmul_reference(h, f32(b), bias=bias, activation=activation)
  kw = dict(config=cfg) if backend == "mosaic" else {}
  out = registry.get_op("matmul")(a, mm.fold_rms_weight(w, b), bias=bias, activation=activation,
                                  rms_eps=eps, backend=backend, **kw)
  assert out.shape == want.shape and out.dtype == jnp.bfloat16
  testing.assert_close(out, want, jnp.bfloat16)
  if backend == "mosaic":
    in_cluster = cfg.cluster == "k" and not dsl.interpreting()
    assert mm.fuses_rms(cfg, k) == (cfg.swap_ab and cfg.tile_m <= mm.RMS_ROWS
                                    and (cfg.split_k == 1 or in_cluster))
    if dsl.interpreting():
      assert not dsl.races_found()


def test_fused_rms_norm_entries_and_bad_eps(monkeypatch):
  # The norm's own entry (norm=rms) comes first, then the activation's, then
  # the plain shape's; its SMEM counts 64-row a blocks.
  plain = C(tile_m=8, tile_n=64, tile_k=256, stages=3, swap_ab=True)
  normed = C(tile_m=8, tile_n=64, tile_k=128, stages=4, swap_ab=True)
  entries = _fake_table(monkeypatch, {mm.tuning_key(1, 6144, 4096, jnp.bfloat16): plain})
  assert mm.pick_config(1, 6144, 4096, jnp.bfloat16, rms=True) == plain
  entries[mm.tuning_key(1, 6144, 4096, jnp.bfloat16, rms=True)] = normed
  assert mm.pick_config(1, 6144, 4096, jnp.bfloat16, rms=True) == normed
  assert mm.tuning_key(1, 6144, 4096, jnp.bfloat16, "swiglu", rms=True).endswith(
      ",act=swiglu,norm=rms")
  assert plain.smem_bytes(rms=True) - plain.smem_bytes() == 3 * (64 - 8) * 256 * 2
  # A cluster's first split also holds the others' partials (and Gram rows).
  ck = C(tile_m=8, tile_n=64, tile_k=256, stages=3, split_k=4, swap_ab=True, cluster="k")
  split = C(tile_m=8, tile_n=64, tile_k=256, stages=3, split_k=4, swap_ab=True)
  assert ck.smem_bytes() - split.smem_bytes() == 3 * 64 * 8 * 4
  assert ck.smem_bytes(rms=True) - split.smem_bytes(rms=True) == 3 * (64 + 64) * 8 * 4
  deep = C(tile_m=8, tile_n=64, tile_k=256, stages=6, swap_ab=True)
  assert deep.smem_bytes() <= mm.SMEM_LIMIT < deep.smem_bytes(rms=True)
  assert mm.fit_smem(deep, rms=True).smem_bytes(rms=True) <= mm.SMEM_LIMIT
  # The epilogue's staging tile reuses the ring's SMEM; a prefetched residual
  # tile lives beside the ring (half as wide with a fused gate; a plain split
  # adds it, and gates, in the reduction after its sum).
  tall = C(tile_m=192, tile_n=128, tile_k=64, stages=3, swap_ab=True)
  assert tall.smem_bytes() == 3 * (192 + 128) * 64 * 2 + 128 * 4 + 1024
  assert tall.smem_bytes(residual=True) - tall.smem_bytes() == 192 * 128 * 2
  assert tall.smem_bytes(residual=True) - tall.smem_bytes(swiglu=True, residual=True) == (
      192 * 64 * 2)
  tall_split = dataclasses.replace(tall, split_k=2)
  assert tall_split.smem_bytes(swiglu=True, residual=True) == tall_split.smem_bytes()
  # A 6-stage ring of 192 rows fits only beside no staging tile of its own.
  deep_tall = C(tile_m=192, tile_n=64, tile_k=64, stages=6, split_k=2, swap_ab=True)
  assert mm.fit_smem(deep_tall) == deep_tall
  assert 6 * (192 + 64) * 64 * 2 + 192 * 64 * 4 > mm.SMEM_LIMIT
  # The residual costs a cluster's 256-row tile one stage of its ring.
  ck_tall = C(tile_m=256, tile_n=64, tile_k=64, stages=4, split_k=2, swap_ab=True, cluster="k")
  assert mm.fit_smem(ck_tall) == ck_tall
  assert mm.fit_smem(ck_tall, residual=True).stages == 3
  a, b, _, _ = _inputs(8, 64, 64)
  for bad in (-1.0, float("nan"), "1e-5"):
    with pytest.raises(ValueError, match="rms_eps"):
      registry.get_op("matmul")(a, b, rms_eps=bad, backend="xla")


def test_mosaic_heuristic_config():
  # No config: the tuning table / heuristic picks one (split-K for this small M).
  a, b, bias, _ = _inputs(16, 128, 512)
  cfg = mm.pick_config(16, 128, 512, a.dtype)
  assert cfg.split_k > 1
  out = registry.get_op("matmul")(a, b, bias=bias, backend="mosaic")
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias), jnp.bfloat16)


def test_bad_inputs_are_rejected():
  a, b, bias, res = _inputs(8, 16, 24)
  op = registry.get_op("matmul")
  with pytest.raises(ValueError, match="contracting"):
    op(a, b.T, backend="xla")
  with pytest.raises(ValueError, match="bias"):
    op(a, b, bias=bias[:8], backend="xla")
  with pytest.raises(ValueError, match="residual"):
    op(a, b, residual=res.T, backend="reference")
  with pytest.raises(ValueError, match="2D"):
    op(a[None], b, backend="xla")
  # Shapes TMA cannot tile: mosaic says why not; the default order moves on.
  for m, n, k, why in [(300, 1024, 1024, "multiple of 8"), (64, 1000, 1024, "N=1000"),
                       (64, 1024, 1000, "K=1000")]:
    a3, b3, _, _ = _inputs(m, n, k)
    with pytest.raises(registry.BackendError, match=why):
      op(a3, b3, backend="mosaic")
    assert registry.get_op("matmul").select(a3, b3).name == "xla"
  # Rows of 20 bf16 are 40 bytes: not TMA-aligned, so mosaic says why not.
  a2, b2, _, _ = _inputs(8, 20, 24)
  assert "16 bytes" in mm._mosaic_why_not(a2, b2)
  with pytest.raises(registry.BackendError, match="16 bytes"):
    op(a2, b2, backend="mosaic")
  assert "inputs" in mm._mosaic_why_not(a.astype(jnp.float32), b)


@pytest.mark.parametrize("bad", [
    dict(tile_m=96), dict(tile_n=12), dict(tile_k=48), dict(stages=1), dict(epi_m=32),
    dict(epi_n=48), dict(wg_dim="k"), dict(split_k=0),
    # Accepted by the interpreter, but not lowered for the GPU (test_gpu_lowering).
    dict(tile_n=32), dict(tile_k=32), dict(tile_n=64, epi_n=8),
    dict(swap_ab=True, tile_m=8, tile_n=256), dict(swap_ab=True, tile_n=64, tile_m=12),
    dict(swap_ab=True, tile_n=64, tile_m=8, tile_k=32), dict(swap_ab=1),
    dict(cluster="k"), dict(cluster="m", split_k=2), dict(cluster="n", persistent=False),
    dict(swap_ab=True, tile_m=8, tile_n=64, cluster="m"),
    dict(swap_ab=True, tile_m=8, tile_n=64, cluster="x"),
    dict(swap_ab=True, tile_m=8, tile_n=64, cluster="k"),
    dict(swap_ab=True, tile_m=8, tile_n=64, cluster="k", split_k=mm.MAX_CLUSTER_K + 1),
])
def test_config_validation(bad):
  with pytest.raises(ValueError):
    C(**bad)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (2048, 6144, 4096), (1, 28672, 4096),
                                   (64, 4096, 14336), (304, 1088, 1088), (7, 49152, 576),
                                   # the mixed step's 64 decode rows + a 128-token chunk
                                   (192, 6144, 4096), (192, 4096, 14336), (136, 4096, 4096),
                                   # the H200 table's swap_ab entries, M=5 ragged in a 16-row tile
                                   (1, 4096, 14336), (16, 6144, 4096), (5, 4096, 4096)])
def test_mosaic_gpu_full_size(m, n, k):
  a, b, bias, res = _inputs(m, n, k)
  out = registry.get_op("matmul")(a, b, bias=bias, residual=res, backend="mosaic")
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias, residual=res), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", ["m", "n"])
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (2048, 28672, 4096), (304, 1088, 1088)])
def test_cluster_multicast_gpu_full_size(m, n, k, cluster):
  # 2-CTA clusters on the card: the multicast block and the cluster barriers
  # are the hardware's (the interpreter checks the tiling only); 304 x 1088
  # leaves an odd count of tiles along both dimensions.
  a, b, bias, res = _inputs(m, n, k)
  cfg = mm.Config(stages=4, cluster=cluster)
  out = registry.get_op("matmul")(a, b, bias=bias, residual=res, config=cfg, backend="mosaic")
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias, residual=res), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", [64, 128])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_cluster_192_row_tile_gpu_full_size(n, k, tile_n):
  # The mixed step's M = 192 (64 decode rows and a 128-token chunk) in one row
  # tile, pairs of column tiles sharing the multicast activation block.
  a, b, bias, res = _inputs(192, n, k)
  cfg = mm.Config(tile_m=192, tile_n=tile_n, stages=3, cluster="n")
  out = registry.get_op("matmul")(a, b, bias=bias, residual=res, config=cfg, backend="mosaic")
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias, residual=res), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,cfg,extra", [
    (192, 4096, 14336, dict(tile_m=192, tile_k=64, stages=6, split_k=2), ("residual",)),
    (192, 4096, 4096, dict(tile_m=192, tile_k=64, stages=6), ("bias", "residual")),
    (136, 6144, 4096, dict(tile_m=192, tile_k=64, stages=5), ()),
    (64, 4096, 14336, dict(tile_m=64, tile_k=128, stages=6), ("residual",)),
    (64, 6144, 4096, dict(tile_m=64, tile_k=256, stages=3), ("rms",)),
    (1, 4096, 4096, dict(tile_m=8, tile_k=256, stages=3), ()),
    (64, 28672, 4096, dict(tile_m=64, tile_n=128, tile_k=64, stages=4), ("swiglu", "rms"))])
def test_swap_cluster_n_gpu_full_size(m, n, k, cfg, extra):
  # Pairs of weight tiles sharing each activation block: the multicast halves
  # and the pair's "both have read this slot" barrier are the hardware's.
  a, b, bias, res = _inputs(m, n, k)
  act = "swiglu" if "swiglu" in extra else None
  kw = dict(bias=bias if "bias" in extra else None,
            residual=res if "residual" in extra else None, activation=act,
            rms_eps=1e-5 if "rms" in extra else None)
  cfg = mm.Config(**{"tile_n": 64, **cfg}, swap_ab=True, cluster="n")
  out = registry.get_op("matmul")(a, b, config=cfg, backend="mosaic", **kw)
  testing.assert_close(out, mm.matmul_reference(a, b, **kw), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("m,n,k,tile_n,extra", [
    (1, 4096, 14336, 64, ()), (16, 4096, 14336, 64, ("bias",)), (64, 4096, 14336, 64, ()),
    (1, 4096, 4096, 64, ()), (1, 6144, 4096, 64, ("rms",)), (64, 6144, 4096, 64, ("rms",)),
    (1, 28672, 4096, 128, ("swiglu", "rms")), (5, 4096, 4096, 64, ())])
def test_cluster_k_gpu_full_size(m, n, k, tile_n, extra, splits):
  # Split-K summed in a cluster's SMEM: the decode shapes (down, o, qkv and
  # gate/up with the fused norm), each split's partial sent to the first
  # split's SMEM by the hardware (the interpreter cannot run this path).
  a, b, bias, res = _inputs(m, n, k)
  act = "swiglu" if "swiglu" in extra else None
  kw = dict(bias=bias if "bias" in extra else None, residual=None if act else res,
            activation=act, rms_eps=1e-5 if "rms" in extra else None)
  cfg = mm.fit_smem(mm.Config(tile_m=min(64, max(8, 8 * -(-m // 8))), tile_n=tile_n, tile_k=128,
                              stages=3, split_k=splits, swap_ab=True, cluster="k"),
                    rms="rms" in extra)
  assert mm.fuses_rms(cfg, k)
  out = registry.get_op("matmul")(a, b, config=cfg, backend="mosaic", **kw)
  testing.assert_close(out, mm.matmul_reference(a, b, **kw), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_k", [False, True])
@pytest.mark.parametrize("m,n,k,tile_n,extra", [
    (192, 4096, 14336, 64, ("residual",)), (136, 4096, 4096, 64, ("bias", "residual")),
    (128, 6144, 4096, 64, ("rms",)), (256, 4096, 4096, 64, ("residual",)),
    (160, 28672, 4096, 128, ("swiglu",))])
def test_swap_tall_tile_gpu_full_size(m, n, k, tile_n, extra, cluster_k):
  # The mixed step's rows in one swapped tile: a slot refilled one step after
  # its wgmma (the wgmma group still in flight), alone and as a cluster's
  # split; with the norm applied in XLA first (tiles over 64 rows).
  a, b, bias, res = _inputs(m, n, k)
  act = "swiglu" if "swiglu" in extra else None
  kw = dict(bias=bias if "bias" in extra else None,
            residual=res if "residual" in extra else None, activation=act,
            rms_eps=1e-5 if "rms" in extra else None)
  base = mm.Config(tile_m=next(t for t in mm.SWAP_TILE_M if t >= m), tile_n=tile_n, tile_k=64,
                   stages=4, swap_ab=True,
                   **(dict(split_k=2, cluster="k") if cluster_k else {}))
  fits = dict(swiglu=act is not None, residual="residual" in extra)
  cfg = mm.fit_smem(base, **fits)
  if cfg.smem_bytes(**fits) > mm.SMEM_LIMIT:
    pytest.skip(f"{cfg} does not fit in SMEM")
  out = registry.get_op("matmul")(a, b, config=cfg, backend="mosaic", **kw)
  testing.assert_close(out, mm.matmul_reference(a, b, **kw), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,activation", [(1, 6144, 4096, None), (16, 6144, 4096, None),
                                              (64, 6144, 4096, None), (1, 28672, 4096, "swiglu"),
                                              (16, 28672, 4096, "swiglu"),
                                              (64, 28672, 4096, "swiglu"),
                                              (2048, 6144, 4096, None)])
def test_fused_rms_norm_gpu_full_size(m, n, k, activation):
  # The decode step's qkv and gate/up with the layer's norm fused (the H200
  # table's configs), and a prefill shape that normalizes in XLA first.
  a, b, _, _ = _inputs(m, n, k)
  out = registry.get_op("matmul")(a, b, activation=activation, rms_eps=1e-5, backend="mosaic")
  want = mm.matmul_reference(a, b, activation=activation, rms_eps=1e-5)
  testing.assert_close(out, want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 28672, 4096), (16, 28672, 4096), (2048, 28672, 4096),
                                   (192, 28672, 4096), (8, 3072, 576)])
def test_swiglu_gpu_full_size(m, n, k):
  a, b, _, _ = _inputs(m, n, k)
  out = registry.get_op("matmul")(a, b, activation="swiglu", backend="mosaic")
  testing.assert_close(out, mm.matmul_reference(a, b, activation="swiglu"), jnp.bfloat16)


@pytest.mark.parametrize("m,n,k,cfg,use_bias,use_res", [
    pytest.param(128, 256, 128, None, False, False, id="aligned"),
    pytest.param(200, 200, 200, "ragged", True, True, id="ragged-bias-residual-4-tiles-per-cta"),
])
def test_blackwell_kernel_interpreted(m, n, k, cfg, use_bias, use_res):
  # tcgen05 cannot run on the Hopper card; the interpreter checks the kernel's logic.
  if not dsl.interpreting():
    pytest.skip("Blackwell kernel is checked in interpret mode only")
  from kernels import matmul_blackwell as bw

  cfg = bw.Config(tile_n=64, stages=3, epi_n=32) if cfg else bw.Config(tile_n=128, stages=2)
  a, b, bias, res = _inputs(m, n, k)
  bias = bias if use_bias else None
  res = res if use_res else None
  out = bw.run(a, b, bias, res, cfg=cfg, out_dtype=jnp.dtype(jnp.bfloat16), num_sms=2)
  testing.assert_close(out, mm.matmul_reference(a, b, bias=bias, residual=res), jnp.bfloat16)
  assert not dsl.races_found()


def test_blackwell_layer_of_a_stack_interpreted(monkeypatch):
  # On Blackwell the entry point slices the layer for the tcgen05 kernel.
  if not dsl.interpreting():
    pytest.skip("Blackwell kernel is checked in interpret mode only")
  from kernels import matmul_blackwell as bw
  from mosaic import target as target_lib

  monkeypatch.setenv("MOSAIC_INTERPRET", "1")  # still interpreted with a Blackwell target
  monkeypatch.setattr(mm.target_lib, "current",
                      lambda: target_lib.make("gpu", "NVIDIA B200", "10.0"))
  monkeypatch.setattr(mm, "_num_sms", lambda: 2)
  a, bs, biases, res = testing.random_inputs([(128, 64), (2, 64, 128), (2, 128), (128, 128)],
                                             jnp.bfloat16)
  out = mm.matmul_mosaic(a, bs, bias=biases, residual=res, layer=jnp.int32(1),
                         config=bw.Config(tile_n=128, stages=2))
  testing.assert_close(out, mm.matmul_reference(a, bs[1], bias=biases[1], residual=res),
                       jnp.bfloat16)
