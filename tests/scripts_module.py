"""Import one of ``scripts/*.py`` or ``schedules/lab/*.py`` (not packages) as a module, for tests
of their pure parts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "scripts", ROOT / "schedules" / "lab")


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py`` or ``schedules/lab/<name>.py``, executed (its ``main``
    is not run)."""
    path = next(f / f"{name}.py" for f in FOLDERS if (f / f"{name}.py").exists())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
