"""Loss aggregation over the global batch of one optimizer step (slime 4.5), split-invariant by construction.

An optimizer step sees a global batch spread over ranks and micro-batches. Each call reduces one micro-batch
to a scalar whose denominator is a GLOBAL count, so that summing the scalars over every micro-batch of every
rank (gradient accumulation + data-parallel all-reduce SUM) gives exactly the loss of the whole batch,
however it was split. Modes (m = loss mask, samples b, tokens t):
  "per_token"     sum_{b,t} x*m / num_global_tokens                        (`--calculate-per-token-loss`)
  "per_sample"    sum_b [sum_t x*m / max(sum_t m, 1)] / num_global_samples  (slime's default)
  "seq_sum_const" sum_{b,t} x*m / (num_global_samples * max_response_len)   (Dr.GRPO; constant denominator)
num_global_tokens = sum of the loss mask over the whole step (all micro-batches, all ranks);
num_global_samples = number of samples in the step; max_response_len = `--rollout-max-response-len`.
A sample whose mask is all 0 contributes 0. Entries with mask 0 are ignored even if they are inf/NaN.

Shapes: B = samples, N = sum(response_lengths) flat response tokens (samples concatenated in order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from clawrl.algo.segments import as_lengths, segment_sum

LOSS_AGGREGATIONS = ("per_token", "per_sample", "seq_sum_const")


def _masked(x_N: Tensor, mask_N: Tensor) -> Tensor:
    """x * m with masked-out entries exactly 0 (an inf/NaN there must not leak as 0 * inf)."""
    mask_N = mask_N.to(x_N.dtype)
    return torch.where(mask_N != 0, x_N * mask_N, torch.zeros_like(x_N))


def _require_positive(name: str, value: float | None, mode: str) -> float:
    if value is None or not value > 0:
        raise ValueError(f"loss aggregation {mode!r} needs {name} > 0, got {value}")
    return float(value)


def aggregate_loss(
    x_N: Tensor,
    mask_N: Tensor,
    response_lengths: Sequence[int] | Tensor,
    mode: str,
    *,
    num_global_tokens: float | None = None,
    num_global_samples: int | None = None,
    max_response_len: int | None = None,
) -> Tensor:
    """This micro-batch's share (scalar) of the global-batch loss under `mode` (see module docstring)."""
    if mask_N.shape != x_N.shape:
        raise ValueError(f"loss mask {tuple(mask_N.shape)} and per-token values {tuple(x_N.shape)} differ")
    if mode == "per_token":
        return _masked(x_N, mask_N).sum() / _require_positive("num_global_tokens", num_global_tokens, mode)
    if mode == "per_sample":
        num_samples = _require_positive("num_global_samples", num_global_samples, mode)
        lengths_B = as_lengths(response_lengths, x_N.numel(), x_N.device)
        sums_B = segment_sum(_masked(x_N, mask_N), lengths_B)
        counts_B = segment_sum(mask_N.to(x_N.dtype), lengths_B)
        return (sums_B / counts_B.clamp(min=1.0)).sum() / num_samples
    if mode == "seq_sum_const":
        num_samples = _require_positive("num_global_samples", num_global_samples, mode)
        max_len = _require_positive("max_response_len", max_response_len, mode)
        return _masked(x_N, mask_N).sum() / (num_samples * max_len)
    raise ValueError(f"loss aggregation mode {mode!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")


def masked_mean(x_N: Tensor, mask_N: Tensor) -> Tensor:
    """Local masked mean sum(x*m) / max(sum(m), 1) (for logging a micro-batch; not split-invariant)."""
    return _masked(x_N, mask_N).sum() / mask_N.to(x_N.dtype).sum().clamp(min=1.0)
