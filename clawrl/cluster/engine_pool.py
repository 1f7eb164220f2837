"""EnginePool: the job's engine actors, each in its placement slot, restartable one by one.

    pool = EnginePool(configs, group, slots, gpu_fraction, num_threads=1, multi_node=False)
    urls = pool.start(timeout_s)          # all engines up (deadline), their base URLs
    pool.launch(timeout_s); ...; urls = pool.wait_started(poll)   # the same in two steps: start other
                                          # parts meanwhile; `poll` watches them while the engines load
    new_url = pool.restart(i, timeout_s)  # kill engine i's process, start a fresh one in the same slot
    pool.stop()

A restarted engine comes up with the checkpoint's weights; the caller loads the current ones into it
(clawrl/cluster/health.py) before it takes traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from clawrl.cluster.deadline import ActorInfo
from clawrl.cluster.engine_actor import EngineActor
from clawrl.cluster.ray_cluster import Reservation, actor_options
from clawrl.cluster.startup import InFlight

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
        self.began = 0.0
        """time.monotonic() of `launch`."""
        self._starting: InFlight | None = None

    def _create(self, i: int):
        options = actor_options(self.group, self.slots[i], self.gpu_fraction)
        return EngineActor.options(**options).remote(
            self.configs[i], num_threads=self.num_threads, label=f"engine {i}", multi_node=self.multi_node
        )

    def start(self, timeout_s: float) -> list[str]:
        self.launch(timeout_s)
        return self.wait_started()

    def launch(self, timeout_s: float) -> None:
        """Create every engine actor and ask it to start, without waiting; `wait_started` waits."""
        self.began = time.monotonic()
        self.actors = [self._create(i) for i in range(len(self.configs))]
        self._starting = self._begin(list(range(len(self.configs))), timeout_s)

    def wait_started(self, poll: Callable[[], None] | None = None) -> list[str]:
        """The engines' URLs once all have started (deadline: launch's `timeout_s` for the process to
        answer, then again for the engine to load). `poll` is called about once a second meanwhile and
        raises to end the wait early."""
        self._finish(list(range(len(self.configs))), self._starting, poll)
        return list(self.urls)

    @property
    def ready_at(self) -> float | None:
        """time.monotonic() when the last engine of `launch` had started (None until then)."""
        return self._starting.ready_at if self._starting is not None else None

    def _begin(self, indices: list[int], timeout_s: float) -> InFlight:
        # Both calls are sent at once (an actor runs its calls in order): `where` answers as soon as the
        # process is up, so the stacks of an engine stuck while loading can be printed.
        owners = [f"engine {i}" for i in indices]
        where = InFlight.of([self.actors[i].where.remote() for i in indices], "engine start", owners,
                            timeout_s=timeout_s)  # fmt: skip
        start = InFlight.of([self.actors[i].start.remote() for i in indices], "engine start", owners,
                            timeout_s=timeout_s, after=where)  # fmt: skip
        return start

    def _finish(self, indices: list[int], start: InFlight, poll: Callable[[], None] | None = None) -> None:
        for i, (pid, node) in zip(indices, start.after.result([], poll), strict=True):
            self.infos[i] = ActorInfo(f"engine {i}", pid, node)
        urls = start.result([self.infos[i] for i in indices], poll)
        for i, url in zip(indices, urls, strict=True):
            self.urls[i] = url

    def _wait_started(self, indices: list[int], timeout_s: float) -> None:
        self._finish(indices, self._begin(indices, timeout_s))

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
