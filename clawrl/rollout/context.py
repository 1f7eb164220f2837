"""RolloutContext: what generate functions need besides slime's `(args, sample, sampling_params)`.

slime's generate functions find the router and tokenizer through module-level state. Here the
RolloutManager sets a context variable while it runs a rollout; asyncio tasks inherit it, so the default
`generate` and user plugins call `rollout_context()` to reach the engines:

    ctx = rollout_context()
    output = await ctx.router.generate({"input_ids": ids, "sampling_params": params, "return_logprob": True})

`ctx.aborted` is set when the rollout has enough samples: a generate function should then return the
sample as ABORTED without sending more requests (the default one does). Synchronous plugins (a
`--rollout-function-path` function runs in a worker thread) call `ctx.run(coroutine)` to run a coroutine
on the manager's event loop and wait for it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from clawrl.rollout.router import EngineRouter
from clawrl.rollout.timeline import RolloutTimeline


@dataclass(kw_only=True)
class RolloutContext:
    """The engines, tokenizer and event loop of the running RolloutManager."""

    router: EngineRouter
    """Routes requests to the engine servers."""
    tokenizer: Any
    """The policy's tokenizer (None if the manager was built without one)."""
    loop: asyncio.AbstractEventLoop
    """The manager's event loop (the router's HTTP clients are bound to it)."""
    aborted: bool = False
    """Set once the rollout has what it needs; requests not yet sent should not be sent."""
    call_timeout_s: float = 3600.0
    """Deadline of `run` (a coroutine submitted from a worker thread)."""
    timeline: RolloutTimeline | None = None
    """A training rollout's timeline: a generate function records each /generate call there
    (`timeline.add_engine_call(sent, back, items)`, as the default one does); None otherwise."""

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run `coroutine` on the manager's loop from a worker thread and return its result."""
        if _running_loop() is self.loop:
            coroutine.close()
            raise RuntimeError(
                "RolloutContext.run was called on the manager's event loop; `await` the coroutine instead"
            )
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=self.call_timeout_s)


_CURRENT: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "clawrl_rollout_context", default=None
)


def rollout_context() -> RolloutContext:
    """The context of the rollout this code runs in; RuntimeError outside of a RolloutManager rollout."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "no rollout is running: rollout_context() is only available inside generate / rollout functions "
            "called by a RolloutManager"
        )
    return ctx


def current_timeline() -> RolloutTimeline | None:
    """The running training rollout's timeline; None in an evaluation or outside a rollout."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.timeline


def set_rollout_context(ctx: RolloutContext | None) -> contextvars.Token:
    """Make `ctx` current for this task and the tasks it creates; returns the token to reset it."""
    return _CURRENT.set(ctx)


def reset_rollout_context(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
