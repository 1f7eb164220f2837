"""Start Ray on this machine or join a cluster, and reserve the job's GPU slots as a placement group.

Every wait has a deadline: a placement group that cannot be scheduled becomes an error naming what was asked
and what the cluster has, not an endless "pending".

On a cluster of several nodes (`--ray-address`, docs/multi_node.md) the placement group is what spreads the
job: slot i of the plan runs in bundle `Reservation.bundles[i]`, ordered so that the trainer's slots (the
first ones) sit together on the node holding most of the job's bundles. Without GPUs each process gets a
one-CPU bundle there, so the nodes' `--num-cpus` decide where trainer ranks and engines land.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from clawrl.cluster.placement import PlacementError, PlacementPlan

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def start_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Join `address` (--ray-address), or start a local Ray instance sized to this machine. False when this
    process had Ray initialised already (the caller's, which is used as it is and left running), else True:
    the caller then owns the connection and shuts it down when it is done."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local single-user runs: no token dance
    runtime_env = {"env_vars": forwarded_env()}
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    else:
        # address="local": always a new instance of our own, never a cluster another job left running here.
        # No prestarted workers: Ray starts one idle worker per CPU for the first driver, but the job's actors
        # (with the runtime_env above) never use them, so they only took CPU from the actors' own start-up.
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=True, runtime_env=runtime_env,
                 _system_config={"prestart_worker_first_driver": False})  # fmt: skip
    return True


def stop_ray() -> None:
    """Flush stdout (forwarded actor lines stay before what the caller prints next), then shut Ray down if
    this process has it initialised."""
    sys.stdout.flush()
    if ray.is_initialized():
        ray.shutdown()


# Variables that describe the driver's own machine or shell, or that Ray sets per actor (CUDA_VISIBLE_DEVICES):
# forwarding them would be wrong on another node or would override Ray's GPU assignment.
_NOT_FORWARDED = {
    "PATH", "HOME", "PWD", "OLDPWD", "SHELL", "USER", "LOGNAME", "HOSTNAME", "TERM", "SHLVL", "_", "DISPLAY",
    "TMPDIR", "LANG", "LC_ALL", "MAIL", "PS1", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
}  # fmt: skip
_NOT_FORWARDED_PREFIXES = ("RAY_", "SSH_", "XDG_", "LS_", "PYTEST_", "COLUMNS", "LINES")


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's environment as every Ray actor of the job gets it (job-level runtime_env), so settings
    like CUDA_LAUNCH_BLOCKING=1, CUDA core-dump variables, NCCL_DEBUG or TORCH_* given to `clawrl train`
    reach the engines, the trainer ranks and the rollout manager, also on the nodes of a joined cluster."""
    environ = os.environ if environ is None else environ
    return {
        k: v for k, v in environ.items()
        if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)
    }  # fmt: skip


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


@dataclass(kw_only=True)
class Reservation:
    """The job's placement group and the bundle behind each slot of the plan."""

    group: PlacementGroup
    """The Ray placement group (PACK)."""
    bundles: list[int]
    """bundles[slot]: the bundle index that plan slot runs in."""
    nodes: list[str]
    """nodes[slot]: the Ray node id of that bundle."""


def alive_nodes() -> int:
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def reserve(plan: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S) -> Reservation | None:
    """A PACK placement group with one bundle per slot: {GPU: 1, CPU: 1}, or {CPU: 1} in cpu mode on a
    cluster of several nodes. None (actors go anywhere) in cpu mode on one node."""
    if plan.mode == "cpu" and (alive_nodes() < 2 or plan.num_slots == 0):
        return None
    bundle = {"CPU": 1} if plan.mode == "cpu" else {"GPU": 1, "CPU": 1}
    group = placement_group([bundle] * plan.num_slots, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        why = " (without GPUs, every trainer rank and engine takes one CPU)" if plan.mode == "cpu" else ""
        raise PlacementError(
            f"could not reserve {plan.num_slots} bundles of {bundle} within {timeout_s:.0f} s{why}; "
            f"the cluster has {ray.cluster_resources()}"
        )
    by_node = {int(i): node for i, node in placement_group_table(group)["bundles_to_node_id"].items()}
    bundles = bundle_order(by_node)
    reservation = Reservation(group=group, bundles=bundles, nodes=[by_node[b] for b in bundles])
    try:
        check_nodes(plan, reservation.nodes)
    except PlacementError:
        ray.util.remove_placement_group(group)
        raise
    if len(set(reservation.nodes)) > 1:
        logger.info("placement over %d nodes: %s", len(set(reservation.nodes)), describe(plan, reservation))
    return reservation


def bundle_order(bundle_nodes: dict[int, str]) -> list[int]:
    """Bundle indices in slot order: grouped by node, the node holding most bundles first (ties: the node of
    the lowest bundle index), ascending within a node. Ray does not promise that PACK puts consecutive
    bundles on one node; the trainer's ranks take the first slots and run collectives with each other, so
    they should share as few nodes as possible."""
    count: dict[str, int] = {}
    first: dict[str, int] = {}
    for index in sorted(bundle_nodes):
        node = bundle_nodes[index]
        count[node] = count.get(node, 0) + 1
        first.setdefault(node, index)
    rank = {node: (-count[node], first[node]) for node in count}
    return sorted(bundle_nodes, key=lambda index: (rank[bundle_nodes[index]], index))


def check_nodes(plan: PlacementPlan, slot_nodes: list[str]) -> None:
    """Refuse a --colocate job that Ray spread over several nodes: its weight sync hands CUDA IPC handles
    from trainer rank 0 to every engine, which only works between processes of one host."""
    nodes = len(set(slot_nodes))
    if plan.mode == "colocate" and nodes > 1:
        raise PlacementError(
            f"--colocate on {plan.num_slots} GPUs spans {nodes} nodes, but colocated weight updates only reach "
            "engines on trainer rank 0's node; without --colocate (split placement) the weights go to the "
            "engines by NCCL broadcast, which works across nodes"
        )


def describe(plan: PlacementPlan, reservation: Reservation) -> str:
    """One line: which node (short id) each trainer rank and engine is placed on."""
    parts = [f"trainer rank {r} -> {reservation.nodes[s][:8]}" for r, s in enumerate(plan.trainer_slots)]
    parts += [f"engine {e} -> {reservation.nodes[s][:8]}" for e, s in enumerate(plan.engine_slots)]
    return ", ".join(parts)


def actor_options(reservation: Reservation | None, slot: int, gpu_fraction: float) -> dict:
    """Ray `.options(...)` placing an actor in the bundle of its plan slot (or anywhere, CPU on one node)."""
    if reservation is None:
        return {"num_cpus": 0}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {
        "num_cpus": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=reservation.group, placement_group_bundle_index=reservation.bundles[slot]
        ),
    }
    if gpu_fraction:
        options["num_gpus"] = gpu_fraction
    return options
