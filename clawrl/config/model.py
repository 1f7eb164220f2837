"""Model and checkpoint flags: the initial policy, the reference model, resume and save."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clawrl.config.errors import ConfigError, at_least
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class ModelConfig:
    """Model weights, reference model and checkpoints."""

    hf_checkpoint: str | None = option(metavar="DIR")
    """HF model directory (config, safetensors, tokenizer) of the initial policy, for trainer and engines."""
    ref_load: str | None = option(metavar="DIR")
    """Reference model for the KL terms; default: --hf-checkpoint (the reference model is the initial policy)."""
    load: str | None = option(metavar="DIR")
    """Resume from the latest checkpoint in DIR, else start from --hf-checkpoint (so --load may equal --save)."""
    save: str | None = option(metavar="DIR")
    """Directory to write training checkpoints to."""
    save_hf: str | None = option(metavar="TEMPLATE")
    """At every save, also write an HF model dir (source dtype) to TEMPLATE.format(rollout_id=N); no --save needed."""
    save_interval: int | None = None
    """Save (--save, --save-hf) every N rollouts, and after the last one; default: after the last one only."""
    model_impl: Literal["native", "hf"] = "native"
    """Model code of trainer and engines: native (clawrl/models) or hf (transformers: any decoder, slower)."""
    true_on_policy_mode: bool = False
    """Engines and trainer run the same batch-invariant kernels: trainer log-probs equal the rollout's bit for bit."""
    true_on_policy: bool = False
    """Same as --true-on-policy-mode."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass to save memory."""
    update_weight_buffer_size: int = option(512 * 1024**2, metavar="BYTES")
    """Bucket size in bytes for sending weights from the trainer to the engines."""
    update_weight_transport: Literal["distributed", "disk"] | None = None
    """distributed: broadcast group; disk: HF dir + /update_weights_from_disk; default: by placement (external: distributed)."""
    update_weight_disk_dir: str | None = option(metavar="DIR")
    """With --update-weight-transport disk: where the trainer writes weight_v{N:06d}/ (a dir the engines can read)."""
    update_weight_disk_keep_files: bool = False
    """With --update-weight-transport disk: keep each weight_v{N:06d}/ after the engines loaded it."""

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, "save_interval", 1)
        at_least(self, "update_weight_buffer_size", 1)
        if self.save_hf is not None:
            save_hf_path(self.save_hf, 0)  # a template with other fields fails now, not at the first save

    @property
    def uses_true_on_policy(self) -> bool:
        """--true-on-policy-mode or its alias --true-on-policy."""
        return self.true_on_policy_mode or self.true_on_policy


def save_hf_path(template: str, rollout_id: int) -> str:
    """The --save-hf directory of rollout `rollout_id`; a template naming other fields is a ConfigError."""
    try:
        return template.format(rollout_id=rollout_id)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"--save-hf {template!r}: the only field a template may use is {{rollout_id}} ({e!r})"
        ) from None
