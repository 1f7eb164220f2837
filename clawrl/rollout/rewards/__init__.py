"""Reward functions and their dispatch: `--rm-type`, `--custom-rm-path`, and per-sample overrides.

A reward function is `async def reward(sample, **kw) -> float | dict`. Built-in types (one module each; the
whole list, what each accepts and where it differs from slime is in docs/rewards.md):
`math`, `gsm8k`, `deepscaler`, `dapo` (returns a dict; use `--reward-key score`), `f1`, `math_verify`
(needs `pip install 'clawrl[math]'`), `remote_rm` (needs `--rm-url`). The prefix `boxed_` (e.g. `boxed_f1`)
first reduces the response to the content of its last `\\boxed{}` ("" if none), then applies the named type.

`build_reward_fn` resolves the configured function once at startup, so a bad flag fails before any rollout:
    reward_fn = build_reward_fn(rm_type="math")
    reward = await compute_reward(sample, reward_fn, args=args)   # honours per-sample overrides
    rewards = await batched_reward(samples, reward_fn, args=args)

Precedence per sample (as in slime): `sample.custom_rm_path`, then `--custom-rm-path`, then
`sample.metadata["rm_type"]` (surrounding spaces ignored), then `--rm-type`.

Custom functions (`--custom-rm-path pkg.mod:fn`, `pkg.mod.fn` or `path/to/file.py:fn`) may use slime's
signature `fn(args, sample, **kw)` or clawrl's `fn(sample, **kw)`; the choice is made once from the
signature (a first parameter named `args`, or two required positional parameters, means slime's). They may
be `async` or plain functions; plain ones run in a worker thread so that they cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from clawrl.config.plugins import PluginError, load_function
from clawrl.rollout.rewards.dapo import dapo_reward
from clawrl.rollout.rewards.deepscaler import deepscaler_reward
from clawrl.rollout.rewards.f1 import f1_reward
from clawrl.rollout.rewards.gsm8k import gsm8k_reward
from clawrl.rollout.rewards.latex import last_boxed_content
from clawrl.rollout.rewards.math_rm import math_reward
from clawrl.rollout.rewards.math_verify_rm import math_verify_reward, require_math_verify
from clawrl.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel

__all__ = [
    "RM_TYPES",
    "RemoteRewardError",
    "RemoteRewardModel",
    "RewardFunction",
    "batched_reward",
    "build_reward_fn",
    "compute_reward",
]

_BUILTIN = {
    "math": math_reward,
    "gsm8k": gsm8k_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "math_verify": math_verify_reward,
}
RM_TYPES = (*_BUILTIN, "remote_rm")
"""Valid `--rm-type` values (each also accepted with the prefix `boxed_`)."""
_BOXED_PREFIX = "boxed_"

# (sample, args) -> reward; `args` is only used by slime-style custom functions.
_Caller = Callable[[Any, Any], Awaitable[Any]]


@dataclass(kw_only=True)
class RewardFunction:
    """A reward function resolved at startup; `await reward_fn(sample)` returns a float or a dict."""

    name: str
    """What was configured: the rm type (e.g. "boxed_f1") or the custom path."""
    call: _Caller = field(repr=False)
    """The resolved function, called as `call(sample, args)`."""
    args: Any = None
    """The job's arguments, passed to slime-style custom functions."""
    reward_key: str | None = None
    """`--reward-key`: a dict reward must contain it."""
    rm_url: str | None = None
    """`--rm-url`, reused when a sample overrides the type with `remote_rm`."""
    custom: bool = False
    """Built from `--custom-rm-path`: then a sample's `metadata["rm_type"]` does not apply (slime's order)."""

    async def __call__(self, sample, args: Any = None) -> float | dict[str, Any]:
        reward = await self.call(sample, self.args if args is None else args)
        return _check_reward(reward, self.name, self.reward_key)

    async def aclose(self) -> None:
        """Release held resources (the HTTP client of `remote_rm`); call from the event loop that used it."""
        closer = getattr(self.call, "aclose", None)
        if closer is not None:
            await closer()


def _check_reward(reward: Any, name: str, reward_key: str | None) -> float | dict[str, Any]:
    if isinstance(reward, dict):
        if reward_key is not None and reward_key not in reward:
            raise ValueError(
                f"reward function {name!r} returned a dict with keys {sorted(reward)}; --reward-key {reward_key!r} is not one of them"
            )
        return reward
    if isinstance(reward, (int, float)):
        return float(reward)
    raise ValueError(
        f"reward function {name!r} returned {type(reward).__name__} {reward!r}; expected a number or a dict"
    )


def build_reward_fn(
    rm_type: str | None = None,
    custom_rm_path: str | None = None,
    rm_url: str | None = None,
    reward_key: str | None = None,
    args: Any = None,
    *,
    rm_deadline_s: float = 120.0,
    reward_kwargs: dict[str, Any] | None = None,
) -> RewardFunction:
    """Resolve `--custom-rm-path` (preferred) or `--rm-type` once; one clear ValueError if neither works.

    `rm_deadline_s` is the overall per-sample budget of `remote_rm`; `reward_kwargs` go to built-in functions
    (e.g. `{"sympy_timeout_s": 2.0}` for math, `{"strict_box": True}` for dapo).
    """
    if custom_rm_path:
        call = _custom_caller(custom_rm_path)
        name = custom_rm_path
    elif rm_type:
        call = _builtin_caller(rm_type, rm_url, rm_deadline_s, reward_kwargs or {}, flag="--rm-type")
        name = rm_type
    else:
        raise ValueError(
            f"no reward function configured: pass --rm-type (one of {', '.join(RM_TYPES)}, optionally prefixed "
            "with boxed_) or --custom-rm-path module:function"
        )
    return RewardFunction(
        name=name, call=call, args=args, reward_key=reward_key, rm_url=rm_url, custom=bool(custom_rm_path)
    )


def _builtin_caller(rm_type: str, rm_url: str | None, deadline_s: float, kwargs: dict, flag: str) -> _Caller:
    boxed = rm_type.startswith(_BOXED_PREFIX)
    base = rm_type[len(_BOXED_PREFIX) :] if boxed else rm_type
    if base == "remote_rm":
        if not rm_url:
            raise ValueError(f"{flag} {rm_type!r} needs --rm-url (the reward service's URL)")
        fn = RemoteRewardModel(url=rm_url, deadline_s=deadline_s)
    elif base in _BUILTIN:
        fn = _BUILTIN[base]
        if base == "math_verify":
            require_math_verify()  # an optional package that is missing fails at startup, not mid-rollout
    else:
        raise ValueError(
            f"{flag} {rm_type!r} is not a reward type; valid types: {', '.join(RM_TYPES)} "
            f"(each also as {_BOXED_PREFIX}<type>), or use --custom-rm-path"
        )

    async def call(sample, args):
        return await fn(_boxed_view(sample) if boxed else sample, **kwargs)

    if isinstance(fn, RemoteRewardModel):
        call.aclose = fn.aclose
    return call


def _boxed_view(sample):
    """A copy of the sample whose response is its last `\\boxed{}` content ("" if none)."""
    return dataclasses.replace(sample, response=last_boxed_content(sample.response) or "")


def _custom_caller(path: str) -> _Caller:
    fn = load_function(path, "--custom-rm-path")
    slime_style = _takes_args_first(fn, path)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)

    async def call(sample, args):
        positional = (args, sample) if slime_style else (sample,)
        result = fn(*positional) if is_async else await asyncio.to_thread(fn, *positional)
        return await result if inspect.isawaitable(result) else result

    return call


def _takes_args_first(fn: Callable, path: str) -> bool:
    """True for slime's `fn(args, sample, **kw)`, False for `fn(sample, **kw)`."""
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind in positional_kinds]
    except (TypeError, ValueError):
        params = []
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(params) >= 2 and (params[0].name == "args" or len(required) == 2):
        return True
    if len(required) == 1 or (not required and params):
        return False
    raise PluginError(
        f"--custom-rm-path {path!r}: cannot tell how to call it; its parameters are {[p.name for p in params]}, "
        "expected (sample, **kw) or slime's (args, sample, **kw)"
    )


# Per-sample overrides are resolved once per distinct value and reused.
_override_cache: dict[tuple[str, str, str | None], _Caller] = {}


def _override_caller(sample, rm_url: str | None, honour_rm_type: bool) -> tuple[str, _Caller] | None:
    if sample.custom_rm_path:
        key = ("custom", sample.custom_rm_path, None)
        if key not in _override_cache:
            _override_cache[key] = _custom_caller(sample.custom_rm_path)
        return sample.custom_rm_path, _override_cache[key]
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = str(metadata.get("rm_type") or "").strip()
    if not rm_type or not honour_rm_type:
        return None
    key = ("type", rm_type, rm_url)
    if key not in _override_cache:
        flag = f"sample {sample.index}: metadata['rm_type']"
        _override_cache[key] = _builtin_caller(rm_type, rm_url, 120.0, {}, flag=flag)
    return rm_type, _override_cache[key]


async def compute_reward(sample, default_fn: RewardFunction, *, args: Any = None) -> float | dict[str, Any]:
    """The reward of one sample: its own `custom_rm_path` / `metadata["rm_type"]` if set, else `default_fn`."""
    args = getattr(default_fn, "args", None) if args is None else args
    rm_url = getattr(args, "rm_url", None) or getattr(default_fn, "rm_url", None)
    override = _override_caller(sample, rm_url, honour_rm_type=not getattr(default_fn, "custom", False))
    if override is None:
        return (
            await default_fn(sample, args)
            if isinstance(default_fn, RewardFunction)
            else await default_fn(sample)
        )
    name, call = override
    return _check_reward(await call(sample, args), name, getattr(default_fn, "reward_key", None))


async def batched_reward(
    samples: list, default_fn: RewardFunction, *, args: Any = None, max_concurrency: int | None = None
) -> list[float | dict[str, Any]]:
    """Rewards of all samples, computed concurrently (at most `max_concurrency` at a time), in input order."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(sample):
        if semaphore is None:
            return await compute_reward(sample, default_fn, args=args)
        async with semaphore:
            return await compute_reward(sample, default_fn, args=args)

    return await asyncio.gather(*(one(sample) for sample in samples))
