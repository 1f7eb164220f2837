"""Checks that observe the metric stream: CI assertions without `if ci_test:` in the training code.

    checks = build_checks(job)                 # what the job's --ci-* flags ask for
    logger = MetricLogger(out, run_name="r", checks=checks)   # runs them on every logged step

The logger calls each check's `on_train_steps(step, per_step)` with the trainer's per-optimizer-step dicts,
then `on_log(step, metrics)` after writing the step (metrics flattened: `train/<key>` is the mean over
optimizer steps, `train/<key>@first` the first optimizer step's value), and `on_close()` when the run ends
well. A failed check raises MetricCheckError naming the metric, the step, the value and the bound. At the
end `format_check_table(checks)` lists every check with its measured values, bound and result, and every
check that could not run in this configuration and why.

CITestChecks is `--ci-test` (slime's in-run CI assertions, on clawrl's metric names):
  every step   no metric is NaN
               -1 - margin < rollout/log_probs < 0 (mean log-prob per response token; --ci-log-probs-margin)
               train/train_rollout_logprob_abs_diff (mean and @first) <= its threshold (0.1); exactly 0
               with --true-on-policy-mode
               train/ppo_kl@first == 0 and train/pg_clipfrac@first == 0: the first optimizer step of a
               rollout runs with the weights that computed the old log-probs, so the ratio is exactly 1
  first step   rollout/log_probs == rollout/ref_log_probs (policy == reference before any update)
               train/kl_loss@first == 0
               train/grad_norm@first <= --ci-first-step-grad-norm-max
The KL-type checks compare with tolerances that default to 0 (exact, as on CPU in fp32); GPU runs may pass
e.g. 1e-8. `check_kl=False` is `--ci-disable-kl-checker`. A check whose metrics are absent does not run;
the table says why (a reason given by build_checks, else which metric was never logged). slime's entropy
range check (0 < entropy < 1) is not carried over: tiny random test models have entropies near log(vocab).

TextCheck judges `rollout/text/*` (clawrl/debug/language.py): one warning line per rollout whose text does
not look like language, a failure under --ci-test. GradNormSaver / GradNormComparer are
`--ci-save-grad-norm` / `--ci-load-grad-norm`. MetricThresholdCheck is slime's old metric checker
(`--ci-metric-checker-key/-threshold`): at close, one logged value of the key must be >= the threshold.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clawrl.debug.language import TextThresholds, text_verdict

if TYPE_CHECKING:
    from clawrl.config.job import JobConfig

logger = logging.getLogger(__name__)

GRAD_NORM_FORMAT_VERSION = 1


class MetricCheckError(AssertionError):
    """A check on the metric stream failed; the message names the metric, the step and the value."""


@dataclass(kw_only=True)
class CheckRow:
    """One line of the end-of-run check table."""

    name: str
    """What is checked, e.g. `train/grad_norm@first (first step)`."""
    result: str
    """`pass`, `FAIL` or `not run`."""
    measured: str = ""
    """The measured value(s), or for `not run` why the check could not run."""
    bound: str = ""
    """What the value must satisfy, e.g. `<= 10`."""


class MetricCheck:
    """Observer of the metric stream: override the hooks; raise MetricCheckError to fail."""

    def on_train_steps(self, step: int, per_step: Sequence[Mapping[str, float]]) -> None:
        """Called before on_log with the step's per-optimizer-step train metrics (unflattened)."""

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Called after each logged step with its flat metrics."""

    def on_close(self) -> None:
        """Called once when the run ends without an earlier failure."""

    def rows(self) -> list[CheckRow]:
        """This check's lines of the end-of-run table ([] = not listed)."""
        return []


class _Rule:
    """One named check inside a check object: its measured values, its bound and its first failure."""

    def __init__(self, name: str, bound: str, keys: str, skip: str | None = None) -> None:
        self.name, self.bound, self.keys, self.skip = name, bound, keys, skip
        self.count = 0
        self.low: tuple[float, int] | None = None  # (smallest value, its step)
        self.high: tuple[float, int] | None = None
        self.failed = False

    def record(self, step: int, key: str, value: float, ok: bool, expected: str, *, shown=None) -> None:
        """Count one measurement of `value`; unless `ok`, remember the failure and raise MetricCheckError
        "<key> = <shown, default value> at step <step>, expected <expected>"."""
        self.count += 1
        if self.low is None or value < self.low[0]:
            self.low = (value, step)
        if self.high is None or value > self.high[0]:
            self.high = (value, step)
        if not ok:
            self.failed = True
            _fail(key, step, value if shown is None else shown, expected)

    def row(self) -> CheckRow:
        if self.skip is not None:
            return CheckRow(name=self.name, result="not run", measured=self.skip)
        if self.count == 0:
            return CheckRow(name=self.name, result="not run", measured=f"{self.keys} never logged")
        return CheckRow(
            name=self.name,
            result="FAIL" if self.failed else "pass",
            measured=self._measured(),
            bound=self.bound,
        )

    def _measured(self) -> str:
        assert self.low is not None and self.high is not None
        if self.count == 1 or self.low[0] == self.high[0]:
            where = f"step {self.low[1]}" if self.count == 1 else f"{self.count} values"
            return f"{self.low[0]:.4g} ({where})"
        return f"{self.low[0]:.4g} .. {self.high[0]:.4g} ({self.count} values)"


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
        true_on_policy: bool = False,
        log_probs_margin: float = math.inf,
        first_step_grad_norm_max: float = math.inf,
        not_run: Mapping[str, str] | None = None,
    ) -> None:
        """not_run: rule id (a key of `self.rules`, e.g. "grad_norm_first") -> why it cannot run in this
        configuration; log_probs_margin and first_step_grad_norm_max default to no bound (their --ci-*
        flags have finite defaults); true_on_policy (--true-on-policy-mode) makes the train/rollout
        log-prob difference exactly 0, whatever the threshold."""
        self.first_step = first_step
        self.ref_equal_tolerance, self.kl_tolerance = ref_equal_tolerance, kl_tolerance
        self.logprob_abs_diff_threshold = 0.0 if true_on_policy else logprob_abs_diff_threshold
        self.logprob_abs_diff_flag = "--true-on-policy-mode" if true_on_policy else None
        self.log_probs_low = -1.0 - log_probs_margin
        self.first_step_grad_norm_max = first_step_grad_norm_max
        skip = dict(not_run or {})
        if not check_kl:
            for rule_id in KL_RULES:
                skip.setdefault(rule_id, "--ci-disable-kl-checker")
        self.rules = {
            rule_id: _Rule(*spec, skip=skip.get(rule_id)) for rule_id, spec in self._specs().items()
        }

    def _specs(self) -> dict[str, tuple[str, str, str]]:
        """rule id -> (table name, bound, the metric whose absence keeps it from running), in table order."""
        low = "-inf" if self.log_probs_low == -math.inf else f"{self.log_probs_low:g}"
        zero_kl, zero_ref = _within("== 0", self.kl_tolerance), _within("== 0", self.ref_equal_tolerance)
        diff = "train/train_rollout_logprob_abs_diff"
        grad_max = f"<= {self.first_step_grad_norm_max:g} (--ci-first-step-grad-norm-max)"
        return {
            "no_nan": ("NaN metrics per step", "== 0", "any metric"),
            "log_probs_range": (
                "rollout/log_probs (--ci-log-probs-margin)",
                f"in ({low}, 0)",
                "rollout/log_probs",
            ),
            "logprob_abs_diff": (f"{diff} (mean, @first)", self._abs_diff_bound(), diff),
            "train/ppo_kl@first": ("train/ppo_kl@first (every rollout)", zero_kl, "train/ppo_kl@first"),
            "train/pg_clipfrac@first": (
                "train/pg_clipfrac@first (every rollout)",
                "== 0",
                "train/pg_clipfrac@first",
            ),
            "log_probs_equal_ref": (
                "|log_probs - ref_log_probs| (first step)",
                zero_ref,
                "rollout/ref_log_probs",
            ),
            "kl_loss_first": ("train/kl_loss@first (first step)", zero_kl, "train/kl_loss@first"),
            "grad_norm_first": ("train/grad_norm@first (first step)", grad_max, "train/grad_norm@first"),
        }

    def _abs_diff_bound(self) -> str:
        bound = f"<= {self.logprob_abs_diff_threshold:g}"
        return f"{bound} ({self.logprob_abs_diff_flag})" if self.logprob_abs_diff_flag else bound

    @property
    def counts(self) -> dict[str, int]:
        """How often each rule ran (not at all when its metrics are absent or it is skipped)."""
        return {rule_id: rule.count for rule_id, rule in self.rules.items() if rule.count}

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._no_nan(step, metrics)
        self._log_probs_range(step, metrics)
        for key in ("train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff@first"):
            self._upper_bound(
                "logprob_abs_diff", step, metrics, key, self.logprob_abs_diff_threshold,
                flag=self.logprob_abs_diff_flag,
            )  # fmt: skip
        self._zero("train/ppo_kl@first", step, metrics, "train/ppo_kl@first", self.kl_tolerance)
        self._zero("train/pg_clipfrac@first", step, metrics, "train/pg_clipfrac@first", 0.0)
        if step == self.first_step:
            self._policy_equals_reference(step, metrics)
            self._zero("kl_loss_first", step, metrics, "train/kl_loss@first", self.kl_tolerance)
            self._upper_bound(
                "grad_norm_first", step, metrics, "train/grad_norm@first", self.first_step_grad_norm_max,
                flag="--ci-first-step-grad-norm-max",
            )  # fmt: skip

    def rows(self) -> list[CheckRow]:
        return [rule.row() for rule in self.rules.values()]

    def _active(self, rule_id: str, value: float | None) -> _Rule | None:
        rule = self.rules[rule_id]
        return rule if value is not None and rule.skip is None else None

    def _no_nan(self, step: int, metrics: Mapping[str, float]) -> None:
        nan_keys = [key for key, value in metrics.items() if isinstance(value, float) and math.isnan(value)]
        key = nan_keys[0] if nan_keys else ""
        self.rules["no_nan"].record(
            step, key, float(len(nan_keys)), not nan_keys, "a number, not NaN", shown=math.nan
        )

    def _log_probs_range(self, step: int, metrics: Mapping[str, float]) -> None:
        value = metrics.get("rollout/log_probs")
        if rule := self._active("log_probs_range", value):
            low = "-inf" if self.log_probs_low == -math.inf else f"{self.log_probs_low:g}"
            expected = f"{low} < value < 0" + ("" if low == "-inf" else " (--ci-log-probs-margin)")
            rule.record(step, "rollout/log_probs", value, self.log_probs_low < value < 0, expected)

    def _upper_bound(self, rule_id, step, metrics, key, limit, flag: str | None = None) -> None:
        value = metrics.get(key)
        if rule := self._active(rule_id, value):
            rule.record(step, key, value, value <= limit, f"<= {limit:g}" + (f" ({flag})" if flag else ""))

    def _zero(self, rule_id, step, metrics, key, tolerance) -> None:
        value = metrics.get(key)
        if rule := self._active(rule_id, value):
            rule.record(step, key, value, abs(value) <= tolerance, _within("== 0", tolerance))

    def _policy_equals_reference(self, step: int, metrics: Mapping[str, float]) -> None:
        log_probs, ref = metrics.get("rollout/log_probs"), metrics.get("rollout/ref_log_probs")
        if log_probs is not None and (rule := self._active("log_probs_equal_ref", ref)):
            expected = _within(f"== rollout/ref_log_probs ({ref!r})", self.ref_equal_tolerance)
            difference = abs(log_probs - ref)  # the table shows the difference, the message both values
            ok = difference <= self.ref_equal_tolerance
            rule.record(step, "rollout/log_probs", difference, ok, expected, shown=log_probs)


KL_RULES = ("train/ppo_kl@first", "train/pg_clipfrac@first", "log_probs_equal_ref", "kl_loss_first")
"""The rules `--ci-disable-kl-checker` turns off."""
TRAINER_RULES = ("log_probs_range", "logprob_abs_diff", *KL_RULES, "grad_norm_first")
"""The rules whose metrics come from the trainer."""


class TextCheck(MetricCheck):
    """`rollout/text/*` against thresholds: a warning per bad rollout, or (fail=True) a failed check."""

    METRICS = (
        ("empty_ratio", "max_empty_ratio", "--ci-text-max-empty-ratio"),
        ("bad_char_ratio", "max_bad_char_ratio", "--ci-text-max-bad-char-ratio"),
        ("repetition", "max_repetition", "--ci-text-max-repetition"),
    )
    """(metric under rollout/text/, TextThresholds field, flag)."""

    def __init__(self, thresholds: TextThresholds, *, fail: bool) -> None:
        self.thresholds, self.fail = thresholds, fail
        self.rules = {
            name: _Rule(
                f"rollout/text/{name}", f"<= {getattr(thresholds, attr):g} ({flag})", f"rollout/text/{name}"
            )
            for name, attr, flag in self.METRICS
        }

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        text = {
            name: metrics[f"rollout/text/{name}"]
            for name, _, _ in self.METRICS
            if f"rollout/text/{name}" in metrics
        }
        if not self.fail:
            if reasons := text_verdict(text, self.thresholds):
                logger.warning(
                    "rollout %d: the responses do not look like language: %s", step, "; ".join(reasons)
                )
            return
        for name, attr, flag in self.METRICS:
            if name in text:
                limit = getattr(self.thresholds, attr)
                value = text[name]
                self.rules[name].record(
                    step, f"rollout/text/{name}", value, value <= limit, f"<= {limit:g} ({flag})"
                )

    def rows(self) -> list[CheckRow]:
        return [rule.row() for rule in self.rules.values()] if self.fail else []


class MetricThresholdCheck(MetricCheck):
    """At close, require at least one logged value of `key` >= `threshold` (e.g. eval/gsm8k >= 0.55)."""

    def __init__(self, key: str, threshold: float) -> None:
        self.key, self.threshold = key, threshold
        self.values: list[tuple[int, float]] = []
        """(step, value) of every logged value of the key."""
        self.verdict: str | None = None
        """`pass` or `FAIL` once on_close ran; None while the run has not ended well."""

    def on_log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.key in metrics:
            self.values.append((step, metrics[self.key]))

    def on_close(self) -> None:
        self.verdict = "FAIL"
        if not self.values:
            raise MetricCheckError(f"metric check: {self.key} was never logged (threshold {self.threshold})")
        if not any(value >= self.threshold for _, value in self.values):
            seen = ", ".join(f"step {step}: {value:g}" for step, value in self.values)
            raise MetricCheckError(f"metric check: {self.key} never reached {self.threshold} ({seen})")
        self.verdict = "pass"

    def rows(self) -> list[CheckRow]:
        name = f"{self.key} at least once (--ci-metric-checker-key)"
        if self.verdict is None:
            return [
                CheckRow(name=name, result="not run", measured="judged at the end of a run that ends well")
            ]
        best = max((value for _, value in self.values), default=None)
        count = len(self.values)
        measured = "never logged" if best is None else f"best {best:.4g} of {count} value{'s' * (count != 1)}"
        return [CheckRow(name=name, result=self.verdict, measured=measured, bound=f">= {self.threshold:g}")]


class GradNormSaver(MetricCheck):
    """`--ci-save-grad-norm PATH`: every optimizer step's train/grad_norm, rewritten to PATH after each step
    (so a run that fails later keeps what it measured).

    File: {"format_version": 1, "grad_norms": [{"rollout_id": 0, "step_index": 0, "grad_norm": 0.61}, ...]}
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries: list[dict[str, float | int]] = []

    def on_train_steps(self, step: int, per_step: Sequence[Mapping[str, float]]) -> None:
        for index, metrics in enumerate(per_step):
            if "train/grad_norm" in metrics:
                self.entries.append(
                    {"rollout_id": step, "step_index": index, "grad_norm": float(metrics["train/grad_norm"])}
                )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"format_version": GRAD_NORM_FORMAT_VERSION, "grad_norms": self.entries},
                                  indent=1) + "\n", encoding="utf-8")  # fmt: skip
        os.replace(tmp, self.path)

    def rows(self) -> list[CheckRow]:
        name = f"train/grad_norm saved to {self.path} (--ci-save-grad-norm)"
        if not self.entries:
            return [CheckRow(name=name, result="not run", measured="train/grad_norm never logged")]
        return [CheckRow(name=name, result="pass", measured=f"{len(self.entries)} optimizer steps")]


def load_grad_norms(path: str | Path) -> dict[tuple[int, int], float]:
    """{(rollout_id, step_index): grad_norm} from a --ci-save-grad-norm file; ValueError naming the file."""
    from clawrl.config.errors import ConfigError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"--ci-load-grad-norm {path}: no such file (write it with --ci-save-grad-norm)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--ci-load-grad-norm {path}: not a grad-norm file: {e}") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != GRAD_NORM_FORMAT_VERSION:
        raise ConfigError(
            f"--ci-load-grad-norm {path}: expected format_version {GRAD_NORM_FORMAT_VERSION} (a file "
            f"written by --ci-save-grad-norm), got {version!r}"
        )
    try:
        return {
            (int(e["rollout_id"]), int(e["step_index"])): float(e["grad_norm"]) for e in data["grad_norms"]
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"--ci-load-grad-norm {path}: bad grad_norms entry ({e!r})") from None


class GradNormComparer(MetricCheck):
    """`--ci-load-grad-norm PATH`: every optimizer step's train/grad_norm must match the saved one within
    `rtol` (|new - saved| <= rtol * |saved|); a step the file does not hold fails too."""

    def __init__(self, path: str | Path, rtol: float) -> None:
        self.path, self.rtol = Path(path), rtol
        self.saved = load_grad_norms(path)
        name = f"train/grad_norm vs {self.path} (--ci-load-grad-norm)"
        self.rule = _Rule(name, f"relative difference <= {rtol:g}", "train/grad_norm")

    def on_train_steps(self, step: int, per_step: Sequence[Mapping[str, float]]) -> None:
        for index, metrics in enumerate(per_step):
            if "train/grad_norm" in metrics:
                self._compare(step, index, float(metrics["train/grad_norm"]))

    def _compare(self, rollout_id: int, index: int, value: float) -> None:
        where = f"rollout {rollout_id} optimizer step {index}"
        saved = self.saved.get((rollout_id, index))
        if saved is None:
            self.rule.failed = True
            raise MetricCheckError(
                f"--ci-load-grad-norm: {self.path} holds no train/grad_norm for {where} "
                f"({len(self.saved)} saved steps); save it from a run over the same rollouts"
            )
        relative = abs(value - saved) / abs(saved) if saved else (0.0 if value == saved else math.inf)
        self.rule.count += 1
        self.rule.high = max(self.rule.high or (relative, rollout_id), (relative, rollout_id))
        self.rule.low = min(self.rule.low or (relative, rollout_id), (relative, rollout_id))
        if not abs(value - saved) <= self.rtol * abs(saved):
            self.rule.failed = True
            raise MetricCheckError(
                f"--ci-load-grad-norm: train/grad_norm = {value!r} at {where}, saved {saved!r} in "
                f"{self.path}: "
                f"relative difference {relative:.3g} > --ci-grad-norm-rtol {self.rtol:g}"
            )

    def rows(self) -> list[CheckRow]:
        return [self.rule.row()]


def format_check_table(checks: Sequence[MetricCheck]) -> str:
    """The end-of-run table of every check's rows ("" when no check has rows)."""
    rows = [row for check in checks for row in check.rows()]
    if not rows:
        return ""
    header = CheckRow(name="check", result="result", measured="measured (or why not run)", bound="bound")
    table = [header, *rows]
    widths = [max(len(getattr(row, column)) for row in table) for column in ("result", "name", "measured")]
    lines = ["checks:"]
    for row in table:
        cells = (row.result, row.name, row.measured)
        line = "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        lines.append(f"  {line}  {row.bound}".rstrip())
    return "\n".join(lines)


def build_checks(job: JobConfig) -> list[MetricCheck]:
    """The checks the job's flags ask for: the text check always (warning only without --ci-test), the
    --ci-test checks, the grad-norm file checks and the metric checker."""
    ci = job.ci
    thresholds = TextThresholds(
        max_empty_ratio=ci.ci_text_max_empty_ratio, max_bad_char_ratio=ci.ci_text_max_bad_char_ratio,
        max_repetition=ci.ci_text_max_repetition,
    )  # fmt: skip
    checks: list[MetricCheck] = []
    if ci.ci_test:
        checks.append(
            CITestChecks(
                check_kl=not ci.ci_disable_kl_checker,
                logprob_abs_diff_threshold=ci.ci_train_rollout_logprob_abs_diff_threshold,
                true_on_policy=job.model.uses_true_on_policy,
                log_probs_margin=ci.ci_log_probs_margin,
                first_step_grad_norm_max=ci.ci_first_step_grad_norm_max,
                not_run=not_run_reasons(job),
            )
        )
    checks.append(TextCheck(thresholds, fail=ci.ci_test))
    if ci.ci_save_grad_norm:
        checks.append(GradNormSaver(ci.ci_save_grad_norm))
    if ci.ci_load_grad_norm:
        checks.append(GradNormComparer(ci.ci_load_grad_norm, ci.ci_grad_norm_rtol))
    if ci.ci_test and ci.ci_metric_checker_key is not None:
        checks.append(MetricThresholdCheck(ci.ci_metric_checker_key, ci.ci_metric_checker_threshold))
    return checks


def not_run_reasons(job: JobConfig) -> dict[str, str]:
    """CITestChecks rule id -> why the job's configuration cannot run it (absent: it can)."""
    reasons: dict[str, str] = {}
    debug = getattr(job, "debug", None)
    if debug is not None and debug.debug_rollout_only:
        reasons.update(dict.fromkeys(TRAINER_RULES, "--debug-rollout-only: no trainer"))
    if job.ci.ci_disable_kl_checker:
        for rule_id in KL_RULES:
            reasons.setdefault(rule_id, "--ci-disable-kl-checker")
    if not (job.algo.use_kl_loss or job.algo.kl_coef != 0):
        reasons.setdefault("log_probs_equal_ref", "no reference model (--use-kl-loss / --kl-coef unset)")
    if not job.algo.use_kl_loss:
        reasons.setdefault("kl_loss_first", "no KL loss (--use-kl-loss unset)")
    return reasons


def _within(expected: str, tolerance: float) -> str:
    return expected if tolerance == 0 else f"{expected} within {tolerance:g}"


def _fail(key: str, step: int, value: float, expected: str) -> None:
    raise MetricCheckError(f"--ci-test: {key} = {value!r} at step {step}, expected {expected}")
