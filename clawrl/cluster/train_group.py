"""The trainer as a group of Ray actors, one per data-parallel rank, driven in lock step.

Every method of the group calls the same method on every rank and waits for all of them (the ranks run
collectives together), with a deadline: a rank that hangs or dies fails the call with its rank named.
"""

from __future__ import annotations

from typing import Any

import ray

from clawrl.cluster.deadline import ActorFailure, ActorInfo, DeadlineError, wait_all
from clawrl.cluster.placement import PlacementPlan
from clawrl.cluster.ray_cluster import actor_options
from clawrl.config.job import JobConfig
from clawrl.data.train_batch import TrainBatch
from clawrl.stall_points import POINTS, stall_point

START_TIMEOUT_S = 600.0


@ray.remote
class TrainWorker:
    """One trainer rank: a TrainActor plus the weight-sync step (rank 0 sends, every rank gathers)."""

    def __init__(self, rank: int) -> None:
        from clawrl.cluster.deadline import enable_stack_dumps

        self._where = enable_stack_dumps(f"trainer rank {rank}")
        self.actor = None

    def setup(self, job_dict: dict, rank: int, world_size: int, master_addr: str, master_port: int,
              device: str, num_threads: int | None) -> None:  # fmt: skip
        """Build the TrainActor (process group, model). Kept out of __init__ so `where()` answers first and
        a rank stuck here can still be asked for its stacks."""
        import torch

        from clawrl.trainer.actor import TrainActor

        stall_point("trainer.start")
        if num_threads:
            torch.set_num_threads(num_threads)
        job = JobConfig.from_dict(job_dict)
        self.actor = TrainActor(
            job, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
            device=device,
        )  # fmt: skip

    def where(self) -> tuple[int, str]:
        """(pid, node ip) of this rank's process, for stack dumps."""
        return self._where

    def rendezvous(self, loopback: bool) -> tuple[str, int]:
        """Asked of rank 0, which hosts the process group's store: its address as the other ranks reach it
        (loopback when they all share its node) and a port free on its node."""
        from clawrl.trainer.distributed import free_port

        addr = "127.0.0.1" if loopback else self._where[1]
        return addr, free_port(addr)

    def call(self, method: str, *args, **kwargs) -> Any:
        if f"trainer.{method}" in POINTS:
            stall_point(f"trainer.{method}")
        return getattr(self.actor, method)(*args, **kwargs)

    def update_weights(self, transport: dict, version: str) -> dict[str, float]:
        """Gather the weights bucket by bucket (collective); rank 0 pushes them to the engines."""
        import time

        from clawrl.weight_sync import make_sender

        stall_point("trainer.update_weights")
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
        world = plan.num_trainer_ranks
        device = "cpu" if plan.mode == "cpu" else "cuda"
        self.workers = [
            TrainWorker.options(**actor_options(group, slot, plan.trainer_gpu_fraction)).remote(rank)
            for rank, slot in enumerate(plan.trainer_slots)
        ]
        self.job = job
        self.owners = [f"trainer rank {rank}" for rank in range(world)]
        self.infos: list[ActorInfo] = []
        try:
            wheres = self._wait([w.where.remote() for w in self.workers], "start", START_TIMEOUT_S)
            self.infos = [ActorInfo(o, pid, node) for o, (pid, node) in zip(self.owners, wheres, strict=True)]
            # rank 0's node, not the driver's: in a cluster the trainer may run on another host
            one_node = len({node for _, node in wheres}) == 1
            addr, port = wait_all([self.workers[0].rendezvous.remote(one_node)], "trainer start",
                                  START_TIMEOUT_S, self.infos, self.owners[:1])[0]  # fmt: skip
            config = job.to_dict()
            refs = [w.setup.remote(config, rank, world, addr, port, device, num_threads)
                    for rank, w in enumerate(self.workers)]  # fmt: skip
            self._wait(refs, "start", job.fault.train_timeout)
        except BaseException:  # the caller never gets a handle to close: end the ranks here
            for worker in self.workers:
                ray.kill(worker)
            raise

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """Run `TrainActor.method` on every rank (default deadline: --train-timeout); per-rank results."""
        timeout_s = self.job.fault.train_timeout if timeout_s is None else timeout_s
        return self._wait([w.call.remote(method, *args, **kwargs) for w in self.workers], method, timeout_s)

    def init(self, total_optimizer_steps: int) -> int:
        starts = self.call("init", total_optimizer_steps)
        if len(set(starts)) != 1:
            raise RuntimeError(f"trainer ranks disagree on the rollout to resume from: {starts}")
        return starts[0]

    def train(self, batch: TrainBatch) -> dict[str, Any]:
        """Rank 0's metrics; with --save-debug-train-data, every rank's per-sample records under
        TRAIN_RECORDS_KEY, in rollout order."""
        from clawrl.trainer.train_dump import TRAIN_RECORDS_KEY

        ref = ray.put(batch)  # one copy in the object store, read by every rank
        results = self.call("train", ref)
        records = [r for result in results for r in result.pop(TRAIN_RECORDS_KEY, [])]
        if records:
            results[0][TRAIN_RECORDS_KEY] = sorted(records, key=lambda r: r["rollout_position"])
        return results[0]

    def update_weights(self, transport: dict, version: str, timeout_s: float = 600.0,
                       engines: list[ActorInfo] | None = None) -> dict[str, float]:  # fmt: skip
        """Push the weights to the engines of `transport`; on the deadline the stacks of `engines` are
        printed too (a stuck receiver is as likely as a stuck sender)."""
        refs = [w.update_weights.remote(transport, version) for w in self.workers]
        return self._wait(refs, "update_weights", timeout_s, engines or [])[0]

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Leave the process group on every rank (within the deadline), then end the actors."""
        try:
            refs = [w.call.remote("shutdown") for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        finally:
            for worker in self.workers:
                ray.kill(worker)

    def _wait(self, refs: list, what: str, timeout_s: float, peers: list[ActorInfo] = ()) -> list[Any]:
        """All ranks' results; a rank that hangs or dies fails the call naming it (stacks of the ranks and
        of `peers` printed) and the last complete checkpoint to resume from."""
        try:
            return wait_all(refs, f"trainer {what}", timeout_s, [*self.infos, *peers], self.owners)
        except (DeadlineError, ActorFailure) as error:
            raise type(error)(f"{error}; {_resume_hint(self.job)}") from None


def _resume_hint(job: JobConfig) -> str:
    from clawrl.trainer.checkpoint import latest_iteration

    save = job.model.save
    if not save:
        return "no checkpoint to resume from (--save unset)"
    step = latest_iteration(save)
    if step is None:
        return f"no complete checkpoint in {save} yet"
    return (
        f"last complete checkpoint: {save} (iteration {step}, after rollout {step - 1}); "
        f"resume with --load {save}"
    )
