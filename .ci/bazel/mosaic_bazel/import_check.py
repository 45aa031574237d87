"""Imports every module of one package from Bazel's runfiles (see defs.bzl).

A py_library is complete when each of its modules imports with nothing but
its srcs, data and deps. This catches a file left out of srcs, a dependency
left out of deps, and an import against the layering
(serving -> models -> kernels -> mosaic): //models does not depend on
//serving, so a models module that imports serving fails here.

argv[1] is the package name. `__main__` modules are skipped (importing one
runs its command line).
"""

import importlib
import os
import pkgutil
import sys
import traceback

import runfiles_only


def main() -> int:
  if len(sys.argv) != 2:
    print(f"usage: import_check.py PACKAGE ({sys.argv[1:]=})", file=sys.stderr)
    return 2
  runfiles_only.drop_editable_install()
  name = sys.argv[1]
  package = importlib.import_module(name)
  # Unresolved paths: the runfiles tree is symlinks into the source tree.
  here, path = os.getcwd(), os.path.abspath(package.__file__)
  if not path.startswith(here + os.sep):
    print(f"{name} imported from {path}, outside the runfiles tree {here}", file=sys.stderr)
    return 1
  modules = [m.name for m in pkgutil.walk_packages(package.__path__, name + ".")
             if m.name.rsplit(".", 1)[-1] != "__main__"]
  failed = []
  for module in modules:
    try:
      importlib.import_module(module)
    except Exception:  # every failure is reported, not just the first
      failed.append(module)
      traceback.print_exc()
  print(f"{name}: imported {1 + len(modules) - len(failed)} of {1 + len(modules)} modules")
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
