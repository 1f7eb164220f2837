"""RolloutManagerActor: the RolloutManager as a threaded Ray actor, with stack dumps for the driver's deadlines.

The actor holds the manager instead of subclassing it: Ray turns a class with any coroutine method into an
asyncio actor whose synchronous methods run on its one event-loop thread, so a rollout in flight would block
every other call. Here each call runs in one of `max_concurrency` threads, and the driver can route to a
replacement engine (fault tolerance) or ask for router statistics while a rollout waits for that very engine;
the manager's own event loop serialises the work. The methods are the driver's whole vocabulary, each with a
stall point for the deadline tests (clawrl/stall_points.py).

The actor is created with the job alone, while the engines load, so its process start and imports are off the
start-up's critical path; `connect(engine_urls)` builds the RolloutManager once the engines' URLs are known.

    actor = RolloutManagerActor.options(num_cpus=0, max_concurrency=4).remote(job)
    ray.get(actor.connect.remote(urls, num_rollout_gpus=len(urls)))
"""

from __future__ import annotations

from typing import Any

import ray

from clawrl.cluster.deadline import enable_stack_dumps
from clawrl.config.job import JobConfig
from clawrl.data.train_batch import TrainBatch
from clawrl.rollout.manager import RolloutManager
from clawrl.stall_points import stall_point


@ray.remote
class RolloutManagerActor:
    """A RolloutManager in its own process; see the module docstring."""

    def __init__(self, job: JobConfig) -> None:
        self._where = enable_stack_dumps("rollout manager")
        self.job = job
        self.manager: RolloutManager | None = None
        # The manager loads its tokenizer with AutoTokenizer, whose import (~2 s) would otherwise come
        # after the engines are up, on the start-up's critical path; here it runs while they load.
        from transformers import AutoTokenizer  # noqa: F401

    def where(self) -> tuple[int, str]:
        return self._where

    def connect(self, engine_urls: list[str], **kwargs: Any) -> None:
        """Build the RolloutManager over the started engines (`kwargs`: RolloutManager's keyword arguments)."""
        self.manager = RolloutManager(self.job, engine_urls, **kwargs)

    def generate(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        stall_point("rollout.generate")
        return self.manager.generate(rollout_id)

    def eval(self, rollout_id: int) -> dict[str, float]:
        stall_point("rollout.eval")
        return self.manager.eval(rollout_id)

    def state_dict(self, before_rollout: int | None = None) -> dict[str, Any]:
        stall_point("rollout.state_dict")
        return self.manager.state_dict(before_rollout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)

    def num_rollout_for_epochs(self) -> int:
        return self.manager.num_rollout_for_epochs()

    def replace_engine(self, old_url: str, new_url: str) -> None:
        self.manager.replace_engine(old_url, new_url)

    def arm_fault(self, url: str, engine_actor: Any, mode: str) -> None:
        self.manager.arm_fault(url, engine_actor, mode)

    def progress(self) -> dict[str, float]:
        return self.manager.progress()

    def router_stats(self) -> dict[str, dict[str, int]]:
        return self.manager.router_stats()

    def check_health(self) -> dict[str, dict[str, Any]]:
        return self.manager.check_health()

    def close(self) -> None:
        if self.manager is not None:  # None: the run ended before the engines were up
            self.manager.close()
