"""MetricLogger: metrics.jsonl round trip (NaN/inf as strings), config.json, train-list flattening, step
order, resume semantics, TensorBoard event files (read back with EventAccumulator), the W&B error."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from clawrl.metrics import (
    MetricLogger,
    MetricsFileError,
    flatten_train_metrics,
    normalize_metrics,
    read_metrics,
    read_run_info,
)
from clawrl.metrics.checks import MetricCheck


def _steps_and(records, key):
    return [(r["step"], r[key]) for r in records if key in r]


def test_jsonl_round_trip_with_non_finite_values(tmp_path):
    with MetricLogger(tmp_path, run_name="r") as logger:
        logger.log(
            0, {"rollout/raw_reward": 0.25, "train/grad_norm": math.nan, "a": math.inf, "b": -math.inf}
        )
        logger.log(1, {"rollout/raw_reward": 0.5, "count": 3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert first["train/grad_norm"] == "NaN" and first["a"] == "Infinity" and first["b"] == "-Infinity"
    assert list(first)[:2] == ["step", "time"] and first["step"] == 0
    records = read_metrics(tmp_path)
    assert records[0]["rollout/raw_reward"] == 0.25
    assert math.isnan(records[0]["train/grad_norm"])
    assert records[0]["a"] == math.inf and records[0]["b"] == -math.inf
    assert records[1]["count"] == 3 and isinstance(records[1]["count"], int)
    assert abs(records[1]["time"] - records[0]["time"]) < 5


def test_each_line_is_flushed_when_logged(tmp_path):
    logger = MetricLogger(tmp_path, run_name="r")
    logger.log(0, {"x": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["x"] == 1.0  # readable before close()
    logger.close()


def test_config_json_written_once_with_secrets_redacted(tmp_path):
    config = {"logging": {"wandb_key": "secret-123", "run_name": "r"}, "train": {"lr": 1e-6}}
    MetricLogger(tmp_path, run_name="r", config=config).close()
    info = read_run_info(tmp_path)
    assert info["run_name"] == "r"
    assert info["config"] == {"logging": {"wandb_key": "<redacted>", "run_name": "r"}, "train": {"lr": 1e-6}}
    assert "secret-123" not in (tmp_path / "config.json").read_text()
    assert config["logging"]["wandb_key"] == "secret-123"  # the caller's dict is untouched


def test_flatten_train_metrics_mean_and_first():
    steps = [
        {"train/loss": 1.0, "train/ppo_kl": 0.0, "train/lr": 1e-6},
        {"train/loss": 2.0, "train/ppo_kl": 0.3, "train/lr": 2e-6},
        {"train/loss": 6.0, "train/ppo_kl": 0.6, "train/lr": 3e-6, "train/kl_loss": 0.5},
    ]
    flat = flatten_train_metrics(steps)
    assert flat["train/loss"] == 3.0 and flat["train/loss@first"] == 1.0
    assert flat["train/ppo_kl"] == pytest.approx(0.3) and flat["train/ppo_kl@first"] == 0.0
    assert flat["train/lr"] == pytest.approx(2e-6) and flat["train/lr@first"] == 1e-6
    # a key reported only by some steps: mean over those, @first = the first step that reported it
    assert flat["train/kl_loss"] == 0.5 and flat["train/kl_loss@first"] == 0.5
    assert flatten_train_metrics([]) == {}


def test_log_flattens_train_list_and_unwraps_scalars(tmp_path):
    with MetricLogger(tmp_path, run_name="r") as logger:
        flat = logger.log(
            0,
            {
                "train": [{"train/loss": torch.tensor(1.0)}, {"train/loss": np.float32(3.0)}],
                "rollout/raw_reward": np.float64(0.5),
                "perf/n": np.int64(7),
                "flag": True,
            },
        )
    assert flat == {
        "train/loss": 2.0,
        "train/loss@first": 1.0,
        "rollout/raw_reward": 0.5,
        "perf/n": 7,
        "flag": 1,
    }
    record = read_metrics(tmp_path)[0]
    assert {k: record[k] for k in flat} == flat


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"x": "high"}, "metric 'x' must be a number, got 'high'"),
        ({"x": None}, "metric 'x' must be a number, got None"),
        ({"x": torch.ones(2)}, "metric 'x' must be a single number"),
        ({"step": 1.0}, "metric name 'step' is reserved"),
        ({"train": [{"train/loss": "x"}]}, "metric train[0]['train/loss'] must be a number"),
    ],
)
def test_bad_metric_values_are_named(metrics, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        normalize_metrics(metrics)


def test_steps_must_increase(tmp_path):
    with MetricLogger(tmp_path, run_name="r") as logger:
        logger.log(2, {"x": 1.0})
        with pytest.raises(ValueError, match="step 2 <= last logged step 2"):
            logger.log(2, {"y": 1.0})
        with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
            logger.log(-1, {"y": 1.0})
    with pytest.raises(RuntimeError, match=r"closed; log\(step=3\) came after close\(\)"):
        logger.log(3, {"x": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [2]


def _run(tmp_path, run_name, steps, **kwargs):
    with MetricLogger(tmp_path, run_name=run_name, **kwargs) as logger:
        for step in steps:
            logger.log(step, {"x": float(step), "run": float(len(run_name))})


def test_refuses_existing_metrics_unless_resuming(tmp_path):
    _run(tmp_path, "first", [0, 1, 2])
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(
        FileExistsError, match=r"metrics.jsonl already holds 3 logged step\(s\) of run 'first'"
    ):
        MetricLogger(tmp_path, run_name="second")
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert read_run_info(tmp_path)["run_name"] == "first"  # config.json untouched too


def test_empty_existing_file_is_reused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n")
    _run(tmp_path, "r", [0])
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]


def test_resume_step_drops_lines_from_that_step_on(tmp_path):
    _run(tmp_path, "r", [0, 1, 2, 3])
    _run(tmp_path, "r", [2, 3, 4], resume_step=2)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["x"] for r in records] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_resume_true_cuts_at_the_first_step_logged(tmp_path):
    _run(tmp_path, "r", [0, 1, 2, 3])  # crashed after step 3; the checkpoint was at step 1
    with MetricLogger(tmp_path, run_name="r", resume=True) as logger:
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]  # nothing cut before a log
        logger.log(2, {"x": 20.0})
        with pytest.raises(ValueError, match="step 2 <= last logged step 2"):
            logger.log(2, {"x": 9.0})
        logger.log(3, {"x": 30.0})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 20.0), (3, 30.0)]


def test_resume_true_after_the_last_step_keeps_every_line(tmp_path):
    _run(tmp_path, "r", [0, 1])
    _run(tmp_path, "r", [2], resume=True)
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_resume_step_below_the_first_log_is_an_error(tmp_path):
    _run(tmp_path, "r", [0, 1, 2])
    logger = MetricLogger(tmp_path, run_name="r", resume_step=2)
    with pytest.raises(ValueError, match="step 1 <= last logged step 1"):
        logger.log(1, {"x": 1.0})
    logger.close()


def test_resume_step_must_be_a_step(tmp_path):
    with pytest.raises(ValueError, match="resume_step must be an integer >= 0, got -1"):
        MetricLogger(tmp_path, run_name="r", resume_step=-1)


def test_resume_into_a_fresh_directory_starts_a_new_file(tmp_path):
    _run(tmp_path / "new", "r", [5], resume_step=5)
    assert [r["step"] for r in read_metrics(tmp_path / "new")] == [5]


@pytest.mark.parametrize("resume_args", [{"resume_step": 1}, {"resume": True}])
def test_resume_reports_a_malformed_existing_line_at_start(tmp_path, resume_args):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": 1, "x": \n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not valid JSON"):
        MetricLogger(tmp_path, run_name="r", **resume_args)


def test_tensorboard_scalars_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricLogger(tmp_path, run_name="r", use_tensorboard=True) as logger:
        logger.log(0, {"rollout/raw_reward": 0.25, "train": [{"train/loss": 1.0}, {"train/loss": 2.0}]})
        logger.log(1, {"rollout/raw_reward": 0.75})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"rollout/raw_reward", "train/loss", "train/loss@first"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("rollout/raw_reward")] == [(0, 0.25), (1, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(0, 1.5)]


@pytest.mark.parametrize("resume_args", [{"resume_step": 1}, {"resume": True}])
def test_tensorboard_resume_purges_steps_from_the_resume_step(tmp_path, resume_args):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, "r", [0, 1, 2], use_tensorboard=True)
    with MetricLogger(tmp_path, run_name="r", use_tensorboard=True, **resume_args) as logger:
        logger.log(1, {"x": 10.0})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(0, 0.0), (1, 10.0)]


def test_wandb_missing_gives_one_clear_error_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(
        ImportError, match=r"^--use-wandb needs the wandb package: pip install 'clawrl\[wandb\]'$"
    ):
        MetricLogger(tmp_path / "run", run_name="r", use_wandb=True)
    assert not (tmp_path / "run").exists()


def test_wandb_mode_is_checked_first(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        ValueError, match=r"--wandb-mode must be one of \['online', 'offline', 'disabled'\], got 'cloud'"
    ):
        MetricLogger(tmp_path / "run", run_name="r", use_wandb=True, wandb_mode="cloud")
    monkeypatch.setenv("WANDB_MODE", "sideways")
    with pytest.raises(ValueError, match="got 'sideways'"):
        MetricLogger(tmp_path / "run", run_name="r", use_wandb=True, wandb_mode=None)
    assert not (tmp_path / "run").exists()


class _Recorder(MetricCheck):
    def __init__(self):
        self.seen, self.closed = [], 0

    def on_log(self, step, metrics):
        self.seen.append((step, dict(metrics)))

    def on_close(self):
        self.closed += 1


def test_checks_see_flat_metrics_after_the_line_is_written(tmp_path):
    class LineCounter(_Recorder):
        def on_log(self, step, metrics):
            super().on_log(step, metrics)
            self.lines = len(read_metrics(tmp_path))

    check = LineCounter()
    logger = MetricLogger(tmp_path, run_name="r", checks=[check])
    logger.log(0, {"train": [{"train/ppo_kl": 0.0}, {"train/ppo_kl": 0.5}]})
    assert check.seen == [(0, {"train/ppo_kl": 0.25, "train/ppo_kl@first": 0.0})]
    assert check.lines == 1
    logger.close()
    logger.close()
    assert check.closed == 1


def test_context_exit_on_error_skips_end_of_run_checks(tmp_path):
    check = _Recorder()
    with pytest.raises(KeyError), MetricLogger(tmp_path, run_name="r", checks=[check]) as logger:
        logger.log(0, {"x": 1.0})
        raise KeyError("boom")
    assert check.closed == 0
    assert logger._file.closed
