"""The trainer as a group of Ray actors, one per data-parallel rank, driven in lock step.

Every method of the group calls the same method on every rank and waits for all of them (the ranks run
collectives together), with a deadline: a rank that hangs or dies fails the call with its rank named.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef

from clawrl.cluster.deadline import ActorFailure, ActorInfo, DeadlineError, wait_all
from clawrl.cluster.placement import PlacementPlan
from clawrl.cluster.ray_cluster import Reservation, actor_options
from clawrl.cluster.startup import InFlight
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

    def onload_if_room(self, headroom_fraction: float) -> bool:
        return self.actor.onload_if_room(headroom_fraction)

    def offload_after_step(self) -> bool:
        return self.actor.offload_after_step()

    def offload(self, keep_weights: bool = False) -> int:
        return self.actor.offload(keep_weights=keep_weights)

    def checksums(self) -> dict[str, str]:
        """sha256 per tensor in the dtype the engines run in (what they compute on their side)."""
        return self.actor.checksums(self.actor.engine_dtype)

    def shutdown(self) -> None:
        if self.actor is not None:  # None: the run ended before this rank was set up
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
    """Driver-side handle: N TrainWorker actors placed per the plan.

    Start-up runs in three steps so the driver can start other parts meanwhile: the constructor creates the
    actors (their processes start), `begin` sends each rank its set-up (process group, TrainActor) and, given
    the optimizer steps, the model and optimizer build right after, and `init` waits for all of it."""

    def __init__(self, job: JobConfig, plan: PlacementPlan, group: Reservation | None, *,
                 num_threads: int | None = None) -> None:  # fmt: skip
        self.began = time.monotonic()
        self.workers = [
            TrainWorker.options(**actor_options(group, slot, plan.trainer_gpu_fraction)).remote(rank)
            for rank, slot in enumerate(plan.trainer_slots)
        ]
        self.job, self.num_threads = job, num_threads
        self.device = "cpu" if plan.mode == "cpu" else "cuda"
        self.owners = [f"trainer rank {rank}" for rank in range(len(self.workers))]
        self.infos: list[ActorInfo] = []
        self._where = [w.where.remote() for w in self.workers]
        self._setup: InFlight | None = None
        self._init: InFlight | None = None

    def begin(self, total_optimizer_steps: int | None = None) -> None:
        """Wait until every rank's process answers, then send the set-up (returns without waiting for it);
        with `total_optimizer_steps`, also the model and optimizer build (else `begin_init` later). The
        set-up allocates nothing on a GPU (imports, the TrainActor object), so it may run beside engines that
        are sizing their KV cache on the same GPU; the build may not."""
        wheres = self._wait(self._where, "start", START_TIMEOUT_S, started=self.began)
        self.infos = [ActorInfo(o, pid, node) for o, (pid, node) in zip(self.owners, wheres, strict=True)]
        # rank 0's node, not the driver's: in a cluster the trainer may run on another host
        one_node = len({node for _, node in wheres}) == 1
        addr, port = wait_all([self.workers[0].rendezvous.remote(one_node)], "trainer start",
                              START_TIMEOUT_S, self.infos, self.owners[:1])[0]  # fmt: skip
        config, world = self.job.to_dict(), len(self.workers)
        refs = [w.setup.remote(config, rank, world, addr, port, self.device, self.num_threads)
                for rank, w in enumerate(self.workers)]  # fmt: skip
        self._setup = InFlight.of(refs, "trainer start", self.owners, timeout_s=self.job.fault.train_timeout)
        if total_optimizer_steps is not None:
            self.begin_init(total_optimizer_steps)

    def begin_init(self, total_optimizer_steps: int) -> None:
        """Send the model, optimizer and checkpoint load to every rank (queued behind the set-up)."""
        assert self._setup is not None and self._init is None, "begin() first, begin_init() once"
        refs = [w.init.remote(total_optimizer_steps) for w in self.workers]
        self._init = InFlight.of(refs, "trainer init", self.owners, timeout_s=self.job.fault.train_timeout,
                                 after=self._setup)  # fmt: skip

    def check(self) -> None:
        """Raise now if a rank's set-up or init failed or ran past --train-timeout (the driver calls this
        while it waits for the engines); return otherwise."""
        with self._resume_hint():
            (self._init or self._setup).check(self.infos)

    @property
    def init_begun(self) -> bool:
        """Whether the model and optimizer build was sent (by `begin` or `begin_init`)."""
        return self._init is not None

    @property
    def ready_at(self) -> float | None:
        """time.monotonic() when the last rank finished `init` (None until then)."""
        return self._init.ready_at if self._init is not None else None

    def _on_every_rank(self, method: Callable[[Any], ObjectRef], what: str,
                       timeout_s: float | None = None) -> list[Any]:  # fmt: skip
        """`method(worker)` starts one rank's call (e.g. `lambda w: w.save.remote(k, extra)`); every rank's
        result, within `timeout_s` (default --train-timeout)."""
        timeout_s = self.job.fault.train_timeout if timeout_s is None else timeout_s
        return self._wait([method(w) for w in self.workers], what, timeout_s)

    def init(self, total_optimizer_steps: int) -> int:
        """Wait for the set-up and the model and optimizer build (sent now if `begin` did not), with --load
        loaded; the rollout id to start from."""
        if self._init is None:
            self.begin_init(total_optimizer_steps)
        with self._resume_hint():
            starts = self._init.result(self.infos)
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

    def start_onload_if_room(self, headroom_fraction: float) -> list[ObjectRef]:
        """Every rank onloads now if its GPU has room beside the engines (TrainActor.onload_if_room), without
        waiting: `finish_onload` the returned refs before training."""
        return [w.onload_if_room.remote(headroom_fraction) for w in self.workers]

    def finish_onload(self, started: list[ObjectRef] | None) -> bool:
        """Wait for `start_onload_if_room`'s calls (None: none were started), then onload the ranks that had
        no room then. Returns whether every rank was onloaded early."""
        early = started is not None and all(self._wait(started, "onload", self.job.fault.train_timeout))
        if not early:
            self.onload()  # a no-op on the ranks already onloaded
        return early

    def offload_after_step(self) -> bool:
        """After a step that every rank onloaded for early (colocated): each keeps its state on the GPU if it
        still fits beside the engines (TrainActor.offload_after_step), else offloads all but the weights.
        Returns whether every rank kept it; if one did not, all offload all but the weights, so the ranks
        stay alike (the next sync then offloads the weights everywhere)."""
        if all(self._on_every_rank(lambda w: w.offload_after_step.remote(), "offload_after_step")):
            return True
        self.offload(keep_weights=True)  # a no-op on the ranks that offloaded already
        return False

    def undo_onload(self, started: list[ObjectRef]) -> None:
        """Wait for `start_onload_if_room`'s calls, then offload everything again."""
        self._wait(started, "onload", self.job.fault.train_timeout)
        self.offload()

    def offload(self, *, keep_weights: bool = False) -> None:
        """Weights and optimizer state to host memory (colocated runs, so the engines get the GPU);
        keep_weights: all but the weights, which a weight sync reads next (then `offload()` again)."""
        self._on_every_rank(lambda w: w.offload.remote(keep_weights), "offload")

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

    def _wait(self, refs: list, what: str, timeout_s: float, peers: list[ActorInfo] = (),
              started: float | None = None) -> list[Any]:  # fmt: skip
        """All ranks' results; a rank that hangs or dies fails the call naming it (stacks of the ranks and
        of `peers` printed) and the last complete checkpoint to resume from."""
        with self._resume_hint():
            return wait_all(refs, f"trainer {what}", timeout_s, [*self.infos, *peers], self.owners,
                            started=started)  # fmt: skip

    @contextlib.contextmanager
    def _resume_hint(self):
        try:
            yield
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
