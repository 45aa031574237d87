import json

import jax.numpy as jnp
import numpy as np
import pytest

from mosaic import bench, dsl, testing


def test_assert_close_fails_on_wrong_nan_and_zero_ref():
  x, = testing.random_inputs([(64, 64)], jnp.float32)
  assert testing.assert_close(x, x) == 0.0
  with pytest.raises(AssertionError, match="relative error"):
    testing.assert_close(x * 1.01, x)
  with pytest.raises(AssertionError, match="non-finite"):
    testing.assert_close(x.at[3, 3].set(jnp.nan), x, tol=1.0)
  with pytest.raises(AssertionError, match="all zeros"):
    testing.assert_close(x, jnp.zeros_like(x))
  with pytest.raises(AssertionError, match="shape mismatch"):
    testing.assert_close(x[:2], x)


def test_random_inputs_are_fresh_and_nonzero():
  a, = testing.random_inputs([(128,)], jnp.bfloat16)
  b, = testing.random_inputs([(128,)], jnp.bfloat16)
  assert not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert float(jnp.abs(a.astype(jnp.float32)).sum()) > 0
  s1, = testing.random_inputs([(8,)], jnp.float32, seed=3)
  s2, = testing.random_inputs([(8,)], jnp.float32, seed=3)
  assert np.array_equal(s1, s2)
  assert bool(jnp.isnan(testing.poisoned((2, 2), jnp.float32)).all())


def test_time_and_write(tmp_path):
  x, = testing.random_inputs([(256, 256)], jnp.float32)
  t = bench.time_jax(lambda a: a @ a, [(x,), (x + 1,)], iters=5)
  assert t.n == 5 and 0 < t.min_s <= t.median_s <= t.max_s and t.timer == "wall"
  rows = [{"impl": "xla", "ms": t.median_s * 1e3}]
  j, m = bench.write(tmp_path, "toy", rows, ["impl", "ms"], "python toy.py")
  assert json.loads(j.read_text())["rows"][0]["impl"] == "xla"
  assert "| impl | ms |" in m.read_text()


def test_smem_transforms():
  assert dsl.swizzle_bytes(64, jnp.bfloat16) == 128
  assert dsl.swizzle_bytes(16, jnp.bfloat16) == 32
  tiling, swizzle = dsl.smem_transforms((64, 64), jnp.bfloat16)
  assert swizzle.swizzle == 128 and tiling.tiling == (8, 64)
  with pytest.raises(ValueError, match="no swizzle"):
    dsl.swizzle_bytes(3, jnp.bfloat16)


def test_race_detector_sees_a_missing_wait():
  """The interpreter's race detection is on in tests and catches a bug."""
  if not dsl.interpreting():
    pytest.skip("interpret mode only")
  from mosaic.dsl import jax, plgpu

  def racy(x_gmem, o_gmem, smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
    v = smem[...]  # read before the copy is waited on: a race
    plgpu.barrier_wait(bar)
    smem[...] = v + smem[...]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  x, = testing.random_inputs([(128,)], jnp.float32)
  dsl.reset_interpret_state()
  dsl.kernel(racy, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
             scratch_types=[plgpu.SMEM((128,), jnp.float32), plgpu.Barrier()])(x)
  assert dsl.races_found()
  dsl.reset_interpret_state()


def test_cold_sets_rotate_past_the_l2():
  from mosaic import bench as bench_lib

  l2 = bench_lib.L2_BYTES
  assert bench_lib.cold_sets(235 * 2**20) == 2  # a big weight: two sets already miss L2
  n = bench_lib.cold_sets(32 * 2**20)  # o-proj: 32 MB fits in L2 alone
  assert n * 32 * 2**20 >= 2 * l2 and (n - 1) * 32 * 2**20 < 2 * l2
  assert bench_lib.cold_sets(1, max_sets=16) == 16
  with pytest.raises(ValueError):
    bench_lib.cold_sets(0)
