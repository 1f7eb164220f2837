"""The run report on synthetic runs written by the real MetricLogger: every PNG (valid, 800x400) and an
index.html referencing each; skipped plots noted; missing, empty and malformed metrics files named."""

from __future__ import annotations

import math
import struct

import pytest

from clawrl.metrics import MetricLogger, MetricsFileError
from clawrl.metrics.jsonl import read_metrics
from clawrl.metrics.plots import Run, plot_kl, plot_mismatch, step_time_phases
from clawrl.metrics.report import build_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ("reward", "eval", "kl", "mismatch", "entropy", "response_length", "step_time")
CONFIG = {
    "rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 4},
    "train": {"lr": 1e-6, "global_batch_size": 32},
    "logging": {"wandb_key": "secret-abc", "run_name": "demo-run"},
}


def _full_step(step: int) -> dict:
    metrics = {
        "rollout/raw_reward": 0.1 * step,
        "rollout/rewards": 0.0,
        "rollout/log_probs": -2.0 + 0.01 * step,
        "rollout/ref_log_probs": -2.0,
        "rollout/rollout_log_probs": -2.0 + 0.011 * step,
        "rollout/response_len/mean": 40.0 + step,
        "rollout/response_len/min": 10.0,
        "rollout/response_len/max": 80.0 + step,
        "train": [
            {
                "train/ppo_kl": 0.0,
                "train/kl_loss": 0.001 * step,
                "train/entropy_loss": 3.0 - 0.1 * step,
                "train/train_rollout_logprob_abs_diff": 0.01,
            },
            {
                "train/ppo_kl": 0.002,
                "train/kl_loss": 0.001 * step,
                "train/entropy_loss": 3.0 - 0.1 * step,
                "train/train_rollout_logprob_abs_diff": 0.03,
            },
        ],
        "perf/rollout_time": 2.0,
        "perf/train_time": 1.0 + 0.1 * step,
        "perf/log_probs_time": 0.3,  # inside train: not stacked
        "perf/update_weights_time": 0.2,
        "perf/step_time": 3.5 + 0.1 * step,
        "perf/tokens_per_gpu_per_sec": 1000.0,
    }
    if step % 3 == 0:
        metrics.update({"eval/gsm8k": 0.2 + 0.05 * step, "eval/math": 0.1, "perf/eval_time": 0.5})
    return metrics


def _write_run(out_dir, steps, make=_full_step, config=CONFIG, run_name="demo-run"):
    with MetricLogger(out_dir, run_name=run_name, config=config) as logger:
        for step in steps:
            logger.log(step, make(step))


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_full_run_writes_every_plot_and_the_page(tmp_path):
    _write_run(tmp_path, range(7))
    index = build_report(tmp_path)
    assert index == tmp_path / "report" / "index.html"
    html = index.read_text()
    for name in ALL_PLOTS:
        png = tmp_path / "report" / f"{name}.png"
        assert png.stat().st_size > 5000  # a drawn plot, not a blank canvas
        assert _png_size(png) == (800, 400)
        assert f'<img src="{name}.png"' in html
    assert 'class="skipped"' not in html
    assert "<h1>demo-run</h1>" in html and "7 logged step(s), steps 0..6" in html
    # config summary (leaf names in SUMMARY_FIELDS order) and the redacted key
    assert '<tr><td>rollout.rollout_batch_size</td><td class="num">8</td></tr>' in html
    assert "secret-abc" not in html and "&lt;redacted&gt;" in html
    # final values: last logged value and its step (eval last ran at step 6)
    assert '<tr><td>rollout/raw_reward</td><td class="num">0.6</td><td class="num">6</td></tr>' in html
    assert '<tr><td>eval/gsm8k</td><td class="num">0.5</td><td class="num">6</td></tr>' in html
    assert '<tr><td>train/ppo_kl@first</td><td class="num">0</td><td class="num">6</td></tr>' in html


def test_step_time_stacks_top_level_phases_only():
    keys = {"perf/rollout_time", "perf/train_time", "perf/log_probs_time", "perf/actor_train_time",
            "perf/step_time", "perf/tokens_per_gpu_per_sec", "perf/update_weights_time"}  # fmt: skip
    assert step_time_phases(keys) == ["perf/rollout_time", "perf/train_time", "perf/update_weights_time"]
    assert step_time_phases({"perf/eval_time", "perf/zeta_time", "perf/rollout_time", "perf/alpha_time"}) == [
        "perf/rollout_time",
        "perf/eval_time",
        "perf/alpha_time",
        "perf/zeta_time",
    ]
    # without a loop-level train phase the trainer's own timers are the breakdown
    assert step_time_phases({"perf/log_probs_time", "perf/actor_train_time", "perf/step_time"}) == [
        "perf/log_probs_time",
        "perf/actor_train_time",
    ]


def test_missing_metrics_skip_their_plots_with_a_note(tmp_path):
    _write_run(tmp_path, range(7))
    build_report(tmp_path)  # an earlier, full report in the same place
    (tmp_path / "metrics.jsonl").unlink()
    _write_run(tmp_path, range(3), make=lambda s: {"rollout/raw_reward": 0.5, "train/ppo_kl": math.nan})
    html = build_report(tmp_path).read_text()
    written = sorted(p.stem for p in (tmp_path / "report").glob("*.png"))
    assert written == ["kl", "reward"]  # stale PNGs of now-skipped plots are removed
    assert '<p class="skipped">skipped: no eval/&lt;name&gt; metric was logged (no eval ran)</p>' in html
    assert "skipped: train/entropy_loss was not logged" in html
    assert "skipped: rollout/response_len/mean was not logged" in html
    assert (
        "skipped: neither train/train_rollout_logprob_abs_diff nor rollout/rollout_log_probs was logged"
        in html
    )
    assert "skipped: no perf/&lt;phase&gt;_time metric was logged" in html
    assert '<tr><td>train/ppo_kl</td><td class="num">NaN</td><td class="num">2</td></tr>' in html


def test_without_config_json_the_page_says_so(tmp_path):
    _write_run(tmp_path / "run7", [0], make=lambda s: {"rollout/raw_reward": 1.0})
    (tmp_path / "run7" / "config.json").unlink()
    html = build_report(tmp_path / "run7", tmp_path / "elsewhere").read_text()
    assert (tmp_path / "elsewhere" / "reward.png").is_file()
    assert "<h1>run7</h1>" in html
    assert "no config.json in the output directory: config not shown" in html


def test_missing_metrics_file(tmp_path):
    with pytest.raises(MetricsFileError, match=rf"^metrics file {tmp_path}/metrics.jsonl does not exist$"):
        build_report(tmp_path)


def test_empty_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n\n")
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl is empty: no step was logged"):
        build_report(tmp_path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"step": 1, "x": }', "not valid JSON (Expecting value at column 18)"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"x": 1.0}', "'step' must be an integer, got None"),
    ],
)
def test_malformed_line_is_named(tmp_path, line, message):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1.0}\n\n' + line + "\n")
    with pytest.raises(MetricsFileError) as info:
        build_report(tmp_path)
    assert str(info.value) == f"{tmp_path}/metrics.jsonl:3: {message}"


def _one_step_per_rollout(step: int) -> dict:
    """A run as `clawrl train` logs it with one optimizer step per rollout: train/ppo_kl is 0 by construction."""
    return {
        "rollout/log_probs": [-7.6190, -7.6222, -7.6300][step],
        "rollout/ref_log_probs": [-7.6190, -7.6236, -7.6400][step],
        "rollout/rollout_log_probs": [-7.6190, -7.6222, -7.6300][step],
        "train": [{"train/ppo_kl": 0.0, "train/kl_loss": [0.0, 0.0014, 0.01][step],
                   "train/train_rollout_logprob_abs_diff": [2.0e-7, 2.1e-7, 2.2e-7][step]}],
    }  # fmt: skip


def _drawn_lines(fig) -> dict[str, list[float]]:
    return {line.get_label(): [float(y) for y in line.get_ydata()] for line in fig.axes[0].get_lines()}


def _run(tmp_path, make, steps=range(3)) -> Run:
    _write_run(tmp_path, steps, make=make)
    return Run(records=read_metrics(tmp_path / "metrics.jsonl"))


def test_kl_plot_leaves_out_a_ppo_kl_that_is_always_zero(tmp_path):
    fig = plot_kl(_run(tmp_path, _one_step_per_rollout))
    assert fig.axes[0].get_title() == "KL to the reference\n(train/ppo_kl: 0 at every step, not drawn)"
    lines = _drawn_lines(fig)
    assert list(lines) == ["train/kl_loss", "rollout/log_probs - rollout/ref_log_probs"]
    assert lines["train/kl_loss"] == [0.0, 0.0014, 0.01]
    # -7.6222 - -7.6236 = 0.0014, -7.6300 - -7.6400 = 0.0100
    assert lines["rollout/log_probs - rollout/ref_log_probs"] == pytest.approx([0.0, 0.0014, 0.01], abs=1e-9)


def test_mismatch_plot_draws_the_trainer_engine_gap(tmp_path):
    fig = plot_mismatch(_run(tmp_path, _one_step_per_rollout))
    lines = _drawn_lines(fig)
    assert (
        fig.axes[0].get_title()
        == "Trainer vs engine log-probs\n(rollout/log_probs - rollout/rollout_log_probs: 0 at every step, not drawn)"
    )
    assert list(lines) == ["train/train_rollout_logprob_abs_diff"]
    assert lines["train/train_rollout_logprob_abs_diff"] == pytest.approx([2.0e-7, 2.1e-7, 2.2e-7])


def test_series_that_are_all_zero_skip_the_plot_with_the_reason(tmp_path):
    def flat(step: int) -> dict:
        return {"train/ppo_kl": 0.0, "train/kl_loss": 0.0, "train/train_rollout_logprob_abs_diff": 0.0}

    run = _run(tmp_path, flat)
    assert plot_kl(run) == "train/kl_loss and train/ppo_kl: 0 at every logged step, nothing to draw"
    assert (
        plot_mismatch(run) == "train/train_rollout_logprob_abs_diff: 0 at every logged step, nothing to draw"
    )
    html = build_report(tmp_path).read_text()
    assert "skipped: train/kl_loss and train/ppo_kl: 0 at every logged step, nothing to draw" in html
    assert not (tmp_path / "report" / "kl.png").exists()
    assert plot_kl(Run(records=[{"step": 0, "rollout/raw_reward": 1.0}])) == (
        "none of train/kl_loss, rollout/log_probs with rollout/ref_log_probs, train/ppo_kl was logged"
    )
