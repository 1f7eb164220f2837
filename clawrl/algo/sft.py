"""Supervised fine-tuning loss (`--loss-type sft_loss`): per-token negative log-likelihood.

Reduce it with `clawrl.algo.aggregation.aggregate_loss` (any mode), exactly like the policy losses.
Shapes: N = sum(response_lengths) flat response tokens.
"""

from __future__ import annotations

from torch import Tensor


def sft_loss(log_probs_N: Tensor) -> Tensor:
    """loss_N = -log_probs_N (gradient flows into log_probs_N)."""
    return -log_probs_N
