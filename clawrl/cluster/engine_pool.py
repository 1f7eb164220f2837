"""EnginePool: the job's engine actors, each in its placement slot, restartable one by one.

    pool = EnginePool(configs, group, slots, gpu_fraction, num_threads=1, multi_node=False)
    urls = pool.start(timeout_s)          # all engines up (deadline), their base URLs
    new_url = pool.restart(i, timeout_s)  # kill engine i's process, start a fresh one in the same slot
    pool.stop()

A restarted engine comes up with the checkpoint's weights; the caller loads the current ones into it
(clawrl/cluster/health.py) before it takes traffic.
"""

from __future__ import annotations

import logging
import time

import ray

from clawrl.cluster.deadline import ActorInfo, wait_all
from clawrl.cluster.engine_actor import EngineActor
from clawrl.cluster.ray_cluster import Reservation, actor_options

logger = logging.getLogger(__name__)


class EnginePool:
    """Engine actors by index; the URL of engine i changes when it is restarted."""

    def __init__(self, configs: list[dict], group: Reservation | None, slots: list[int], gpu_fraction: float,
                 *, num_threads: int | None = None, multi_node: bool = False) -> None:  # fmt: skip
        self.configs, self.group, self.slots = configs, group, slots
        self.gpu_fraction, self.num_threads, self.multi_node = gpu_fraction, num_threads, multi_node
        self.actors: list = [None] * len(configs)
        self.urls: list[str] = [""] * len(configs)
        self.infos: list[ActorInfo | None] = [None] * len(configs)
        self.num_restarts = 0

    def _create(self, i: int):
        options = actor_options(self.group, self.slots[i], self.gpu_fraction)
        return EngineActor.options(**options).remote(
            self.configs[i], num_threads=self.num_threads, label=f"engine {i}", multi_node=self.multi_node
        )

    def start(self, timeout_s: float) -> list[str]:
        self.actors = [self._create(i) for i in range(len(self.configs))]
        self._wait_started(list(range(len(self.configs))), timeout_s)
        return list(self.urls)

    def _wait_started(self, indices: list[int], timeout_s: float) -> None:
        owners = [f"engine {i}" for i in indices]
        wheres = wait_all(
            [self.actors[i].where.remote() for i in indices], "engine start", timeout_s, [], owners
        )
        for i, (pid, node) in zip(indices, wheres, strict=True):
            self.infos[i] = ActorInfo(f"engine {i}", pid, node)
        urls = wait_all([self.actors[i].start.remote() for i in indices], "engine start", timeout_s,
                        [self.infos[i] for i in indices], owners)  # fmt: skip
        for i, url in zip(indices, urls, strict=True):
            self.urls[i] = url

    def restart(self, i: int, timeout_s: float) -> str:
        """Kill engine i (whatever state it is in) and start a fresh one in its slot; returns its URL."""
        started = time.monotonic()
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._create(i)
        self._wait_started([i], timeout_s)
        self.num_restarts += 1
        logger.warning("engine %d restarted in %.1f s at %s", i, time.monotonic() - started, self.urls[i])
        return self.urls[i]

    def actor_infos(self) -> list[ActorInfo]:
        return [info for info in self.infos if info is not None]

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every engine's server; an engine that does not stop in time (or is dead) is killed."""
        refs = [a.stop.remote() for a in self.actors if a is not None]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for actor in self.actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)
