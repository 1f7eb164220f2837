"""Resource flags: trainer and engine GPUs, colocation and offload, the Ray cluster.

`--offload-train` / `--offload-rollout` stay None unless given, so `validate` can apply slime's rules:
`--offload` turns both on, `--colocate` turns on whichever was not explicitly disabled, the rest become False.
"""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import at_least
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class ResourcesConfig:
    """GPUs and placement."""

    actor_num_nodes: int = 1
    """Nodes for the trainer."""
    actor_num_gpus_per_node: int = 8
    """Trainer GPUs per node."""
    rollout_num_gpus: int | None = None
    """GPUs for the inference engines; with --colocate default: the trainer's GPUs (0: no local engines)."""
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
    ray_address: str | None = option(metavar="ADDRESS")
    """Ray cluster to join; unset: start Ray on this machine."""

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, "actor_num_nodes", 1)
        at_least(self, "actor_num_gpus_per_node", 1)
        at_least(self, "rollout_num_gpus", 0)
        at_least(self, "rollout_num_gpus_per_engine", 1)

    @property
    def actor_num_gpus(self) -> int:
        """Trainer GPUs in total."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node
