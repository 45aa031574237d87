"""Test macros for the project's BUILD files.

pytest_test: one pytest module as one Bazel test target. Bazel's py_test
executes a script; the project's tests are pytest modules. pytest_main.py is
the entry point and gets the module's path inside the runfiles tree, so each
target runs exactly one test file with the project's pytest settings
(pyproject.toml).

import_test: imports every module of one package with nothing but the
target's deps (import_check.py), which checks a py_library's srcs and deps.

Both run on the interpreter of the project's virtual environment (the
toolchain from venv.bzl) and import the project from runfiles only.
"""

_TOOLS = "@mosaic_bazel//:"

def pytest_test(name, src, deps = [], data = [], args = [], size = "medium", **kwargs):
    main = _TOOLS + "pytest_main.py"
    native.py_test(
        name = name,
        srcs = [main, _TOOLS + "runfiles_only.py", src],
        main = main,
        args = ["$(rootpath %s)" % src] + args,
        data = data + ["@mosaic_venv//:pyproject.toml"],
        deps = deps,
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        **kwargs
    )

def import_test(name, package, deps, optional = {}, size = "small", **kwargs):
    """optional: {module: distribution} for modules that need an optional
    third-party package; checked where it is installed, skipped elsewhere."""
    main = _TOOLS + "import_check.py"
    native.py_test(
        name = name,
        srcs = [main, _TOOLS + "runfiles_only.py"],
        main = main,
        args = [package] + ["%s=%s" % (m, d) for m, d in sorted(optional.items())],
        deps = deps,
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        **kwargs
    )
