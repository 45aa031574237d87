"""Runs one pytest module inside Bazel's runfiles tree (see defs.bzl).

argv[1:] are pytest arguments, the first being the test file relative to the
workspace root in runfiles (the current directory when Bazel runs a test).
Settings come from the project's pyproject.toml (exposed by @mosaic_venv), so
markers, --strict-markers and warning filters match the plain pytest run.
The project is imported from runfiles only (runfiles_only.py).
"""

import os
import sys

import runfiles_only


def main() -> int:
  srcdir = os.environ.get("TEST_SRCDIR")
  if not srcdir:
    print("pytest_main.py runs under `bazel test` (TEST_SRCDIR is not set)", file=sys.stderr)
    return 2
  runfiles_only.drop_editable_install()
  root = os.getcwd()
  config = os.path.join(srcdir, "mosaic_venv", "pyproject.toml")
  tmp = os.environ.get("TEST_TMPDIR", root)
  args = ["-c", config, "--rootdir", root, "--confcutdir", root, "-p", "no:cacheprovider"]
  # Bazel collects per-test JUnit XML from here (test.xml under bazel-testlogs).
  if os.environ.get("XML_OUTPUT_FILE"):
    args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
  import pytest

  class _HypothesisHome:
    """Keeps Hypothesis's example database (./.hypothesis by default) out of
    the runfiles tree. Set from a hook, after pytest has loaded (and
    assertion-rewritten) the hypothesis plugin."""

    @staticmethod
    def pytest_configure(config):
      try:
        from hypothesis import configuration
      except ImportError:
        return
      configuration.set_hypothesis_home_dir(os.path.join(tmp, ".hypothesis"))

  # Exit status 5 (no tests collected) fails the target, as it should.
  return int(pytest.main(args + sys.argv[1:], plugins=[_HypothesisHome()]))


if __name__ == "__main__":
  sys.exit(main())
