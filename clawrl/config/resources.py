"""Resource flags: trainer and engine GPUs, colocation and offload, the Ray cluster; and their machine defaults.

`--offload-train` / `--offload-rollout` stay None unless given, so `validate` can apply slime's rules:
`--offload` turns both on, `--colocate` turns on whichever was not explicitly disabled, the rest become False.

`--actor-num-gpus-per-node` and `--rollout-num-gpus` stay None unless given; `resolve_resource_defaults` fills
them from the machine (or the joined Ray cluster) before validation, and returns the one line saying what it
chose:

    note = resolve_resource_defaults(job.resources, num_gpus=0)
    # "no GPU found: 1 trainer process and 1 engine on CPU (set --actor-num-gpus-per-node / ...)"
"""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import ConfigError, at_least
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class ResourcesConfig:
    """GPUs and placement."""

    actor_num_nodes: int = 1
    """Nodes for the trainer."""
    actor_num_gpus_per_node: int | None = None
    """Trainer GPUs per node; default: every visible GPU, shared with the engines (no GPU: 1 trainer process)."""
    rollout_num_gpus: int | None = None
    """GPUs for the inference engines; default: the trainer's GPUs, shared (no GPU: 1 engine); 0: no local engines."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per inference engine (its tensor-parallel size); must divide --rollout-num-gpus."""
    colocate: bool = False
    """Engines and trainer share GPUs, taking turns; turns on both offloads unless disabled with --no-offload-*."""
    offload: bool = False
    """Shorthand for --offload-train --offload-rollout."""
    offload_train: bool | None = None
    """Move the trainer's weights and optimizer state off the GPU while the engines generate."""
    offload_rollout: bool | None = None
    """Release the engines' GPU memory (weights, KV cache) while the trainer trains."""
    disable_onload_during_rollout: bool = False
    """With --colocate --offload-train: bring the trainer's state back only after the engines released their memory, not while a rollout generates, and offload it after every step (by default, when the GPU has room for the state beside the engines, 5% of it kept free, the state comes back during the rollout and then stays while it fits)."""
    ray_address: str | None = option(metavar="ADDRESS")
    """Ray cluster to join; unset: start Ray on this machine."""
    multi_node: bool | None = None
    """The job may span hosts: engines listen on their node's address, not 127.0.0.1; default: on with --ray-address."""
    rollout_external_engine_addrs: list[str] | None = option(metavar="HOST:PORT")
    """Generate with already-running SGLang servers or clawrl engines (HOST:PORT, space- or comma-separated); none started."""

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, "actor_num_nodes", 1)
        at_least(self, "actor_num_gpus_per_node", 1)
        at_least(self, "rollout_num_gpus", 0)
        at_least(self, "rollout_num_gpus_per_engine", 1)
        if self.rollout_external_engine_addrs is not None:
            self.rollout_external_engine_addrs = parse_engine_addrs(self.rollout_external_engine_addrs)

    @property
    def actor_num_gpus(self) -> int:
        """Trainer GPUs in total (after resolve_resource_defaults)."""
        assert self.actor_num_gpus_per_node is not None, "resolve_resource_defaults() was not called"
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def needs_defaults(self) -> bool:
        """Whether a GPU count is unset, so resolve_resource_defaults needs the machine's GPU count."""
        return self.actor_num_gpus_per_node is None or (self.rollout_num_gpus is None and not self.colocate)


_FLAGS = "--actor-num-gpus-per-node / --rollout-num-gpus"


def parse_engine_addrs(values: list[str]) -> list[str]:
    """--rollout-external-engine-addrs as a list of HOST:PORT (an http:// prefix is dropped); ConfigError
    naming the flag and the bad entry."""
    addrs = [a.strip().removeprefix("http://").rstrip("/") for v in values for a in str(v).split(",")]
    addrs = [a for a in addrs if a]
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--rollout-external-engine-addrs: {addr!r} is not HOST:PORT (e.g. 10.0.0.5:30000)"
            )
    if not addrs or len(set(addrs)) != len(addrs):
        raise ConfigError(
            f"--rollout-external-engine-addrs: give distinct HOST:PORT addresses, got {values!r}"
        )
    return addrs


def resolve_resource_defaults(
    res: ResourcesConfig, num_gpus: int, *, can_colocate: bool = True
) -> str | None:
    """Fill the GPU counts left unset, in place, from `num_gpus` (the machine's or the Ray cluster's).

    No GPU: 1 trainer process and 1 engine (with --colocate: as many engines as trainer processes). GPUs, no
    count given: every GPU, colocated (`can_colocate=False`, train-async: half the GPUs train, half generate).
    One count given: the other takes the GPUs left. Returns the line saying what was chosen, or None when
    every count was given. Explicit flags are never changed."""
    if res.rollout_external_engine_addrs and res.rollout_num_gpus is None and not res.colocate:
        res.rollout_num_gpus = 0  # the engines run elsewhere: every local GPU (or the CPU) trains
    if not res.needs_defaults:
        return None
    if num_gpus == 0:
        return _cpu_defaults(res)
    if res.actor_num_gpus_per_node is None and res.rollout_num_gpus is None and not res.colocate:
        return _all_gpus(res, num_gpus, can_colocate)
    if res.actor_num_gpus_per_node is None:
        taken = 0 if res.colocate else res.rollout_num_gpus
        res.actor_num_gpus_per_node = (num_gpus - taken) // res.actor_num_nodes
        if res.actor_num_gpus_per_node < 1:
            raise ConfigError(
                f"--rollout-num-gpus {taken} leaves no GPU for the trainer on {_machine(res, num_gpus)}: "
                "pass --actor-num-gpus-per-node, or --colocate to share the GPUs"
            )
        return _note(res, num_gpus, "--actor-num-gpus-per-node")
    res.rollout_num_gpus = num_gpus - res.actor_num_gpus
    if res.rollout_num_gpus < 1:
        raise ConfigError(
            f"--actor-num-nodes {res.actor_num_nodes} x --actor-num-gpus-per-node {res.actor_num_gpus_per_node} "
            f"takes every GPU of {_machine(res, num_gpus)}, none is left for the engines: pass --colocate to "
            "share them, or --rollout-num-gpus"
        )
    return _note(res, num_gpus, "--rollout-num-gpus")


def _cpu_defaults(res: ResourcesConfig) -> str:
    if res.actor_num_gpus_per_node is None:
        res.actor_num_gpus_per_node = 1
    if res.rollout_num_gpus is None and not res.colocate:
        res.rollout_num_gpus = 1
    trainers = res.actor_num_gpus
    engines = trainers if res.rollout_num_gpus is None else res.rollout_num_gpus
    return (
        f"no GPU found: {_count(trainers, 'trainer process', 'es')} and {_count(engines, 'engine')} on CPU "
        f"(set {_FLAGS} to change)"
    )


def _all_gpus(res: ResourcesConfig, num_gpus: int, can_colocate: bool) -> str:
    if can_colocate:
        res.colocate = True
        res.actor_num_gpus_per_node = num_gpus // res.actor_num_nodes
        if res.actor_num_gpus_per_node < 1:
            raise ConfigError(
                f"--actor-num-nodes {res.actor_num_nodes}: {_machine(res, num_gpus)} has fewer GPUs"
            )
        res.rollout_num_gpus = res.actor_num_gpus
        return (
            f"{_count(num_gpus, 'GPU')} found: {_count(res.actor_num_gpus, 'trainer rank')} and "
            f"{_count(res.rollout_num_gpus, 'engine')} colocated on them, taking turns "
            f"(set {_FLAGS} / --colocate to change)"
        )
    res.actor_num_gpus_per_node = num_gpus // 2 // res.actor_num_nodes
    if res.actor_num_gpus_per_node < 1:
        raise ConfigError(
            f"{_machine(res, num_gpus)} cannot hold separate trainer and engine GPUs (clawrl train-async "
            f"needs them): pass {_FLAGS}"
        )
    return _note(res, num_gpus, f"{_FLAGS}", rollout=num_gpus - res.actor_num_gpus)


def _note(res: ResourcesConfig, num_gpus: int, flags: str, rollout: int | None = None) -> str:
    if rollout is not None:
        res.rollout_num_gpus = rollout
    engines = res.actor_num_gpus if res.rollout_num_gpus is None else res.rollout_num_gpus
    how = "colocated on the same GPUs" if res.colocate else "each on its own GPU"
    return (
        f"{_count(num_gpus, 'GPU')} found: {_count(res.actor_num_gpus, 'trainer rank')} and "
        f"{_count(engines, 'engine')}, {how} (set {flags} to change)"
    )


def _machine(res: ResourcesConfig, num_gpus: int) -> str:
    where = "the Ray cluster" if res.ray_address else "this machine"
    return f"{where} ({_count(num_gpus, 'GPU')})"


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{plural}"
