"""Load a script of bench/ (not a package) as a module, for the tests of its pure logic.

loop_step = load_bench("loop_step")   # bench/loop_step.py, registered in sys.modules while loaded
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as module `name` (in sys.modules: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def unload_bench(name: str) -> None:
    sys.modules.pop(name, None)
