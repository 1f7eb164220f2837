"""Algorithm flags: advantage estimator, PPO clipping, KL terms, entropy, reward normalisation, and the
train/rollout mismatch correction (TIS, MIS, rejection sampling, mismatch metrics).

Meanings follow slime's loss code; dr_grpo and rloo are estimators clawrl adds. slime reads the MIS settings
(--tis-level ... --rs-veto-threshold) from a YAML file of extra attributes; clawrl makes them flags with the
same names, read by the built-in `clawrl.algo.tis:mis_function` (docs/trainer.md, "Train/rollout mismatch").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clawrl.config.errors import above, at_least, in_range
from clawrl.config.fields import check_types, option

Estimator = Literal[
    "grpo", "gspo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
]


@dataclass(kw_only=True)
class AlgoConfig:
    """RL algorithm."""

    advantage_estimator: Estimator = "grpo"
    """How rewards become per-token advantages (ppo uses a critic and GAE)."""
    eps_clip: float = 0.2
    """PPO clip: the probability ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = None
    """Upper PPO clip (DAPO clip-higher, e.g. 0.28); default: --eps-clip."""
    eps_clip_c: float | None = None
    """Dual-clip PPO bound c > 1: for negative advantages the loss is at most -c x advantage."""
    use_kl_loss: bool = False
    """Add KL(policy || reference) to the loss, weighted by --kl-loss-coef."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss (with --use-kl-loss)."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    """KL estimator for the KL loss and the KL reward penalty (low_var_kl: k3 clamped to [-10, 10])."""
    kl_coef: float = 0.0
    """KL penalty subtracted from per-token rewards (ppo, reinforce_plus_plus[_baseline]); not with --kl-loss-coef."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss = pg_loss - entropy_coef x entropy."""
    normalize_advantages: bool = False
    """Whiten advantages over all response tokens of the batch (required by reinforce_plus_plus[_baseline])."""
    rewards_normalization: bool = option(True, flag="--disable-rewards-normalization")
    """Do not subtract the group mean reward (grpo, gspo, reinforce_plus_plus_baseline)."""
    grpo_std_normalization: bool = option(True, flag="--disable-grpo-std-normalization")
    """Do not divide group-centred rewards by the group std (Dr. GRPO); implied by --n-samples-per-prompt 1."""
    calculate_per_token_loss: bool = False
    """Average the loss over all response tokens of the step instead of per sample first."""
    gamma: float = 1.0
    """Discount factor of ppo (GAE) and reinforce_plus_plus returns."""
    lambd: float = 1.0
    """GAE lambda of ppo."""
    value_clip: float = 0.2
    """ppo: the critic's new values count in the value loss only within +-X of the values of the rollout."""
    num_critic_only_steps: int = 0
    """ppo: the first N rollouts train only the critic (the policy is left unchanged)."""
    use_tis: bool = False
    """Truncated importance sampling: weight the loss by the train/rollout probability ratio, clipped."""
    tis_clip: float = 2.0
    """Upper clip of the TIS weight."""
    tis_clip_low: float = 0.0
    """Lower clip of the TIS weight."""
    use_rollout_logprobs: bool = False
    """Old-policy log-probs (PPO ratio, KL penalty) are the engine's rollout log-probs, not recomputed ones."""
    custom_tis_function_path: str | None = option(metavar="MODULE:FN")
    """Mismatch correction fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, ...)."""
    get_mismatch_metrics: bool = False
    """Log train-vs-rollout mismatch metrics through --custom-tis-function-path (required)."""
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    """mis_function: IS ratio per token, per sample (product) or per sample (geometric mean)."""
    tis_mode: Literal["truncate", "clip", "mask"] = "truncate"
    """mis_function: cap the IS weight, clamp it to the bounds, or drop tokens outside the bounds."""
    tis_upper_bound: float = 2.0
    """mis_function: upper bound of the IS weight."""
    tis_lower_bound: float | None = None
    """mis_function: lower bound of the IS weight (clip, mask); default: 1 / --tis-upper-bound."""
    tis_batch_normalize: bool = False
    """mis_function: rescale the IS weights of each micro-batch to mean 1 (token or sequence level)."""
    use_rs: bool = False
    """mis_function: rejection sampling: drop tokens or samples whose ratio is outside the RS bounds."""
    rs_level: Literal["token", "sequence", "geometric"] = "token"
    """mis_function: level of the rejection-sampling ratio."""
    rs_lower_bound: float | None = None
    """mis_function: lower rejection bound; default: the IS lower bound."""
    rs_upper_bound: float | None = None
    """mis_function: upper rejection bound; default: --tis-upper-bound."""
    rs_veto_threshold: float | None = None
    """mis_function with --use-rs: reject a whole sample if any token's ratio is below this."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("eps_clip", "eps_clip_high", "kl_loss_coef", "kl_coef", "tis_clip_low"):
            at_least(self, name, 0)
        above(self, "eps_clip_c", 1)
        above(self, "tis_clip", 0)
        above(self, "value_clip", 0)
        at_least(self, "num_critic_only_steps", 0)
        for name in ("tis_upper_bound", "rs_upper_bound", "rs_veto_threshold"):
            above(self, name, 0)
        for name in ("tis_lower_bound", "rs_lower_bound"):
            at_least(self, name, 0)
        in_range(self, "gamma", 0, 1)
        in_range(self, "lambd", 0, 1)
