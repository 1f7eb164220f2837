"""Overlapped start-up: actor calls left running while the driver starts other parts, and the start-up lines.

A job starts its engines, the rollout manager and the trainer ranks at once (clawrl/loops/run.py), so the
driver cannot wait for each part as it starts it. An `InFlight` is a set of actor calls the driver has started
and will wait for later: what they do, who runs each, their deadline, counted from when they began (or, for
calls queued behind others on the same actors, from when those finished), and the moment the last of them
finished, taken by a Ray callback as it happens, not when the driver gets round to waiting. `check()` raises
at once if one of them failed or is late, so the driver can watch one part while it waits for another.

    clock = StartupClock()                                              # start-up begins
    starting = InFlight.of([a.start.remote() for a in actors], "engine start", owners, timeout_s=600)
    ...                                                                 # start other parts meanwhile
    urls = starting.result(infos, poll=trainer.check)                   # raises naming the owner
    clock.phase("1 engine(s) ready", began, starting.ready_at)
    # clawrl: 1 engine(s) ready (8.1 s, at 12.9 s)   <- it took 8.1 s, ready 12.9 s after start-up began

`early_init_steps` says whether the trainer may build its model and optimizer while the engines load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from clawrl.cluster.deadline import ActorInfo, get_result, wait_all
from clawrl.cluster.placement import PlacementPlan
from clawrl.config.train import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class InFlight:
    """Actor calls started and not yet waited for (build with `InFlight.of`)."""

    refs: list
    """The calls' object refs."""
    what: str
    """What they do, for error messages ("engine start", "trainer init")."""
    owners: list[str]
    """owners[i] runs refs[i] ("engine 0", "trainer rank 1")."""
    timeout_s: float
    """Their deadline, from `started` (or from when `after` finished, if later)."""
    started: float = field(default_factory=time.monotonic)
    """time.monotonic() when they were started."""
    after: InFlight | None = None
    """Calls these are queued behind on the same actors: they only begin when those have finished."""
    _finished: list[float] = field(default_factory=list)
    """time.monotonic() of each call's end, appended by Ray's callbacks (success or error alike)."""
    _ready_at: float | None = None
    """When the last call ended, fixed once the driver has waited for them."""

    @classmethod
    def of(cls, refs: list, what: str, owners: list[str], *, timeout_s: float,
           after: InFlight | None = None) -> InFlight:  # fmt: skip
        flight = cls(refs=refs, what=what, owners=owners, timeout_s=timeout_s, after=after)
        for ref in refs:
            ref.future().add_done_callback(lambda _: flight._finished.append(time.monotonic()))
        return flight

    @property
    def ready_at(self) -> float | None:
        """time.monotonic() when the last call ended; None while one still runs."""
        if self._ready_at is None and len(self._finished) >= len(self.refs):
            self._ready_at = max(self._finished)
        return self._ready_at

    def deadline_start(self) -> float | None:
        """When the deadline began: None while the calls these are queued behind still run."""
        if self.after is None:
            return self.started
        before = self.after.ready_at
        return None if before is None else max(self.started, before)

    def check(self, actors: list[ActorInfo]) -> None:
        """Raise now if a call (or one it is queued behind) failed or is past its deadline; else return."""
        if self.after is not None:
            self.after.check(actors)
        began = self.deadline_start()
        if began is None:
            return
        ready, pending = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in ready:
            get_result(ref, self.what, self.owners[self.refs.index(ref)])  # raises the call's error
        if pending and time.monotonic() >= began + self.timeout_s:
            self.result(actors)  # prints the stacks of `actors` and raises DeadlineError

    def result(self, actors: list[ActorInfo], poll: Callable[[], None] | None = None) -> list[Any]:
        """Every call's result, within the deadline (stacks of `actors` printed when it passes); `poll` is
        called about once a second meanwhile and raises to end the wait early (wait_all's contract)."""
        if self.after is not None:
            self.after.result(actors, poll)
        results = wait_all(self.refs, self.what, self.timeout_s, actors, self.owners, poll,
                           started=self.deadline_start())  # fmt: skip
        if self.ready_at is None:  # Ray's callbacks run on its own thread and may not have run yet
            self._ready_at = time.monotonic()
        return results


class StartupClock:
    """Prints each start-up phase as the driver learns it ended: how long it took, and when it was ready,
    counted from the start of the start-up (parts overlap, so the durations do not add up to the total)."""

    def __init__(self) -> None:
        self.began = time.monotonic()

    def phase(self, what: str, began: float, ready_at: float | None = None) -> None:
        """`what (took s, at s)`: it began at `began` and ended at `ready_at` (default: now)."""
        end = time.monotonic() if ready_at is None else ready_at
        logger.info("%s (%.1f s, at %.1f s)", what, end - began, end - self.began)

    def done(self) -> None:
        """The last line: the start-up's wall time, from its beginning until now."""
        logger.info("start-up done in %.1f s", time.monotonic() - self.began)


def optimizer_steps(train: TrainConfig, num_rollout: int) -> int:
    """Optimizer steps of the whole run (the trainer's learning-rate schedule spans them)."""
    return num_rollout * (train.num_steps_per_rollout or 1)


def early_init_steps(plan: PlacementPlan, train: TrainConfig, num_rollout: int | None) -> int | None:
    """The optimizer steps to build the trainer's model and optimizer with while the engines load, or None
    when that build must wait for them: with --colocate the engines size their KV cache from the GPU memory
    free when they load (SGLang's --sglang-mem-fraction-static rule counts whatever is in use then, other
    processes included), so a trainer allocating on the same GPUs meanwhile would shrink it by its weights
    and optimizer state; and without --num-rollout the steps come from the rollout manager's prompt count."""
    if plan.mode == "colocate" or not num_rollout:
        return None
    return optimizer_steps(train, num_rollout)
