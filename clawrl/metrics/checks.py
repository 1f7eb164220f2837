"""Checks that observe the metric stream (ARCHITECTURE.md decision 9): CI assertions without `if ci_test:`.

A check is handed to `MetricLogger(checks=[...])`; the logger calls `on_log(step, metrics)` after writing
each step (metrics flattened: `train/<key>` is the mean over optimizer steps, `train/<key>@first` the first
optimizer step's value) and `on_close()` when the run ends. A failed check raises MetricCheckError naming
the metric, the step and the value.

CITestChecks is `--ci-test` (reference/slime.md 9.4, adapted to clawrl's metric names):
  every step     no metric is NaN
                 -inf < rollout/log_probs < 0
                 train/train_rollout_logprob_abs_diff (mean and @first) <= logprob_abs_diff_threshold (0.1)
                 train/ppo_kl@first == 0 and train/pg_clipfrac@first == 0: the first optimizer step of a
                 rollout runs with the weights that computed the old log-probs, so the ratio is exactly 1
  first step     rollout/log_probs == rollout/ref_log_probs (policy == reference before any update)
                 train/kl_loss@first == 0
The KL-type checks (ppo_kl, pg_clipfrac, log_probs == ref, kl_loss) compare with tolerances that default to 0
(exact, as on CPU in fp32); GPU runs may pass e.g. 1e-8 as slime does. `check_kl=False` is slime's
`--ci-disable-kl-checker`. Checks whose metrics are absent are skipped; `counts` records which ran.
slime's entropy range check (0 < entropy < 1) is not carried over: tiny random test models have entropies
near log(vocab), far above 1.

MetricThresholdCheck is slime's old metric checker (`--ci-metric-checker-key/-threshold`): at close, at
least one logged value of the key must have been >= the threshold.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping


class MetricCheckError(AssertionError):
    """A check on the metric stream failed; the message names the metric, the step and the value."""


class MetricCheck:
    """Observer of the metric stream: override on_log and/or on_close; raise MetricCheckError to fail."""

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Called after each logged step with its flat metrics."""

    def on_close(self) -> None:
        """Called once when the logger closes (end of run)."""


class CITestChecks(MetricCheck):
    """`--ci-test` numerics checks on the logged metrics (see the module docstring for the list)."""

    def __init__(
        self,
        *,
        first_step: int = 0,
        check_kl: bool = True,
        ref_equal_tolerance: float = 0.0,
        kl_tolerance: float = 0.0,
        logprob_abs_diff_threshold: float = 0.1,
    ) -> None:
        self.first_step = first_step
        self.check_kl = check_kl
        self.ref_equal_tolerance = ref_equal_tolerance
        self.kl_tolerance = kl_tolerance
        self.logprob_abs_diff_threshold = logprob_abs_diff_threshold
        self.counts: Counter[str] = Counter()
        """How often each named check actually ran (a check whose metrics are absent does not run)."""

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._no_nan(step, metrics)
        self._log_probs_range(step, metrics)
        self._logprob_abs_diff(step, metrics)
        if self.check_kl:
            self._first_optimizer_step(step, metrics)
            if step == self.first_step:
                self._policy_equals_reference(step, metrics)

    def _no_nan(self, step: int, metrics: Mapping[str, float]) -> None:
        self.counts["no_nan"] += 1
        for key, value in metrics.items():
            if isinstance(value, float) and math.isnan(value):
                _fail(key, step, value, "a number, not NaN")

    def _log_probs_range(self, step: int, metrics: Mapping[str, float]) -> None:
        value = metrics.get("rollout/log_probs")
        if value is not None:
            self.counts["log_probs_range"] += 1
            if not -math.inf < value < 0:
                _fail("rollout/log_probs", step, value, "-inf < value < 0")

    def _logprob_abs_diff(self, step: int, metrics: Mapping[str, float]) -> None:
        for key in ("train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff@first"):
            value = metrics.get(key)
            if value is not None:
                self.counts["logprob_abs_diff"] += 1
                if not value <= self.logprob_abs_diff_threshold:
                    _fail(key, step, value, f"<= {self.logprob_abs_diff_threshold}")

    def _first_optimizer_step(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, tolerance in (("train/ppo_kl@first", self.kl_tolerance), ("train/pg_clipfrac@first", 0.0)):
            value = metrics.get(key)
            if value is not None:
                self.counts[key] += 1
                _expect_zero(key, step, value, tolerance)

    def _policy_equals_reference(self, step: int, metrics: Mapping[str, float]) -> None:
        log_probs, ref = metrics.get("rollout/log_probs"), metrics.get("rollout/ref_log_probs")
        if log_probs is not None and ref is not None:
            self.counts["log_probs_equal_ref"] += 1
            if not abs(log_probs - ref) <= self.ref_equal_tolerance:
                expected = _within(f"== rollout/ref_log_probs ({ref!r})", self.ref_equal_tolerance)
                _fail("rollout/log_probs", step, log_probs, expected)
        kl_loss = metrics.get("train/kl_loss@first")
        if kl_loss is not None:
            self.counts["kl_loss_first"] += 1
            _expect_zero("train/kl_loss@first", step, kl_loss, self.kl_tolerance)


class MetricThresholdCheck(MetricCheck):
    """At close, require at least one logged value of `key` >= `threshold` (e.g. eval/gsm8k >= 0.55)."""

    def __init__(self, key: str, threshold: float) -> None:
        self.key, self.threshold = key, threshold
        self.values: list[tuple[int, float]] = []
        """(step, value) of every logged value of the key."""

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.key in metrics:
            self.values.append((step, metrics[self.key]))

    def on_close(self) -> None:
        if not self.values:
            raise MetricCheckError(f"metric check: {self.key} was never logged (threshold {self.threshold})")
        if not any(value >= self.threshold for _, value in self.values):
            seen = ", ".join(f"step {step}: {value:g}" for step, value in self.values)
            raise MetricCheckError(f"metric check: {self.key} never reached {self.threshold} ({seen})")


def _expect_zero(key: str, step: int, value: float, tolerance: float) -> None:
    if not abs(value) <= tolerance:
        _fail(key, step, value, _within("== 0", tolerance))


def _within(expected: str, tolerance: float) -> str:
    return expected if tolerance == 0 else f"{expected} within {tolerance:g}"


def _fail(key: str, step: int, value: float, expected: str) -> None:
    raise MetricCheckError(f"--ci-test: {key} = {value!r} at step {step}, expected {expected}")
