"""ConfigError and the single-field value checks that component configs run in `__post_init__`.

Every message names the flag and the bad value, e.g. "--rollout-temperature must be > 0, got 0.0".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A user mistake in the job's flags; the message names the flag(s) and the bad value(s)."""


def flag_of(name: str) -> str:
    """The option string of a field: `rollout_batch_size` -> `--rollout-batch-size`."""
    return "--" + name.replace("_", "-")


def check(cfg: Any, name: str, ok: Callable[[Any], bool], rule: str) -> None:
    """Raise ConfigError "<flag> <rule>, got <value>" unless `ok(value)`; None (unset) always passes.

    A list value is checked element by element and the first bad element is named.
    """
    value = getattr(cfg, name)
    for item in value if isinstance(value, list) else [value]:
        if item is not None and not ok(item):
            raise ConfigError(f"{flag_of(name)} {rule}, got {item!r}")


def at_least(cfg: Any, name: str, low: float) -> None:
    check(cfg, name, lambda v: v >= low, f"must be >= {low}")


def above(cfg: Any, name: str, low: float) -> None:
    check(cfg, name, lambda v: v > low, f"must be > {low}")


def in_range(cfg: Any, name: str, low: float, high: float, *, open_low: bool = False) -> None:
    """`low <= value <= high`, or `low < value <= high` with open_low."""
    if open_low:
        check(cfg, name, lambda v: low < v <= high, f"must be in ({low}, {high}]")
    else:
        check(cfg, name, lambda v: low <= v <= high, f"must be in [{low}, {high}]")


def top_k_valid(cfg: Any, name: str) -> None:
    """Top-k is -1 (off) or a positive count, as in SGLang's sampling params."""
    check(cfg, name, lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")


def non_empty(cfg: Any, name: str) -> None:
    check(cfg, name, lambda v: v != "", "must not be empty")
