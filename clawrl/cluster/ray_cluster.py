"""Start Ray on this machine or join a cluster, and reserve the job's GPU slots as a placement group.

Every wait has a deadline (ARCHITECTURE decision 10): a placement group that cannot be scheduled becomes an
error naming what was asked and what the cluster has, not an endless "pending".
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from clawrl.cluster.placement import PlacementError, PlacementPlan

PLACEMENT_TIMEOUT_S = 120.0


def start_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Join `address` (--ray-address), or start a local Ray instance sized to this machine."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local single-user runs: no token dance
    runtime_env = {"env_vars": forwarded_env()}
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    else:
        # address="local": always a new instance of our own, never a cluster another job left running here
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=True, runtime_env=runtime_env)  # fmt: skip


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


def reserve(plan: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S) -> PlacementGroup | None:
    """A PACK placement group of one {GPU: 1, CPU: 1} bundle per GPU slot (None in cpu mode)."""
    if plan.mode == "cpu":
        return None
    group = placement_group([{"GPU": 1, "CPU": 1}] * plan.num_gpus, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise PlacementError(
            f"could not reserve {plan.num_gpus} GPU bundles (1 GPU + 1 CPU each) within {timeout_s:.0f} s; "
            f"the cluster has {ray.cluster_resources()}"
        )
    return group


def actor_options(group: PlacementGroup | None, slot: int, gpu_fraction: float) -> dict:
    """Ray `.options(...)` placing an actor in one bundle of the group (or anywhere, CPU-only)."""
    if group is None:
        return {"num_cpus": 0}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": 0,
        "num_gpus": gpu_fraction,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=slot
        ),
    }
