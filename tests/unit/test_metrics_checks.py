"""Checks on the metric stream: each check passing and failing with the metric, step, value and bound in
the message; the threshold check at close; the text check (warning / failure); the grad-norm files; the
end-of-run table with the checks that could not run and why; checks wired through a real MetricLogger,
including that a close after a failure raises nothing new; build_checks from the job's flags."""

from __future__ import annotations

import json
import math
import re

import pytest

from clawrl.config import ConfigError, parse_job_args
from clawrl.debug.language import TextThresholds
from clawrl.metrics import CITestChecks, MetricCheckError, MetricLogger, MetricThresholdCheck, read_metrics
from clawrl.metrics.checks import (
    CheckRow,
    GradNormComparer,
    GradNormSaver,
    TextCheck,
    build_checks,
    format_check_table,
)

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


def test_log_probs_must_lie_within_the_margin_below_minus_one():
    check = CITestChecks(log_probs_margin=0.5)
    check.on_log(0, {"rollout/log_probs": -1.4})
    check.on_log(1, {"rollout/log_probs": -0.01})
    _fails(check, 2, {"rollout/log_probs": -1.6},
           "--ci-test: rollout/log_probs = -1.6 at step 2, expected -1.5 < value < 0 (--ci-log-probs-margin)")  # fmt: skip
    _fails(CITestChecks(log_probs_margin=0.0), 0, {"rollout/log_probs": -1.0},
           "--ci-test: rollout/log_probs = -1.0 at step 0, expected -1 < value < 0 (--ci-log-probs-margin)")  # fmt: skip
    # a random tiny model (vocab 2048) sits near -log(2048) = -7.62: tests of tiny runs set a large margin
    CITestChecks(log_probs_margin=10).on_log(0, {"rollout/log_probs": -7.6})


def test_first_step_grad_norm_bound():
    _fails(
        CITestChecks(first_step_grad_norm_max=10.0),
        0,
        {**GOOD_FIRST, "train/grad_norm": 3.0, "train/grad_norm@first": 12.5},
        "--ci-test: train/grad_norm@first = 12.5 at step 0, expected <= 10 (--ci-first-step-grad-norm-max)",
    )
    check = CITestChecks(first_step_grad_norm_max=10.0)
    check.on_log(0, {**GOOD_FIRST, "train/grad_norm@first": 10.0})  # the bound itself passes
    check.on_log(1, {**GOOD_LATER, "train/grad_norm@first": 500.0})  # later steps are not bounded
    assert check.counts["grad_norm_first"] == 1


def test_table_rows_of_the_ci_checks_with_reasons_for_what_did_not_run():
    check = CITestChecks(
        log_probs_margin=0.5, first_step_grad_norm_max=10.0,
        not_run={"log_probs_equal_ref": "no reference model (--use-kl-loss / --kl-coef unset)"},
    )  # fmt: skip
    check.on_log(0, {"rollout/log_probs": -0.5, "train/grad_norm@first": 0.61, "train/ppo_kl@first": 0.0})
    check.on_log(1, {"rollout/log_probs": -0.25, "train/ppo_kl@first": 0.0})
    rows = {row.name: row for row in check.rows()}
    assert rows["NaN metrics per step"] == CheckRow(name="NaN metrics per step", result="pass",
                                                    measured="0 (2 values)", bound="== 0")  # fmt: skip
    assert rows["rollout/log_probs (--ci-log-probs-margin)"].measured == "-0.5 .. -0.25 (2 values)"
    assert rows["rollout/log_probs (--ci-log-probs-margin)"].bound == "in (-1.5, 0)"
    assert rows["train/grad_norm@first (first step)"] == CheckRow(
        name="train/grad_norm@first (first step)", result="pass", measured="0.61 (step 0)",
        bound="<= 10 (--ci-first-step-grad-norm-max)",
    )  # fmt: skip
    assert rows["|log_probs - ref_log_probs| (first step)"] == CheckRow(
        name="|log_probs - ref_log_probs| (first step)", result="not run",
        measured="no reference model (--use-kl-loss / --kl-coef unset)",
    )  # fmt: skip
    assert rows["train/kl_loss@first (first step)"].measured == "train/kl_loss@first never logged"
    assert [r.result for r in check.rows()] == ["pass", "pass", "not run", "pass", "not run", "not run",
                                                "not run", "pass"]  # fmt: skip


def test_a_failed_rule_is_marked_in_the_table():
    check = CITestChecks()
    with pytest.raises(MetricCheckError):
        check.on_log(0, {**GOOD_FIRST, "train/pg_clipfrac@first": 0.5})
    row = next(r for r in check.rows() if r.name.startswith("train/pg_clipfrac"))
    assert (row.result, row.measured) == ("FAIL", "0.5 (step 0)")


def test_disabled_kl_checker_is_named_in_the_table():
    rows = {r.name: r for r in CITestChecks(check_kl=False).rows()}
    assert rows["train/ppo_kl@first (every rollout)"].measured == "--ci-disable-kl-checker"
    assert rows["train/kl_loss@first (first step)"].result == "not run"


def test_text_check_warns_once_per_bad_rollout(caplog):
    check = TextCheck(TextThresholds(), fail=False)
    with caplog.at_level("WARNING", logger="clawrl.metrics.checks"):
        check.on_log(0, {"rollout/text/empty_ratio": 0.0, "rollout/text/bad_char_ratio": 0.0,
                         "rollout/text/repetition": 0.1})  # fmt: skip
        check.on_log(1, {"rollout/text/empty_ratio": 0.75, "rollout/text/bad_char_ratio": 0.25,
                         "rollout/text/repetition": 0.1})  # fmt: skip
    assert [r.getMessage() for r in caplog.records] == [
        "rollout 1: the responses do not look like language: empty responses 0.75 > 0.5 "
        "(--ci-text-max-empty-ratio); replacement/unprintable characters 0.25 > 0.05 (--ci-text-max-bad-char-ratio)"
    ]
    assert check.rows() == []  # a warning, not a CI check: not in the table


def test_text_check_fails_under_ci_test():
    check = TextCheck(TextThresholds(max_repetition=0.3), fail=True)
    check.on_log(0, {"rollout/text/empty_ratio": 0.0, "rollout/text/repetition": 0.3})
    _fails(check, 1, {"rollout/text/empty_ratio": 0.0, "rollout/text/repetition": 0.35},
           "--ci-test: rollout/text/repetition = 0.35 at step 1, expected <= 0.3 (--ci-text-max-repetition)")  # fmt: skip
    assert [(r.name, r.result, r.measured) for r in check.rows()] == [
        ("rollout/text/empty_ratio", "pass", "0 (2 values)"),
        ("rollout/text/bad_char_ratio", "not run", "rollout/text/bad_char_ratio never logged"),
        ("rollout/text/repetition", "FAIL", "0.3 .. 0.35 (2 values)"),
    ]


def test_grad_norms_saved_and_compared(tmp_path):
    path = tmp_path / "norms" / "grad_norm.json"
    saver = GradNormSaver(path)
    saver.on_train_steps(0, [{"train/grad_norm": 2.0}, {"train/grad_norm": 1.5}])
    saver.on_train_steps(1, [{"train/grad_norm": 4.0, "train/loss": 0.1}])
    assert json.loads(path.read_text()) == {"format_version": 1, "grad_norms": [
        {"rollout_id": 0, "step_index": 0, "grad_norm": 2.0}, {"rollout_id": 0, "step_index": 1, "grad_norm": 1.5},
        {"rollout_id": 1, "step_index": 0, "grad_norm": 4.0},
    ]}  # fmt: skip
    assert saver.rows()[0].measured == "3 optimizer steps"
    comparer = GradNormComparer(path, rtol=0.01)
    comparer.on_train_steps(0, [{"train/grad_norm": 2.015}, {"train/grad_norm": 1.5}])  # 0.75% passes
    with pytest.raises(MetricCheckError, match="^" + re.escape(
        f"--ci-load-grad-norm: train/grad_norm = 4.1 at rollout 1 optimizer step 0, saved 4.0 in {path}: "
        "relative difference 0.025 > --ci-grad-norm-rtol 0.01") + "$"):  # fmt: skip
        comparer.on_train_steps(1, [{"train/grad_norm": 4.1}])
    row = comparer.rows()[0]
    assert (row.result, row.measured, row.bound) == (
        "FAIL",
        "0 .. 0.025 (3 values)",
        "relative difference <= 0.01",
    )
    with pytest.raises(MetricCheckError, match="holds no train/grad_norm for rollout 0 optimizer step 2"):
        comparer.on_train_steps(
            0, [{"train/grad_norm": 2.0}, {"train/grad_norm": 1.5}, {"train/grad_norm": 1.0}]
        )


def test_grad_norm_file_mistakes_name_the_flag_and_file(tmp_path):
    with pytest.raises(ConfigError, match="--ci-load-grad-norm .*missing.json: no such file"):
        GradNormComparer(tmp_path / "missing.json", rtol=0.01)
    (tmp_path / "bad.json").write_text('{"grad_norms": []}')
    with pytest.raises(ConfigError, match="expected format_version 1 .* got None"):
        GradNormComparer(tmp_path / "bad.json", rtol=0.01)
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(ConfigError, match="junk.json: not a grad-norm file"):
        GradNormComparer(tmp_path / "junk.json", rtol=0.01)


def test_table_format():
    threshold = MetricThresholdCheck("eval/toy", 0.5)
    threshold.on_log(0, {"eval/toy": 0.25})
    threshold.on_log(1, {"eval/toy": 0.75})
    threshold.on_close()
    text = TextCheck(TextThresholds(), fail=True)
    text.on_log(0, {"rollout/text/empty_ratio": 0.0, "rollout/text/bad_char_ratio": 0.01,
                    "rollout/text/repetition": 0.0})  # fmt: skip
    # columns: result (6 = "result"), check (48 = the metric checker's name), measured (25 = the header)
    assert format_check_table([text, threshold]).splitlines() == [
        "checks:",
        "  result  check                                             measured (or why not run)  bound",
        "  pass    rollout/text/empty_ratio                          0 (step 0)                 <= 0.5 (--ci-text-max-empty-ratio)",
        "  pass    rollout/text/bad_char_ratio                       0.01 (step 0)              <= 0.05 (--ci-text-max-bad-char-ratio)",
        "  pass    rollout/text/repetition                           0 (step 0)                 <= 0.5 (--ci-text-max-repetition)",
        "  pass    eval/toy at least once (--ci-metric-checker-key)  best 0.75 of 2 values      >= 0.5",
    ]  # fmt: skip
    assert format_check_table([TextCheck(TextThresholds(), fail=False)]) == ""


def test_checks_through_the_logger_see_every_optimizer_step(tmp_path):
    saver = GradNormSaver(tmp_path / "g.json")
    logger = MetricLogger(tmp_path, run_name="ci", checks=[CITestChecks(), saver])
    logger.log(0, {
        "rollout/log_probs": -3.0, "rollout/ref_log_probs": -3.0,
        "train": [{"train/ppo_kl": 0.0, "train/grad_norm": 2.0}, {"train/ppo_kl": 0.02, "train/grad_norm": 1.0}],
    })  # fmt: skip
    assert [e["grad_norm"] for e in saver.entries] == [2.0, 1.0]  # both steps, not their mean
    with pytest.raises(
        MetricCheckError, match=re.escape("train/ppo_kl@first = 0.004 at step 1, expected == 0")
    ):
        logger.log(1, {"rollout/log_probs": -2.0, "train": [{"train/ppo_kl": 0.004}, {"train/ppo_kl": 0.0}]})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]  # the failing step is on disk
    assert str(logger.check_failure).startswith("--ci-test: train/ppo_kl@first = 0.004")


def test_close_after_a_failed_check_raises_nothing_new_and_prints_the_table(tmp_path, capsys):
    threshold = MetricThresholdCheck("eval/toy", 0.5)
    logger = MetricLogger(
        tmp_path, run_name="ci", checks=[CITestChecks(first_step_grad_norm_max=1.0), threshold]
    )
    with pytest.raises(MetricCheckError, match="train/grad_norm@first = 3.0 at step 0, expected <= 1"):
        logger.log(0, {"rollout/log_probs": -3.0, "train": [{"train/grad_norm": 3.0}]})
    logger.close()  # eval/toy was never logged: no second error hides the first
    assert logger._file.closed
    out = capsys.readouterr().out
    assert re.search(r"\n  FAIL     train/grad_norm@first \(first step\) +3 \(step 0\) +<= 1 ", out)
    assert re.search(
        r"\n  not run  eval/toy at least once \(--ci-metric-checker-key\) +judged at the end of a run", out
    )
    assert threshold.verdict is None


def test_close_while_an_exception_propagates_runs_no_verdict(tmp_path):
    logger = MetricLogger(tmp_path, run_name="ci", checks=[MetricThresholdCheck("eval/toy", 0.5)])
    with pytest.raises(RuntimeError, match="engine died"):
        try:
            raise RuntimeError("engine died")
        finally:
            logger.close()  # as in the loop's `finally: run.close()`


def test_close_of_a_run_that_ended_well_raises_the_verdict_after_the_table(tmp_path, capsys):
    logger = MetricLogger(tmp_path, run_name="ci", checks=[MetricThresholdCheck("eval/toy", 0.5)])
    logger.log(0, {"eval/toy": 0.25})
    with pytest.raises(MetricCheckError, match=re.escape("eval/toy never reached 0.5 (step 0: 0.25)")):
        logger.close()
    out = capsys.readouterr().out
    assert "  FAIL    eval/toy at least once (--ci-metric-checker-key)  best 0.25 of 1 value " in out


BASE = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--num-rollout",
    "1",
    "--hf-checkpoint",
    "m",
]


def test_build_checks_from_flags(tmp_path):
    plain = build_checks(parse_job_args(BASE))
    assert [type(c).__name__ for c in plain] == ["TextCheck"] and plain[0].fail is False
    (tmp_path / "g.json").write_text('{"format_version": 1, "grad_norms": []}')
    checks = build_checks(parse_job_args([
        *BASE, "--ci-test", "--ci-log-probs-margin", "10", "--ci-first-step-grad-norm-max", "2.5",
        "--ci-text-max-repetition", "0.25", "--ci-save-grad-norm", str(tmp_path / "new.json"),
        "--ci-load-grad-norm", str(tmp_path / "g.json"), "--ci-grad-norm-rtol", "0.05",
        "--ci-metric-checker-key", "eval/toy", "--ci-metric-checker-threshold", "0.5",
    ]))  # fmt: skip
    ci, text, saver, comparer, threshold = checks
    assert text.fail is True and text.thresholds.max_repetition == 0.25
    assert (ci.log_probs_low, ci.first_step_grad_norm_max) == (-11.0, 2.5)
    assert saver.path == tmp_path / "new.json"
    assert (comparer.rtol, comparer.saved) == (0.05, {})
    assert (threshold.key, threshold.threshold) == ("eval/toy", 0.5)
    # no reference model and no KL loss: named, not silently skipped
    assert ci.rules["log_probs_equal_ref"].skip == "no reference model (--use-kl-loss / --kl-coef unset)"
    assert ci.rules["kl_loss_first"].skip == "no KL loss (--use-kl-loss unset)"
    with_ref = build_checks(parse_job_args([*BASE, "--ci-test", "--use-kl-loss", "--kl-loss-coef", "0"]))[0]
    assert with_ref.rules["log_probs_equal_ref"].skip is None and with_ref.rules["kl_loss_first"].skip is None


def test_build_checks_in_a_rollout_only_run_names_the_trainer_checks():
    ci = build_checks(
        parse_job_args([*BASE, "--ci-test", "--debug-rollout-only", "--rollout-num-gpus", "1"])
    )[0]
    assert ci.rules["grad_norm_first"].skip == "--debug-rollout-only: no trainer"
    assert ci.rules["no_nan"].skip is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ci-first-step-grad-norm-max", "-1"], "--ci-first-step-grad-norm-max must be >= 0, got -1.0"),
        (["--ci-log-probs-margin", "-0.5"], "--ci-log-probs-margin must be >= 0, got -0.5"),
        (["--ci-text-max-empty-ratio", "1.5"], "--ci-text-max-empty-ratio must be in [0.0, 1.0], got 1.5"),
        (["--ci-grad-norm-rtol", "-1"], "--ci-grad-norm-rtol must be >= 0, got -1.0"),
        (["--ci-save-grad-norm", "g.json", "--ci-load-grad-norm", "g.json"],
         "--ci-save-grad-norm and --ci-load-grad-norm are the same file 'g.json'"),
    ],
)  # fmt: skip
def test_ci_flag_mistakes(flags, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        parse_job_args([*BASE, *flags])
