"""Our ops, one file (or folder) each. Importing a module registers its
implementations in ``mosaic.registry``.

``kernels.load_all()`` imports every op module so the registry is complete;
entry points call it before they parse backend flags.
"""

import importlib
import pkgutil


def load_all() -> None:
  for info in pkgutil.iter_modules(__path__):
    if not info.name.startswith("_") and info.name != "tuning":
      importlib.import_module(f"{__name__}.{info.name}")
