"""Model and checkpoint flags: the initial policy, the reference model, resume and save."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clawrl.config.errors import at_least
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
    save_interval: int | None = None
    """Save a checkpoint every N rollouts; requires --save."""
    model_impl: Literal["native", "hf"] = "native"
    """Trainer model code: native (clawrl/models, packed sequences) or hf (transformers AutoModelForCausalLM)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass to save memory."""
    update_weight_buffer_size: int = option(512 * 1024**2, metavar="BYTES")
    """Bucket size in bytes for sending weights from the trainer to the engines."""

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, "save_interval", 1)
        at_least(self, "update_weight_buffer_size", 1)
