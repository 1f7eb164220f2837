"""The critic's side of PPO: the clipped value loss and the explained variance of its predictions.

    loss_M, metrics = clipped_value_loss(values_M, old_values_M, returns_M, value_clip=0.2)
    ev = explained_variance(returns_N, values_N, mask_N, sum_fn=all_reduce_sum)   # None if undefined

Value loss (slime's, `--value-clip`): with V the critic's current prediction, V_old the prediction the
returns were computed with and R the return,

    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
    loss_t = max((V_clip - R)^2, (V - R)^2)

with no 1/2 factor (slime has none; the factor would only rescale the critic's learning rate), and the
clip fraction is 1[|V - V_old| > value_clip]. Both are per-token; the caller reduces them like the policy
loss (per sample, or per token with --calculate-per-token-loss).

Shapes: M = response tokens of a micro-batch, N = response tokens of a whole rollout on this rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def clipped_value_loss(
    values_M: Tensor, old_values_M: Tensor, returns_M: Tensor, *, value_clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token (loss_M, {"value_clipfrac": 0/1 per token}); gradients flow through values_M only."""
    if value_clip <= 0:
        raise ValueError(f"--value-clip must be > 0, got {value_clip}")
    old_values_M, returns_M = old_values_M.detach(), returns_M.detach()
    delta_M = values_M - old_values_M
    clipped_M = old_values_M + delta_M.clamp(-value_clip, value_clip)
    loss_M = torch.maximum((clipped_M - returns_M).square(), (values_M - returns_M).square())
    clipfrac_M = (delta_M.detach().abs() > value_clip).to(values_M.dtype)
    return loss_M, {"value_clipfrac": clipfrac_M}


@torch.no_grad()
def explained_variance(
    returns_N: Tensor,
    values_N: Tensor,
    mask_N: Tensor,
    *,
    sum_fn: Callable[[Tensor], Tensor] | None = None,
) -> float | None:
    """1 - Var(R - V) / Var(R) over the masked tokens (population variances).

    1 means the values predict the returns exactly, 0 no better than their mean, < 0 worse. sum_fn
    receives the float64 tensor [sum m, sum m*R, sum m*R^2, sum m*(R-V), sum m*(R-V)^2] and must return
    it summed over every rank (an all-reduce); None = this rank only. Returns None when undefined: no
    masked token, or returns without variance (e.g. every reward 0).
    """
    mask64_N = mask_N.to(torch.float64)
    returns64_N = returns_N.to(torch.float64)
    error64_N = returns64_N - values_N.to(torch.float64)
    sums_5 = torch.stack([
        mask64_N.sum(),
        (mask64_N * returns64_N).sum(),
        (mask64_N * returns64_N.square()).sum(),
        (mask64_N * error64_N).sum(),
        (mask64_N * error64_N.square()).sum(),
    ])  # fmt: skip
    if sum_fn is not None:
        sums_5 = sum_fn(sums_5)
    count, sum_r, sum_r2, sum_e, sum_e2 = (float(v) for v in sums_5.tolist())
    if count <= 0:
        return None
    var_returns = max(sum_r2 / count - (sum_r / count) ** 2, 0.0)
    var_error = max(sum_e2 / count - (sum_e / count) ** 2, 0.0)
    # Relative threshold: returns equal up to float round-off have no variance to explain.
    if var_returns <= 1e-12 * max(sum_r2 / count, 1e-30):
        return None
    return 1.0 - var_error / var_returns
