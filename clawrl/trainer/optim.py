"""AdamW, the learning-rate schedule (`--lr --min-lr --lr-warmup-iters --lr-decay-style`) and gradient clipping
(`--clip-grad`).

The schedule is a function of the optimizer step (not of the rollout), like Megatron's: linear warmup from 0
to `lr` over `warmup_iters` steps, then `constant`, `linear` or `cosine` decay from `lr` to `min_lr` over
the remaining `total_iters - warmup_iters` steps. A scheduler is a plain object with `state_dict`, so it
checkpoints with the optimizer.
"""

from __future__ import annotations

import math

import torch

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def build_adamw(params, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float = 1e-8):
    """AdamW; fused kernels on CUDA (one launch for all parameters), the foreach path on CPU."""
    params = [p for p in params if p.requires_grad]
    on_cuda = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=on_cuda or None
    )


def lr_at(step: int, *, lr: float, min_lr: float, warmup_iters: int, total_iters: int, style: str) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style must be one of {LR_DECAY_STYLES}, got {style!r}")
    if warmup_iters > 0 and step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if style == "constant":
        return lr
    decay_iters = max(total_iters - warmup_iters, 1)
    progress = min(max(step - warmup_iters, 0) / decay_iters, 1.0)
    if style == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets the optimizer's learning rate before each step; checkpointable."""

    def __init__(self, optimizer, *, lr, min_lr, warmup_iters, total_iters, style):
        lr_at(0, lr=lr, min_lr=min_lr, warmup_iters=warmup_iters, total_iters=total_iters, style=style)
        self.optimizer = optimizer
        self.kwargs = dict(
            lr=lr, min_lr=min_lr, warmup_iters=warmup_iters, total_iters=total_iters, style=style
        )
        self.step_count = 0

    def current_lr(self) -> float:
        return lr_at(self.step_count, **self.kwargs)

    def apply(self) -> float:
        """Write the current step's rate into the optimizer; returns it."""
        value = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = value
        return value

    def advance(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


def clip_grad_norm(model: torch.nn.Module, max_norm: float, what: str) -> float:
    """Global L2 norm of `model`'s gradients (over every FSDP shard), clipped to `max_norm` when above it
    (`max_norm` 0: no clipping). A non-finite norm raises FloatingPointError naming `what` (e.g. "gradient
    norm at optimizer step 3")."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if hasattr(norm, "full_tensor"):  # a DTensor: the norm of the whole, not of this rank's shard
        norm = norm.full_tensor()
    value = float(norm)
    if not math.isfinite(value):
        raise FloatingPointError(f"{what} is {value}")
    # Under the limit the clip factor is exactly 1: skip the multiply over every gradient (~3% of a step).
    if 0 < max_norm < value:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return value
