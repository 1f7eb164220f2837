"""Per-token KL estimators between the policy and a reference (slime 4.3 "KL estimators").

With d_t = log_probs_t - ref_log_probs_t (tokens sampled from the policy):
  k1         = d
  k2         = d^2 / 2
  k3         = exp(-d) - 1 + d            (non-negative, unbiased for KL(policy || ref))
  low_var_kl = k3 clamped to [-10, 10]    (slime's `low_var_kl`; the clamp bounds rare huge ratios)
The same estimate serves the KL loss (`--use-kl-loss --kl-loss-type`) and KL-in-reward (`--kl-coef`).

Shapes: any; both inputs share one shape (usually flat [N] over response tokens). Computed in >= fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of type `kind` (one of KL_ESTIMATORS); same shape as the inputs."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ in shape"
        )
    # At least fp32 (bf16 log-probs lose the small differences that matter here); fp64 stays fp64.
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, ref_log_probs.dtype), torch.float32)
    log_ratio = log_probs.to(dtype) - ref_log_probs.to(dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.square() / 2.0
    if kind in ("k3", "low_var_kl"):
        k3 = torch.expm1(-log_ratio) + log_ratio
        return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"--kl-loss-type {kind!r} is not one of {', '.join(KL_ESTIMATORS)}")
