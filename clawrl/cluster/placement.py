"""Where trainer ranks and engines run: a pure plan from the flags and the cluster's GPU count.

Modes (as slime lays out GPUs):
- cpu:      no GPU in the cluster. Trainer ranks = --actor-num-nodes x --actor-num-gpus-per-node processes,
            engines = --rollout-num-gpus / --rollout-num-gpus-per-engine processes, all on CPU. Slots are
            numbered as in split mode (trainer first, then engines); they only matter on a cluster of several
            nodes, where each slot becomes a one-CPU bundle (clawrl/cluster/ray_cluster.py).
- colocate: trainer and engines share the same GPUs, taking turns (--colocate): max(actor, rollout) GPUs.
- split:    trainer GPUs first, then the engines' GPUs: actor + rollout GPUs.

`plan_placement` checks the plan fits before anything starts, so an impossible request fails in a second
with one message instead of a Ray actor waiting forever for a GPU that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.resources import ResourcesConfig


class PlacementError(ValueError):
    """A placement the cluster cannot satisfy; the message names the flags and the numbers."""


@dataclass(kw_only=True)
class PlacementPlan:
    """Which GPU slot (bundle) each trainer rank and each engine uses."""

    mode: str
    """"cpu", "colocate" or "split"."""
    num_gpus: int
    """GPU bundles to reserve (0 in cpu mode)."""
    trainer_slots: list[int]
    """Slot of each trainer rank: its GPU bundle (cpu mode: a one-CPU bundle on a multi-node cluster)."""
    engine_slots: list[int]
    """First slot of each engine (cpu mode: as for the trainer); engine i holds slots engine_slots[i] ..
    engine_slots[i] + engine_tp_size - 1 (its tensor-parallel ranks, one GPU each)."""
    engine_tp_size: int = 1
    """GPUs (slots) per engine: --rollout-num-gpus-per-engine."""

    @property
    def num_trainer_ranks(self) -> int:
        return len(self.trainer_slots)

    @property
    def num_engines(self) -> int:
        return len(self.engine_slots)

    @property
    def num_slots(self) -> int:
        """Distinct slots of the plan: GPU bundles, or in cpu mode one per process."""
        engine = {first + r for first in self.engine_slots for r in range(self.engine_tp_size)}
        return len(set(self.trainer_slots) | engine)

    @property
    def trainer_gpu_fraction(self) -> float:
        """GPU share a trainer actor asks Ray for: a fraction when it shares its GPU with an engine."""
        return 0.0 if self.mode == "cpu" else (0.5 if self.mode == "colocate" else 1.0)

    @property
    def engine_gpu_fraction(self) -> float:
        return 0.0 if self.mode == "cpu" else (0.4 if self.mode == "colocate" else 1.0)

    @property
    def weight_transport(self) -> str:
        """How weights reach the engines (a clawrl.weight_sync transport): "broadcast" over NCCL when the
        engines have GPUs of their own (split), else "colocated" (shared GPU: CUDA IPC; cpu: shared memory)."""
        return "broadcast" if self.mode == "split" else "colocated"


def plan_placement(
    res: ResourcesConfig, *, cluster_gpus: int, trainer: bool = True, engines: bool = True
) -> PlacementPlan:
    """Plan the job's processes; raises PlacementError when the cluster cannot hold them.

    `trainer=False` (--debug-rollout-only) places engines only, `engines=False` (--debug-train-only) the
    trainer only; either way nothing is colocated."""
    if not engines:
        return _trainer_only(res, cluster_gpus)
    actor = res.actor_num_gpus if trainer else 0
    rollout = actor if res.rollout_num_gpus is None and res.colocate else (res.rollout_num_gpus or 0)
    if res.rollout_num_gpus is None and not res.colocate:
        # Only a job built in Python gets here unresolved: `clawrl train` fills the count from the machine.
        raise PlacementError("--rollout-num-gpus is unset: pass it (engines' GPUs), or --colocate")
    if rollout < 1:
        raise PlacementError(
            f"--rollout-num-gpus {rollout}: at least one engine is needed to generate rollouts"
        )
    tp = res.rollout_num_gpus_per_engine
    if rollout % tp:
        raise PlacementError(
            f"--rollout-num-gpus-per-engine {tp} must divide the engines' GPUs ({rollout}, --rollout-num-gpus "
            "or the trainer's with --colocate)"
        )
    if cluster_gpus == 0:
        return PlacementPlan(
            mode="cpu",
            num_gpus=0,
            trainer_slots=list(range(actor)),
            engine_slots=list(range(actor, actor + rollout, tp)),
            engine_tp_size=tp,
        )
    if res.colocate:
        needed = max(actor, rollout)
        _check_fits(
            needed, cluster_gpus, f"max(trainer {actor}, --rollout-num-gpus {rollout}) with --colocate"
        )
        return PlacementPlan(
            mode="colocate",
            num_gpus=needed,
            trainer_slots=list(range(actor)),
            engine_slots=list(range(0, rollout, tp)),
            engine_tp_size=tp,
        )
    needed = actor + rollout
    _check_fits(needed, cluster_gpus, f"trainer {actor} + --rollout-num-gpus {rollout}")
    return PlacementPlan(
        mode="split",
        num_gpus=needed,
        trainer_slots=list(range(actor)),
        engine_slots=list(range(actor, actor + rollout, tp)),
        engine_tp_size=tp,
    )


def _trainer_only(res: ResourcesConfig, cluster_gpus: int) -> PlacementPlan:
    actor = res.actor_num_gpus
    if cluster_gpus == 0:
        return PlacementPlan(mode="cpu", num_gpus=0, trainer_slots=list(range(actor)), engine_slots=[])
    _check_fits(actor, cluster_gpus, "trainer only (--debug-train-only)")
    return PlacementPlan(mode="split", num_gpus=actor, trainer_slots=list(range(actor)), engine_slots=[])


def _check_fits(needed: int, available: int, how: str) -> None:
    if needed > available:
        raise PlacementError(
            f"the job needs {needed} GPUs ({how}; trainer = --actor-num-nodes x --actor-num-gpus-per-node) "
            f"but the Ray cluster has {available}"
        )
