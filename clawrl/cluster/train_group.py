"""The trainer as a group of Ray actors, one per data-parallel rank, driven in lock step.

Every method of the group calls the same method on every rank and waits for all of them (the ranks run
collectives together), with a deadline: a rank that hangs or dies fails the call with its rank named.
"""

from __future__ import annotations

from typing import Any

import ray

from clawrl.cluster.placement import PlacementPlan
from clawrl.cluster.ray_cluster import actor_options
from clawrl.config.job import JobConfig
from clawrl.data.train_batch import TrainBatch

CALL_TIMEOUT_S = 3600.0


@ray.remote
class TrainWorker:
    """One trainer rank: a TrainActor plus the weight-sync step (rank 0 sends, every rank gathers)."""

    def __init__(self, job_dict: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 device: str, num_threads: int | None):  # fmt: skip
        import torch

        from clawrl.trainer.actor import TrainActor

        if num_threads:
            torch.set_num_threads(num_threads)
        job = JobConfig.from_dict(job_dict)
        self.actor = TrainActor(
            job,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
        )

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.actor, method)(*args, **kwargs)

    def update_weights(self, transport: dict, version: str) -> dict[str, float]:
        """Gather the weights bucket by bucket (collective); rank 0 pushes them to the engines."""
        import time

        from clawrl.weight_sync import make_sender

        start = time.perf_counter()
        sender = make_sender(**transport) if self.actor.rank == 0 else None
        if sender is not None:
            sender.begin(version)
        num_bytes = 0
        for bucket in self.actor.weight_buckets(self.actor.engine_dtype):
            if sender is not None:
                sender.send(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if sender is not None:
            sender.finish()
            sender.close()
        return {
            "perf/update_weights_bytes": float(num_bytes),
            "perf/update_weights_time": time.perf_counter() - start,
        }


class TrainGroup:
    """Driver-side handle: N TrainWorker actors placed per the plan."""

    def __init__(self, job: JobConfig, plan: PlacementPlan, group, *, num_threads: int | None = None):
        from clawrl.trainer.distributed import free_port

        world = plan.num_trainer_ranks
        device = "cpu" if plan.mode == "cpu" else "cuda"
        addr, port = ray.util.get_node_ip_address() if plan.mode != "cpu" else "127.0.0.1", free_port()
        self.workers = [
            TrainWorker.options(**actor_options(group, slot, plan.trainer_gpu_fraction)).remote(
                job.to_dict(), rank, world, addr, port, device, num_threads
            )
            for rank, slot in enumerate(plan.trainer_slots)
        ]

    def call(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs) -> list[Any]:
        """Run `TrainActor.method` on every rank; returns the per-rank results."""
        return _wait([w.call.remote(method, *args, **kwargs) for w in self.workers], method, timeout_s)

    def init(self, total_optimizer_steps: int) -> int:
        starts = self.call("init", total_optimizer_steps)
        if len(set(starts)) != 1:
            raise RuntimeError(f"trainer ranks disagree on the rollout to resume from: {starts}")
        return starts[0]

    def train(self, batch: TrainBatch) -> dict[str, Any]:
        ref = ray.put(batch)  # one copy in the object store, read by every rank
        return self.call("train", ref)[0]

    def update_weights(self, transport: dict, version: str, timeout_s: float = 600.0) -> dict[str, float]:
        refs = [w.update_weights.remote(transport, version) for w in self.workers]
        return _wait(refs, "update_weights", timeout_s)[0]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def _wait(refs: list, what: str, timeout_s: float) -> list[Any]:
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        ranks = [refs.index(r) for r in pending]
        raise TimeoutError(f"trainer rank(s) {ranks} did not finish {what} within {timeout_s:.0f} s")
    return ray.get(refs)
