"""Load user plugins (reward, generate, filter, rollout, loss functions) by import path.

Accepted forms, as in slime: `package.module.fn` (split at the last dot) and `package.module:fn`.
A file path is also accepted: `path/to/file.py:fn`. Every failure is one error naming the flag and path.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any


class PluginError(ValueError):
    """A plugin path that cannot be loaded; the message names the flag and the path."""


def load_function(path: str, flag: str = "plugin path") -> Callable[..., Any]:
    """Import and return the callable at `path`; `flag` is named in the error message."""
    module_name, attr = _split(path, flag)
    module = _import(module_name, path, flag)
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise PluginError(f"{flag} {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _split(path: str, flag: str) -> tuple[str, str]:
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{flag} {path!r}: expected 'package.module.function' or 'package.module:function'")
    return module_name, attr


def _import(module_name: str, path: str, flag: str):
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise PluginError(f"{flag} {path!r}: file {module_name!r} does not exist")
        name = "clawrl_plugin_" + os.path.splitext(os.path.basename(module_name))[0]
        spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise PluginError(f"{flag} {path!r}: cannot import module {module_name!r} ({e})") from None
