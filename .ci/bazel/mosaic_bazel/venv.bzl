"""venv_python: the project's virtual environment as Bazel's Python toolchain.

Bazel 4's py_test runs whatever `python3` the test's PATH offers. We want the
interpreter of `.venv` (created by .ci/setup: Python 3.12, jax 0.11.2, the
project's dependencies), found relative to the workspace root so no absolute
path is checked in. MOSAIC_BAZEL_VENV (in the environment of `bazel`)
points at another virtual environment instead.

The repository also exposes the workspace's pyproject.toml, which holds the
pytest settings, since the workspace root itself is not a Bazel package.
"""

def _venv_python_impl(rctx):
    # The workspace root holds no BUILD file, so it is found through a package.
    root = rctx.path(Label("@//mosaic:BUILD.bazel")).dirname.dirname
    venv = rctx.os.environ.get("MOSAIC_BAZEL_VENV", "") or "%s/.venv" % root
    python = rctx.path(venv + "/bin/python3")
    if not python.exists:
        fail("no Python at %s: create the virtual environment first (.ci/setup), or set MOSAIC_BAZEL_VENV" % python)
    check = rctx.execute([python, "-c", "import sys, pytest; print('%d.%d' % sys.version_info[:2])"])
    if check.return_code != 0:
        fail("%s cannot import pytest (run .ci/setup): %s" % (python, check.stderr))
    rctx.symlink(root.get_child("pyproject.toml"), "pyproject.toml")
    rctx.file("BUILD.bazel", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["pyproject.toml"])

# Python {version} of {venv}
py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(python = python, venv = venv, version = check.stdout.strip()))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    environ = ["MOSAIC_BAZEL_VENV"],
    local = True,
)
