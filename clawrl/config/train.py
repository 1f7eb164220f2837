"""Training flags: batch sizes, micro-batching, optimizer, learning-rate schedule, loss type.

Defaults follow slime's FSDP backend (AdamW betas 0.9/0.95, no weight decay, constant learning rate) with
slime's own overrides (lr 1e-6, clip-grad 1.0, seed 1234, micro-batch 1). LoRA (--lora-rank > 0) keeps
slime's FSDP defaults too: alpha 16, dropout 0, every linear layer of the decoder blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clawrl.config.errors import ConfigError, above, at_least, check, in_range
from clawrl.config.fields import check_types, option

NATIVE_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a native decoder block (clawrl/models/decoder.py), --target-modules' names for it."""


@dataclass(kw_only=True)
class TrainConfig:
    """Policy optimisation."""

    global_batch_size: int | None = None
    """Samples per optimizer step; default: all samples of a rollout; must divide them evenly."""
    num_steps_per_rollout: int | None = None
    """Optimizer steps per rollout: sets --global-batch-size to the rollout's samples // N."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass on each GPU; ignored with --use-dynamic-batch-size."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count, up to --max-tokens-per-gpu, instead of --micro-batch-size."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one packed micro-batch per GPU; required by --use-dynamic-batch-size."""
    lr: float = 1e-6
    """Peak learning rate."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, down to --min-lr at the last step."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear learning-rate warm-up from 0."""
    min_lr: float = 0.0
    """Learning rate at the end of linear or cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1 (first-moment decay)."""
    adam_beta2: float = 0.95
    """AdamW beta2 (second-moment decay)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    seed: int = 1234
    """Seed for the trainer's randomness."""
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    """policy_loss (RL), sft_loss (negative log-likelihood of response tokens) or custom_loss."""
    custom_loss_function_path: str | None = option(metavar="MODULE.FN")
    """Loss for --loss-type custom_loss: fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)."""
    critic_load: str | None = option(metavar="DIR")
    """ppo: initial critic, an HF model dir or a clawrl --save dir; default: --hf-checkpoint (value head zero)."""
    critic_lr: float | None = None
    """ppo: the critic's peak learning rate; default: --lr."""
    critic_lr_warmup_iters: int = 0
    """ppo: optimizer steps of linear warm-up of the critic's learning rate from 0."""
    lora_rank: int = 0
    """LoRA rank of the policy's adapters (0: train every weight); the base weights stay frozen."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter's output is multiplied by --lora-alpha / --lora-rank."""
    target_modules: str = option("all-linear", metavar="NAMES")
    """Comma list of the linear layers to adapt (e.g. q_proj,v_proj,gate_proj), or all-linear."""
    lora_dropout: float = 0.0
    """Dropout probability on each LoRA adapter's input in the training pass (not the log-prob passes)."""
    train_kernels: Literal["triton", "torch"] = "triton"
    """Trainer RMSNorm/SiLU/RoPE on CUDA: triton (fused kernels) or torch (eager ops, to bisect numerics)."""
    fast_single_rank: bool | None = None
    """One trainer rank without FSDP2 (a bf16 module, an fp32 master copy); default: on at one rank."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("global_batch_size", "num_steps_per_rollout", "micro_batch_size", "max_tokens_per_gpu"):
            at_least(self, name, 1)
        for name in ("lr", "lr_warmup_iters", "min_lr", "weight_decay", "clip_grad", "critic_lr",
                     "critic_lr_warmup_iters"):  # fmt: skip
            at_least(self, name, 0)
        in_range(self, "adam_beta1", 0, 1)
        in_range(self, "adam_beta2", 0, 1)
        at_least(self, "lora_rank", 0)
        above(self, "lora_alpha", 0)
        check(self, "lora_dropout", lambda v: 0 <= v < 1, "must be in [0, 1)")
        parse_target_modules(self.target_modules)


def parse_target_modules(text: str) -> tuple[str, ...]:
    """--target-modules 'q_proj, v_proj' -> ('q_proj', 'v_proj'); a ConfigError when an entry is empty or
    when 'all-linear' is mixed with names."""
    names = tuple(part.strip() for part in text.split(","))
    if any(not name for name in names):
        raise ConfigError(f"--target-modules must be a comma-separated list of module names, got {text!r}")
    if "all-linear" in names and len(names) > 1:
        raise ConfigError(
            f"--target-modules {text!r}: 'all-linear' stands alone (it means every linear layer)"
        )
    return names
