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


def test_time_jax_on_gpu_never_times_a_call_right_after_one_on_the_same_inputs(monkeypatch):
  """A timed call must find the previous set's data in L2, not its own: the
  decode weights stream from HBM in the model."""
  from mosaic import target as target_lib

  runs, timing = [], []  # runs: (input set, whether the run was being timed)

  class F:  # has .lower, so time_jax uses it as it is (no jit)
    lower = None

    def __call__(self, x):
      runs.append((x, bool(timing)))
      return x

  def fake_cupti(f, inputs):
    timing.append(True)
    f(*inputs)
    timing.clear()
    return [("kernel", 1e-6)]

  monkeypatch.setattr(target_lib, "on_gpu", lambda: True)
  monkeypatch.setattr(bench, "cupti_kernels", fake_cupti)
  t = bench.time_jax(F(), [(0,), (1,), (2,)], iters=7, warmup=2)
  assert t.n == 7 and t.timer == "cupti" and t.median_s == 1e-6
  timed = [j for j, (_, is_timed) in enumerate(runs) if is_timed]
  assert len(timed) == 7
  for j in timed:
    assert runs[j][0] != runs[j - 1][0], f"run {j} on set {runs[j][0]} right after one on it"


def test_time_jax_kernels_gives_each_kernels_median(monkeypatch):
  from mosaic import target as target_lib

  with pytest.raises(RuntimeError, match="GPU"):
    bench.time_jax_kernels(lambda x: x, [(1,)])
  runs = [[("gemm", 3.0), ("sum", 1.0)], [("gemm", 5.0), ("sum", 2.0)],
          [("gemm", 4.0), ("sum", 9.0)]]

  class F:
    lower = None

    def __call__(self, x):
      return x

  monkeypatch.setattr(target_lib, "on_gpu", lambda: True)
  times = iter(runs)
  monkeypatch.setattr(bench, "cupti_kernels", lambda f, inputs: next(times))
  assert bench.time_jax_kernels(F(), [(0,), (1,)], iters=3) == [("gemm", 4.0), ("sum", 2.0)]
  times = iter([runs[0], [("gemm", 1.0)]])  # the second call ran no sum
  with pytest.raises(RuntimeError, match="different kernels"):
    bench.time_jax_kernels(F(), [(0,), (1,)], iters=2)


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
