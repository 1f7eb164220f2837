"""Dynamic-sampling filters (DAPO): keep or drop a finished prompt group before it joins the batch.

A filter has slime's signature `fn(args, samples: list[Sample], **kw) -> DynamicFilterOutput | bool` and is
named by `--dynamic-sampling-filter-path`. A dropped group is counted in the rollout metrics as
`rollout/dynamic_filter/drop_<reason>` and replaced by a group of fresh prompts. Built in:

    check_reward_nonzero_std   drop groups whose rewards are all equal (no GRPO signal);
                               reason "zero_std_<reward rounded to 1 decimal>", as slime names it

`apply_filter` calls a filter and checks what it returned; anything but a bool or a DynamicFilterOutput is one
PluginError naming the flag and the path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.config.plugins import PluginError
from clawrl.data.sample import Sample

FILTER_FLAG = "--dynamic-sampling-filter-path"


@dataclass(kw_only=True)
class DynamicFilterOutput:
    """A filter's verdict on one prompt group."""

    keep: bool
    """True: the group joins the batch; False: it is dropped and replaced."""
    reason: str | None = None
    """Why it was dropped; becomes the metric rollout/dynamic_filter/drop_<reason>."""


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep the group unless all its rewards are equal (population std 0)."""
    rewards = [sample.get_reward_value(getattr(args, "reward_key", None)) for sample in samples]
    if len(set(rewards)) > 1:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")


def apply_filter(fn: Callable[..., Any], path: str, args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """Call a dynamic filter; a bare bool becomes a DynamicFilterOutput whose drop reason is the fn's name."""
    verdict = fn(args, samples)
    if isinstance(verdict, DynamicFilterOutput) or _looks_like_output(verdict):
        if not isinstance(verdict.keep, bool):
            raise PluginError(
                f"{FILTER_FLAG} {path!r}: DynamicFilterOutput.keep must be a bool, got {verdict.keep!r}"
            )
        return DynamicFilterOutput(keep=verdict.keep, reason=verdict.reason)
    if isinstance(verdict, bool):
        return DynamicFilterOutput(
            keep=verdict, reason=None if verdict else getattr(fn, "__name__", "filter")
        )
    raise PluginError(
        f"{FILTER_FLAG} {path!r} returned {type(verdict).__name__} {verdict!r:.80}; "
        "expected a bool or DynamicFilterOutput(keep, reason)"
    )


def _looks_like_output(verdict: Any) -> bool:
    """slime's own DynamicFilterOutput (or any record with `keep` and `reason`) is accepted too."""
    return hasattr(verdict, "keep") and hasattr(verdict, "reason") and not isinstance(verdict, (bool, int))
