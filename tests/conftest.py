"""Shared test setup: gpu marker, interpreter hygiene, reproducible seeds, a
compilation cache per test process.

Tests marked ``gpu`` run only where jax sees a CUDA GPU. Kernel tests on CPU
run in Mosaic GPU interpret mode with race detection on; after a failing
interpreted kernel the interpreter state is reset so the next test starts
clean.

Many tests build their own engine over the same tiny model, and each
engine's runner jits its steps afresh, so the same programs would compile
again and again. jax's persistent compilation cache, in a directory of each
test process (removed at its end), hands a program compiled once to every
later compile of the same program in that process: the executable is the one
XLA made for it, and a load counts as a compile wherever a test counts them
(jax.monitoring's backend_compile event). Child processes that tests start
do not inherit it. MOSAIC_TEST_COMPILATION_CACHE=0 turns it off.
"""

import os
import shutil
import tempfile

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


def pytest_configure(config):
  if os.environ.get("MOSAIC_TEST_COMPILATION_CACHE", "1") == "0":
    return
  if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
    return  # the controller of xdist workers: it runs no test
  # One directory per process: xdist workers do not share it, since a write
  # there is not atomic (jax locks its files only when it also evicts, and
  # the eviction's scan of the directory at every write cost more than the
  # cache saved on the kernel tests).
  path = config._mosaic_compilation_cache = tempfile.mkdtemp(prefix="mosaic-test-jax-cache-")
  # jax settles whether a cache is in use at the first compile: before any test.
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  path = getattr(config, "_mosaic_compilation_cache", None)
  if path is not None:
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _reset_interpreter():
  yield
  if not HAS_GPU:
    from mosaic import dsl

    dsl.reset_interpret_state()
