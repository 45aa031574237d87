"""Shared test setup: gpu marker, interpreter hygiene, reproducible seeds.

Tests marked ``gpu`` run only where jax sees a CUDA GPU. Kernel tests on CPU
run in Mosaic GPU interpret mode with race detection on; after a failing
interpreted kernel the interpreter state is reset so the next test starts
clean.
"""

import os

os.environ.setdefault("MOSAIC_DETECT_RACES", "1")
# An interpreted kernel runs its barriers and copies as host callbacks, and
# those callbacks run jax ops themselves. With async dispatch the test thread
# goes on to dispatch its reference while the kernel is still running; on a
# small machine the CPU client's threads could then all wait on each other
# (seen: a hang in the kernel's wait_smem_to_gmem callback while the test
# computed its reference). Run each computation to completion on the caller.
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the CPU client exists


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
  if HAS_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_interpreter():
  yield
  if not HAS_GPU:
    from mosaic import dsl

    dsl.reset_interpret_state()
