"""RolloutManagerActor: the RolloutManager as a Ray actor, with stack dumps for the driver's deadlines.

It runs with several threads (`max_concurrency`), so the driver can ask for router statistics or route to
a replacement engine while a rollout is in flight; the manager's own event loop serialises the work.
"""

from __future__ import annotations

import ray

from clawrl.cluster.deadline import enable_stack_dumps
from clawrl.rollout.manager import RolloutManager


@ray.remote
class RolloutManagerActor(RolloutManager):
    """RolloutManager plus `where()` (pid, node) for stack dumps."""

    def __init__(self, *args, **kwargs) -> None:
        self._where = enable_stack_dumps("rollout manager")
        super().__init__(*args, **kwargs)

    def where(self) -> tuple[int, str]:
        return self._where
