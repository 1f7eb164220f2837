"""The trainer as a group of Ray actors, one per data-parallel rank, driven in lock step.

Every method of the group calls the same method on every rank and waits for all of them (the ranks run
collectives together), with a deadline: a rank that hangs or dies fails the call with its rank named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef

from clawrl.cluster.deadline import ActorFailure, ActorInfo, DeadlineError, wait_all
from clawrl.cluster.placement import PlacementPlan
from clawrl.cluster.ray_cluster import Reservation, actor_options
from clawrl.config.job import JobConfig
from clawrl.data.train_batch import TrainBatch
from clawrl.stall_points import stall_point
from clawrl.weight_sync.cycle import Transport

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

    # One method per TrainActor call the driver makes, so every call site names what it runs.
    def init(self, total_optimizer_steps: int) -> int:
        stall_point("trainer.init")
        return self.actor.init(total_optimizer_steps)

    def loaded_extra(self) -> dict[str, Any]:
        return self.actor.loaded_extra()

    def train(self, batch: TrainBatch) -> dict[str, Any]:
        stall_point("trainer.train")
        return self.actor.train(batch)

    def save(self, rollout_id: int, extra: dict[str, Any]) -> str:
        stall_point("trainer.save")
        return self.actor.save(rollout_id, extra)

    def export_hf(self, out_dir: str, dtype: str | None = None) -> str:
        import torch

        return self.actor.export_hf(out_dir, dtype=getattr(torch, dtype) if dtype else None)

    def onload(self) -> None:
        self.actor.onload()

    def offload(self) -> int:
        return self.actor.offload()

    def checksums(self) -> dict[str, str]:
        """sha256 per tensor in the dtype the engines run in (what they compute on their side)."""
        return self.actor.checksums(self.actor.engine_dtype)

    def shutdown(self) -> None:
        self.actor.shutdown()

    def update_weights(self, transport: Transport, version: str, verify: bool = False) -> dict[str, float]:
        """One weight sync (clawrl.weight_sync.cycle): every rank gathers, rank 0 sends; `verify` compares
        checksums afterwards (--check-weight-update-equal)."""
        from clawrl.weight_sync.cycle import push_weights

        stall_point("trainer.update_weights")
        dtype = self.actor.engine_dtype
        return push_weights(
            transport if self.actor.rank == 0 else None,
            self.actor.weight_buckets(dtype),
            version,
            checksums=(lambda: self.actor.checksums(dtype)) if verify else None,
        )


class TrainGroup:
    """Driver-side handle: N TrainWorker actors placed per the plan."""

    def __init__(self, job: JobConfig, plan: PlacementPlan, group: Reservation | None, *,
                 num_threads: int | None = None) -> None:  # fmt: skip
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

    def _on_every_rank(self, method: Callable[[Any], ObjectRef], what: str,
                       timeout_s: float | None = None) -> list[Any]:  # fmt: skip
        """`method(worker)` starts one rank's call (e.g. `lambda w: w.save.remote(k, extra)`); every rank's
        result, within `timeout_s` (default --train-timeout)."""
        timeout_s = self.job.fault.train_timeout if timeout_s is None else timeout_s
        return self._wait([method(w) for w in self.workers], what, timeout_s)

    def init(self, total_optimizer_steps: int) -> int:
        """Build model and optimizer, load --load if given; the rollout id to start from."""
        starts = self._on_every_rank(lambda w: w.init.remote(total_optimizer_steps), "init")
        if len(set(starts)) != 1:
            raise RuntimeError(f"trainer ranks disagree on the rollout to resume from: {starts}")
        return starts[0]

    def loaded_extra(self) -> dict[str, Any]:
        """The extra state of the checkpoint `init` resumed from (rank 0's; every rank read the same)."""
        return self._on_every_rank(lambda w: w.loaded_extra.remote(), "loaded_extra")[0]

    def train(self, batch: TrainBatch) -> dict[str, Any]:
        """Rank 0's metrics; with --save-debug-train-data, every rank's per-sample records under
        TRAIN_RECORDS_KEY, in rollout order."""
        from clawrl.trainer.train_dump import TRAIN_RECORDS_KEY

        ref = ray.put(batch)  # one copy in the object store, read by every rank
        results = self._on_every_rank(lambda w: w.train.remote(ref), "train")
        records = [r for result in results for r in result.pop(TRAIN_RECORDS_KEY, [])]
        if records:
            results[0][TRAIN_RECORDS_KEY] = sorted(records, key=lambda r: r["rollout_position"])
        return results[0]

    def save(self, rollout_id: int, extra: dict[str, Any]) -> str:
        """Checkpoint to --save (`extra`: plain types written to meta.json); the checkpoint directory."""
        return self._on_every_rank(lambda w: w.save.remote(rollout_id, extra), "save")[0]

    def export_hf(self, out_dir: str, dtype: str | None = None) -> str:
        """The current weights as a HF model directory (written by rank 0), in `dtype` (a torch dtype name;
        default: --hf-checkpoint's)."""
        return self._on_every_rank(lambda w: w.export_hf.remote(out_dir, dtype), "export_hf")[0]

    def onload(self) -> None:
        """Weights and optimizer state back on the GPU (colocated runs, before a train step)."""
        self._on_every_rank(lambda w: w.onload.remote(), "onload")

    def offload(self) -> None:
        """Weights and optimizer state to host memory (colocated runs, so the engines get the GPU)."""
        self._on_every_rank(lambda w: w.offload.remote(), "offload")

    def checksums(self) -> dict[str, str]:
        """sha256 per HF tensor name of the weights, in the engines' dtype (for --check-weight-update-equal)."""
        return self._on_every_rank(lambda w: w.checksums.remote(), "checksums")[0]

    def update_weights(self, transport: Transport, version: str, timeout_s: float = 600.0,
                       engines: list[ActorInfo] | None = None, *, verify: bool = False) -> dict[str, float]:  # fmt: skip
        """Push the weights to the engines of `transport` (and with `verify` check their checksums); on the
        deadline the stacks of `engines` are printed too (a stuck receiver is as likely as a stuck sender)."""
        refs = [w.update_weights.remote(transport, version, verify) for w in self.workers]
        return self._wait(refs, "update_weights", timeout_s, engines or [])[0]

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Leave the process group on every rank (within the deadline), then end the actors."""
        try:
            refs = [w.shutdown.remote() for w in self.workers]
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
