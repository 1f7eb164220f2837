"""RL algorithms as pure tensor functions: rewards -> advantages, policy/KL/entropy/SFT losses, TIS/MIS,
and split-invariant loss aggregation. No imports from other clawrl subpackages.

Conventions (all modules): per-token quantities of a micro-batch are flat 1-D tensors over the concatenation
of the samples' response tokens (suffix `_N`, N = sum(response_lengths)); per-sample ones end in `_B`;
`response_lengths` is a list[int] or LongTensor[B]. Losses are returned per token and reduced by
`aggregate_loss`; metrics dicts hold per-token tensors reduced the same way by the caller.
"""

from clawrl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages_and_returns,
    discounted_reverse_cumsum,
    leave_one_out_rewards,
    normalize_group_rewards,
    postprocess_rewards,
    whiten_advantages,
)
from clawrl.algo.aggregation import LOSS_AGGREGATIONS, aggregate_loss, masked_mean
from clawrl.algo.entropy import entropy_from_logits, log_probs_and_entropy
from clawrl.algo.kl import KL_ESTIMATORS, kl_estimate
from clawrl.algo.policy_loss import gspo_policy_loss, ppo_policy_loss
from clawrl.algo.sft import sft_loss
from clawrl.algo.tis import (
    TIS_LEVELS,
    TIS_MODES,
    mismatch_log_ratio,
    rejection_sampling_mask,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "TIS_LEVELS",
    "TIS_MODES",
    "aggregate_loss",
    "compute_advantages_and_returns",
    "discounted_reverse_cumsum",
    "entropy_from_logits",
    "gspo_policy_loss",
    "kl_estimate",
    "leave_one_out_rewards",
    "log_probs_and_entropy",
    "masked_mean",
    "mismatch_log_ratio",
    "normalize_group_rewards",
    "postprocess_rewards",
    "ppo_policy_loss",
    "rejection_sampling_mask",
    "sft_loss",
    "whiten_advantages",
]
