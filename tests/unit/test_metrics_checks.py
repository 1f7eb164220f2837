"""Checks on the metric stream: each --ci-test check passing and failing with the metric, step and value
in the message; the threshold check at close; checks wired through a real MetricLogger."""

from __future__ import annotations

import math
import re

import pytest

from clawrl.metrics import CITestChecks, MetricCheckError, MetricLogger, MetricThresholdCheck, read_metrics

# A healthy first rollout step as the logger hands it to checks (train list already flattened).
GOOD_FIRST = {
    "rollout/log_probs": -2.5,
    "rollout/ref_log_probs": -2.5,
    "rollout/raw_reward": 0.25,
    "train/ppo_kl": 0.001,
    "train/ppo_kl@first": 0.0,
    "train/pg_clipfrac": 0.1,
    "train/pg_clipfrac@first": 0.0,
    "train/kl_loss": 0.002,
    "train/kl_loss@first": 0.0,
    "train/train_rollout_logprob_abs_diff": 0.01,
    "train/train_rollout_logprob_abs_diff@first": 0.02,
}
# A later step: the policy has moved away from the reference.
GOOD_LATER = {**GOOD_FIRST, "rollout/log_probs": -2.0, "train/kl_loss@first": 0.3}


def _fails(check, step, metrics, message):
    with pytest.raises(MetricCheckError, match="^" + re.escape(message) + "$"):
        check.on_log(step, metrics)


def test_healthy_run_passes_and_every_check_ran():
    check = CITestChecks()
    check.on_log(0, GOOD_FIRST)
    check.on_log(1, GOOD_LATER)
    check.on_close()
    assert check.counts == {
        "no_nan": 2,
        "log_probs_range": 2,
        "logprob_abs_diff": 4,
        "train/ppo_kl@first": 2,
        "train/pg_clipfrac@first": 2,
        "log_probs_equal_ref": 1,
        "kl_loss_first": 1,
    }


def test_log_probs_must_equal_ref_at_the_first_step_only():
    _fails(
        CITestChecks(),
        0,
        {**GOOD_FIRST, "rollout/log_probs": -2.4},
        "--ci-test: rollout/log_probs = -2.4 at step 0, expected == rollout/ref_log_probs (-2.5)",
    )
    CITestChecks().on_log(3, {**GOOD_FIRST, "rollout/log_probs": -2.4})  # later steps may differ


def test_log_probs_equal_ref_tolerance_and_first_step_are_configurable():
    CITestChecks(ref_equal_tolerance=1e-3).on_log(0, {**GOOD_FIRST, "rollout/log_probs": -2.5005})
    _fails(
        CITestChecks(ref_equal_tolerance=1e-4),
        0,
        {**GOOD_FIRST, "rollout/log_probs": -2.5005},
        "--ci-test: rollout/log_probs = -2.5005 at step 0, expected == rollout/ref_log_probs (-2.5) within 0.0001",
    )
    check = CITestChecks(first_step=5)
    check.on_log(0, {**GOOD_FIRST, "rollout/log_probs": -2.4})
    _fails(check, 5, {**GOOD_FIRST, "rollout/log_probs": -2.4}, "--ci-test: rollout/log_probs = -2.4 at step 5, "
           "expected == rollout/ref_log_probs (-2.5)")  # fmt: skip


def test_ppo_kl_at_the_first_optimizer_step_must_be_zero_at_every_rollout():
    _fails(
        CITestChecks(),
        7,
        {**GOOD_LATER, "train/ppo_kl@first": 1e-9},
        "--ci-test: train/ppo_kl@first = 1e-09 at step 7, expected == 0",
    )
    CITestChecks(kl_tolerance=1e-8).on_log(7, {**GOOD_LATER, "train/ppo_kl@first": 1e-9})


def test_pg_clipfrac_at_the_first_optimizer_step_must_be_zero():
    _fails(
        CITestChecks(),
        2,
        {**GOOD_LATER, "train/pg_clipfrac@first": 0.125},
        "--ci-test: train/pg_clipfrac@first = 0.125 at step 2, expected == 0",
    )


def test_kl_loss_at_the_first_step_must_be_zero():
    _fails(
        CITestChecks(),
        0,
        {**GOOD_FIRST, "train/kl_loss@first": -0.25},
        "--ci-test: train/kl_loss@first = -0.25 at step 0, expected == 0",
    )
    CITestChecks(kl_tolerance=0.5).on_log(0, {**GOOD_FIRST, "train/kl_loss@first": -0.25})


def test_disabling_the_kl_checker_skips_the_kl_checks_only():
    check = CITestChecks(check_kl=False)
    check.on_log(
        0, {**GOOD_FIRST, "rollout/log_probs": -2.0, "train/ppo_kl@first": 1.0, "train/kl_loss@first": 1.0}
    )
    assert set(check.counts) == {"no_nan", "log_probs_range", "logprob_abs_diff"}
    _fails(
        check,
        1,
        {"rollout/log_probs": 0.0},
        "--ci-test: rollout/log_probs = 0.0 at step 1, expected -inf < value < 0",
    )


@pytest.mark.parametrize("value", [0.0, 0.5, -math.inf])
def test_log_probs_range(value):
    _fails(
        CITestChecks(),
        4,
        {"rollout/log_probs": value},
        f"--ci-test: rollout/log_probs = {value!r} at step 4, expected -inf < value < 0",
    )


def test_train_rollout_logprob_abs_diff_threshold():
    _fails(
        CITestChecks(),
        3,
        {"train/train_rollout_logprob_abs_diff": 0.25},
        "--ci-test: train/train_rollout_logprob_abs_diff = 0.25 at step 3, expected <= 0.1",
    )
    _fails(
        CITestChecks(logprob_abs_diff_threshold=1e-5),
        3,
        {"train/train_rollout_logprob_abs_diff": 0.0, "train/train_rollout_logprob_abs_diff@first": 2e-5},
        "--ci-test: train/train_rollout_logprob_abs_diff@first = 2e-05 at step 3, expected <= 1e-05",
    )
    CITestChecks().on_log(3, {"train/train_rollout_logprob_abs_diff": 0.1})


def test_nan_in_any_metric_fails():
    _fails(CITestChecks(), 6, {**GOOD_LATER, "perf/train_time": math.nan},
           "--ci-test: perf/train_time = nan at step 6, expected a number, not NaN")  # fmt: skip
    CITestChecks().on_log(6, {**GOOD_LATER, "perf/tokens_per_gpu_per_sec": math.inf})


def test_absent_metrics_skip_their_checks():
    check = CITestChecks()
    check.on_log(0, {"rollout/raw_reward": 0.5})
    assert dict(check.counts) == {"no_nan": 1}


def test_threshold_check_needs_one_value_at_or_above():
    check = MetricThresholdCheck("eval/gsm8k", 0.55)
    for step, value in [(0, 0.2), (10, 0.55), (20, 0.5)]:
        check.on_log(step, {"eval/gsm8k": value})
    check.on_close()


def test_threshold_check_failure_lists_the_values():
    check = MetricThresholdCheck("eval/gsm8k", 0.55)
    check.on_log(0, {"eval/gsm8k": 0.2})
    check.on_log(1, {"rollout/raw_reward": 0.9})
    check.on_log(10, {"eval/gsm8k": math.nan})
    check.on_log(20, {"eval/gsm8k": 0.5})
    with pytest.raises(
        MetricCheckError,
        match=re.escape("eval/gsm8k never reached 0.55 (step 0: 0.2, step 10: nan, step 20: 0.5)"),
    ):
        check.on_close()


def test_threshold_check_fails_when_never_logged():
    check = MetricThresholdCheck("eval/gsm8k", 0.55)
    check.on_log(0, {"rollout/raw_reward": 0.9})
    with pytest.raises(MetricCheckError, match="eval/gsm8k was never logged"):
        check.on_close()


def test_checks_through_the_logger(tmp_path):
    logger = MetricLogger(
        tmp_path, run_name="ci", checks=[CITestChecks(), MetricThresholdCheck("eval/toy", 0.5)]
    )
    logger.log(0, {
        "rollout/log_probs": -3.0, "rollout/ref_log_probs": -3.0, "eval/toy": 0.1,
        "train": [{"train/ppo_kl": 0.0, "train/kl_loss": 0.0}, {"train/ppo_kl": 0.02, "train/kl_loss": 0.01}],
    })  # fmt: skip
    with pytest.raises(
        MetricCheckError, match=re.escape("train/ppo_kl@first = 0.004 at step 1, expected == 0")
    ):
        logger.log(1, {"rollout/log_probs": -2.0, "train": [{"train/ppo_kl": 0.004}, {"train/ppo_kl": 0.0}]})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]  # the failing step is on disk
    with pytest.raises(MetricCheckError, match="eval/toy never reached 0.5"):
        logger.close()
    assert logger._file.closed
