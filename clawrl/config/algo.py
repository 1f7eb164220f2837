"""Algorithm flags: advantage estimator, PPO clipping, KL terms, entropy, reward normalisation, TIS.

Meanings follow slime's loss code; dr_grpo and rloo are estimators clawrl adds.
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
    use_tis: bool = False
    """Truncated importance sampling: weight the loss by the train/rollout probability ratio, clipped."""
    tis_clip: float = 2.0
    """Upper clip of the TIS weight."""
    tis_clip_low: float = 0.0
    """Lower clip of the TIS weight."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("eps_clip", "eps_clip_high", "kl_loss_coef", "kl_coef", "tis_clip_low"):
            at_least(self, name, 0)
        above(self, "eps_clip_c", 1)
        above(self, "tis_clip", 0)
        in_range(self, "gamma", 0, 1)
        in_range(self, "lambd", 0, 1)
