"""CI flags: in-run checks that observe the metric stream and the weight sync (reference/slime.md 9.4)."""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import ConfigError
from clawrl.config.fields import check_types


@dataclass(kw_only=True)
class CIConfig:
    """Checks for CI runs."""

    ci_test: bool = False
    """Assert numerics during the run (e.g. log_probs == ref_log_probs and ppo_kl == 0 at the first step)."""
    check_weight_update_equal: bool = False
    """After each weight sync, compare engine and trainer per-tensor checksums; fail on any difference."""
    ci_disable_kl_checker: bool = False
    """With --ci-test: skip the first-step log_probs == ref_log_probs and kl_loss == 0 checks."""
    ci_train_rollout_logprob_abs_diff_threshold: float = 0.1
    """With --ci-test: largest allowed train/train_rollout_logprob_abs_diff (engine vs trainer log-probs)."""
    ci_metric_checker_key: str | None = None
    """With --ci-test: a metric (e.g. eval/gsm8k) that must reach --ci-metric-checker-threshold at least once."""
    ci_metric_checker_threshold: float | None = None
    """Value --ci-metric-checker-key must reach at least once during the run."""

    def __post_init__(self) -> None:
        check_types(self)
        if (self.ci_metric_checker_key is None) != (self.ci_metric_checker_threshold is None):
            raise ConfigError(
                "--ci-metric-checker-key and --ci-metric-checker-threshold go together; got key "
                f"{self.ci_metric_checker_key!r} and threshold {self.ci_metric_checker_threshold!r}"
            )
        if self.ci_train_rollout_logprob_abs_diff_threshold < 0:
            raise ConfigError(
                "--ci-train-rollout-logprob-abs-diff-threshold must be >= 0, got "
                f"{self.ci_train_rollout_logprob_abs_diff_threshold}"
            )
