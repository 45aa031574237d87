"""Makes the project importable from Bazel's runfiles tree only.

.venv holds an editable install of the project (.ci/setup), whose import hook
would supply any module that a BUILD file forgot: the test would pass under
Bazel for the wrong reason. Removing the hook leaves sys.path, which Bazel
fills with the runfiles of the target's declared srcs and deps.
"""

import sys


def drop_editable_install() -> None:
  def editable(obj):
    return getattr(obj, "__module__", "").startswith("__editable__")

  sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
  sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
  sys.path_importer_cache.clear()
