"""CI flags: in-run checks that observe the metric stream and the weight sync (slime's `--ci-*` flags).

The checks themselves are in clawrl/metrics/checks.py; `--ci-test` makes them fail the run (exit code 1)
and print a table of every check at the end. The `--ci-text-*` thresholds also apply without --ci-test,
as one warning line per rollout whose text does not look like language.

Defaults, and why:
  --ci-first-step-grad-norm-max 10   The first optimizer step starts from the reference policy (ratio 1,
      KL 0), so only the policy gradient counts. The tiny CPU test model (vocab 2048, hidden 64, GRPO,
      lr 1e-3) measures 0.61; GRPO on a 0.5B instruct model is expected around 0.1-1 (and is clipped at
      --clip-grad 1.0 anyway). 10 sits an order of magnitude above both and still catches a loss that is
      scaled wrongly (e.g. summed over tokens instead of averaged), which gives norms in the hundreds.
  --ci-log-probs-margin 0.5   rollout/log_probs is the mean log-prob per response token of text the model
      sampled itself: about minus its entropy, -0.1..-0.5 for an instruct model at temperature 0.8-1, which
      is why a trained model lies in (-1, 0). Half a nat of margin tolerates base models and hotter sampling;
      a chat-template mismatch or unloaded weights still fall below. A random tiny model sits near
      -log(vocab size) (-7.6 for 2048 tokens): tests of tiny random models pass e.g. 10.
  --ci-text-max-*   0.5 empty, 0.05 bad characters, 0.5 repetition: a random tiny model scores about 0.02
      bad characters (its byte tokens), 0 and 0; healthy text scores 0 on all three.
"""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import ConfigError, at_least, in_range, non_empty
from clawrl.config.fields import check_types, option


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
    ci_first_step_grad_norm_max: float = 10.0
    """With --ci-test: largest train/grad_norm of the first optimizer step (tiny CPU test model: 0.61; a 0.5B model: about 0.1-1 expected)."""
    ci_log_probs_margin: float = 0.5
    """With --ci-test: rollout/log_probs must lie in (-1 - MARGIN, 0); a random tiny model is near -log(vocab size), so its tests set e.g. 10."""
    ci_text_max_empty_ratio: float = 0.5
    """Largest share of empty responses per rollout (a warning; a failure with --ci-test)."""
    ci_text_max_bad_char_ratio: float = 0.05
    """Largest share of U+FFFD / unprintable characters per rollout (a warning; a failure with --ci-test)."""
    ci_text_max_repetition: float = 0.5
    """Largest mean repetition (repeated word 4-grams, a looping tail) per rollout (a warning; a failure with --ci-test)."""
    ci_save_grad_norm: str | None = option(metavar="PATH")
    """Save every optimizer step's train/grad_norm (JSON: rollout id, step index, value) to PATH."""
    ci_load_grad_norm: str | None = option(metavar="PATH")
    """Compare every optimizer step's train/grad_norm with PATH's (the same rollouts replayed); fail beyond --ci-grad-norm-rtol."""
    ci_grad_norm_rtol: float = 0.01
    """Relative tolerance of --ci-load-grad-norm: |new - saved| <= RTOL * |saved|."""
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
        for name in ("ci_train_rollout_logprob_abs_diff_threshold", "ci_first_step_grad_norm_max",
                     "ci_log_probs_margin", "ci_grad_norm_rtol"):  # fmt: skip
            at_least(self, name, 0)
        for name in ("ci_text_max_empty_ratio", "ci_text_max_bad_char_ratio", "ci_text_max_repetition"):
            in_range(self, name, 0.0, 1.0)
        non_empty(self, "ci_save_grad_norm")
        non_empty(self, "ci_load_grad_norm")
        if self.ci_save_grad_norm is not None and self.ci_save_grad_norm == self.ci_load_grad_norm:
            raise ConfigError(
                f"--ci-save-grad-norm and --ci-load-grad-norm are the same file {self.ci_save_grad_norm!r}: "
                "the run would overwrite the norms it compares against"
            )
