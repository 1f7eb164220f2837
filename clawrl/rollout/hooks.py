"""Calling rollout plugins with slime's signatures and checking what they return.

    --custom-generate-function-path   async fn(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample]
                                      (also per sample: `sample.generate_function_path`); `evaluation=` is
                                      passed only when the function's signature has that parameter
    --rollout-function-path           fn(args, rollout_id, data_source, evaluation=False) -> one of
                                        train: RolloutFnTrainOutput(samples, metrics) | list[list[Sample]]
                                        eval:  RolloutFnEvalOutput(data, metrics) | {name: {"rewards", ...}}
                                      (any object with `.samples` / `.data` is accepted, as are the legacy bare
                                      list / dict); sync functions run in a worker thread, async ones on the loop

A plugin that returns the wrong type fails with one PluginError naming the flag and the path.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.config.plugins import PluginError, load_function
from clawrl.data.sample import Sample

GENERATE_FLAG = "--custom-generate-function-path"
SAMPLE_GENERATE_FLAG = "sample.generate_function_path"
ROLLOUT_FLAG = "--rollout-function-path"
DEFAULT_GENERATE_PATH = "clawrl.rollout.generate.generate"


@dataclass(kw_only=True)
class RolloutFnTrainOutput:
    """What a training rollout function returns (slime's record of the same name)."""

    samples: list[list[Sample]]
    """Prompt groups of finished, rewarded samples."""
    metrics: dict[str, Any] | None = None
    """Extra metrics, logged with the rollout's."""


@dataclass(kw_only=True)
class RolloutFnEvalOutput:
    """What an evaluation rollout function returns (slime's record of the same name)."""

    data: dict[str, dict[str, Any]]
    """{dataset name: {"rewards": [float], "truncated": [bool] (optional), "samples": [Sample] (optional)}}."""
    metrics: dict[str, Any] | None = None
    """Extra metrics, logged with the evaluation's."""


# ------------------------------------------------------------------------------------------------------------
# generate functions
# ------------------------------------------------------------------------------------------------------------
class GenerateFunction:
    """A loaded generate function; `await gen(args, sample, params, evaluation)` -> list of Samples."""

    def __init__(self, fn: Callable[..., Any], path: str, flag: str) -> None:
        self.fn, self.path, self.flag = fn, path, flag
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = {}
        self.takes_evaluation = "evaluation" in parameters

    async def __call__(
        self, args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool
    ) -> list[Sample]:
        kwargs = {"evaluation": evaluation} if self.takes_evaluation else {}
        result = self.fn(args, sample, sampling_params, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, Sample):
            return [result]
        if isinstance(result, list) and result and all(isinstance(s, Sample) for s in result):
            return result
        raise PluginError(
            f"{self.flag} {self.path!r} returned {_describe(result)}; expected a Sample or a non-empty list of Samples"
        )


class GenerateFunctions:
    """The configured generate function plus per-sample overrides, each loaded once."""

    def __init__(self, custom_path: str | None) -> None:
        self._by_path: dict[str, GenerateFunction] = {}
        if custom_path:
            self.default = GenerateFunction(
                load_function(custom_path, GENERATE_FLAG), custom_path, GENERATE_FLAG
            )
        else:
            from clawrl.rollout.generate import generate

            self.default = GenerateFunction(generate, DEFAULT_GENERATE_PATH, "the default generate function")

    def for_sample(self, sample: Sample) -> GenerateFunction:
        path = sample.generate_function_path
        if not path:
            return self.default
        if path not in self._by_path:
            self._by_path[path] = GenerateFunction(
                load_function(path, SAMPLE_GENERATE_FLAG), path, SAMPLE_GENERATE_FLAG
            )
        return self._by_path[path]


# ------------------------------------------------------------------------------------------------------------
# rollout functions
# ------------------------------------------------------------------------------------------------------------
async def call_rollout_fn(
    fn: Callable[..., Any], args: Any, rollout_id: int, data_source: Any, evaluation: bool
) -> Any:
    """Call a rollout function; a sync one runs in a worker thread (the context variables go with it)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(args, rollout_id, data_source, evaluation=evaluation)
    result = await asyncio.to_thread(fn, args, rollout_id, data_source, evaluation=evaluation)
    return await result if inspect.isawaitable(result) else result


def train_output(result: Any, path: str) -> tuple[list[list[Sample]], dict[str, Any]]:
    """(groups, extra metrics) from what a training rollout function returned."""
    metrics: Any = {}
    if not isinstance(result, list) and hasattr(result, "samples"):
        result, metrics = result.samples, getattr(result, "metrics", None) or {}
    if not isinstance(result, list) or not result:
        raise PluginError(
            f"{ROLLOUT_FLAG} {path!r} returned {_describe(result)}; expected RolloutFnTrainOutput(samples=...) "
            "or a non-empty list of sample groups (list[list[Sample]])"
        )
    groups = [_flat_group(group, position, path) for position, group in enumerate(result)]
    return groups, _metrics_dict(metrics, path)


def _flat_group(group: Any, position: int, path: str) -> list[Sample]:
    """A group as a flat list of Samples (nested lists, from fan-out generate functions, are flattened)."""
    if isinstance(group, Sample):
        raise PluginError(
            f"{ROLLOUT_FLAG} {path!r}: item {position} of the returned list is a Sample; expected a group "
            "(list[Sample]), i.e. list[list[Sample]] overall"
        )
    flat: list[Sample] = []
    stack = [group]
    while stack:
        item = stack.pop()
        if isinstance(item, Sample):
            flat.append(item)
        elif isinstance(item, list):
            stack.extend(reversed(item))
        else:
            raise PluginError(
                f"{ROLLOUT_FLAG} {path!r}: group {position} holds {_describe(item)}; expected Samples"
            )
    if not flat:
        raise PluginError(f"{ROLLOUT_FLAG} {path!r}: group {position} is empty")
    return flat


def eval_output(result: Any, path: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """({name: {"rewards", "truncated", ...}}, extra metrics) from what an eval rollout function returned."""
    metrics: Any = {}
    if not isinstance(result, dict) and hasattr(result, "data"):
        result, metrics = result.data, getattr(result, "metrics", None) or {}
    if not isinstance(result, dict):
        raise PluginError(
            f"{ROLLOUT_FLAG} {path!r} (evaluation=True) returned {_describe(result)}; expected "
            "RolloutFnEvalOutput(data=...) or {dataset name: {'rewards': [...], ...}}"
        )
    for name, entry in result.items():
        rewards = entry.get("rewards") if isinstance(entry, dict) else None
        if not isinstance(rewards, list) or not all(isinstance(r, (int, float)) for r in rewards):
            raise PluginError(
                f"{ROLLOUT_FLAG} {path!r} (evaluation=True): entry {name!r} needs 'rewards', a list of numbers; "
                f"got {_describe(entry)}"
            )
    return result, _metrics_dict(metrics, path)


def _metrics_dict(metrics: Any, path: str) -> dict[str, Any]:
    if not isinstance(metrics, dict):
        raise PluginError(f"{ROLLOUT_FLAG} {path!r}: metrics must be a dict, got {_describe(metrics)}")
    return dict(metrics)


def check_rollout_samples(samples: list[Sample], producer: str) -> None:
    """Each finished sample must have prompt and response tokens, a reward, and per-token lists that fit.

    `producer` names what made the samples in the error (e.g. "--rollout-function-path 'pkg.fn'").
    """
    for sample in samples:
        where = f"{producer}: sample index={sample.index}"
        if not 0 < sample.response_length < len(sample.tokens):
            raise PluginError(
                f"{where} has response_length {sample.response_length} and {len(sample.tokens)} tokens; "
                "need at least one prompt token and one response token"
            )
        for name in ("loss_mask", "rollout_log_probs"):
            values = getattr(sample, name)
            if values is not None and len(values) != sample.response_length:
                raise PluginError(
                    f"{where}: {name} has {len(values)} entries, response_length is {sample.response_length}"
                )
        if sample.reward is None:
            raise PluginError(f"{where} has no reward")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
