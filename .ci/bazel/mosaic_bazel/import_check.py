"""Imports every module of one package from Bazel's runfiles (see defs.bzl).

A py_library is complete when each of its modules imports with nothing but
its srcs, data and deps. This catches a file left out of srcs, a dependency
left out of deps, and an import against the layering
(serving -> models -> kernels -> mosaic): //models does not depend on
//serving, so a models module that imports serving fails here.

argv[1] is the package name; each further argument, MODULE=DIST, names a
module that needs an optional third-party package (mosaic.torch=torch): it
is imported where DIST is installed in the venv and reported as skipped
where it is not. `__main__` modules are skipped (importing one runs its
command line).
"""

import importlib
import importlib.util
import os
import pkgutil
import sys
import traceback

import runfiles_only


def main() -> int:
  if len(sys.argv) < 2 or not all("=" in a for a in sys.argv[2:]):
    print(f"usage: import_check.py PACKAGE [MODULE=DIST ...] ({sys.argv[1:]=})", file=sys.stderr)
    return 2
  runfiles_only.drop_editable_install()
  name = sys.argv[1]
  optional = dict(a.split("=", 1) for a in sys.argv[2:])
  package = importlib.import_module(name)
  # Unresolved paths: the runfiles tree is symlinks into the source tree.
  here, path = os.getcwd(), os.path.abspath(package.__file__)
  if not path.startswith(here + os.sep):
    print(f"{name} imported from {path}, outside the runfiles tree {here}", file=sys.stderr)
    return 1
  modules = [m.name for m in pkgutil.walk_packages(package.__path__, name + ".")
             if m.name.rsplit(".", 1)[-1] != "__main__"]
  unknown = set(optional) - set(modules)
  if unknown:
    print(f"optional modules not in {name}: {sorted(unknown)}", file=sys.stderr)
    return 2
  failed, skipped = [], []
  for module in modules:
    if module in optional and importlib.util.find_spec(optional[module]) is None:
      skipped.append(f"{module} ({optional[module]} is not installed)")
      continue
    try:
      importlib.import_module(module)
    except Exception:  # every failure is reported, not just the first
      failed.append(module)
      traceback.print_exc()
  print(f"{name}: imported {1 + len(modules) - len(failed) - len(skipped)} of "
        f"{1 + len(modules)} modules" + (f"; skipped {', '.join(skipped)}" if skipped else ""))
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
