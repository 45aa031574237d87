"""pytest_test: one pytest module as one Bazel test target.

Bazel's py_test executes a script; the project's tests are pytest modules.
The macro makes pytest_main.py the test's entry point and passes it the
module's path inside the runfiles tree, so each target runs exactly one test
file with the project's pytest settings (pyproject.toml) and the interpreter
of the project's virtual environment (the toolchain from venv.bzl).
"""

_MAIN = "@mosaic_bazel//:pytest_main.py"

def pytest_test(name, src, deps = [], data = [], args = [], size = "medium", **kwargs):
    native.py_test(
        name = name,
        srcs = [_MAIN, src],
        main = _MAIN,
        args = ["$(rootpath %s)" % src] + args,
        data = data + ["@mosaic_venv//:pyproject.toml"],
        deps = deps,
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        **kwargs
    )
