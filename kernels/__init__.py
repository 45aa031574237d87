"""Our ops, one file each. Importing a module registers its implementations.

``kernels.load_all()`` imports every op module so the registry is complete
(entry points call it before they parse backend flags).
"""

import importlib

OP_MODULES = ("rms_norm",)


def load_all() -> None:
  for name in OP_MODULES:
    importlib.import_module(f"kernels.{name}")
