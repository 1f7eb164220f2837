"""`clawrl report` as a real process: writes the report for a logged run (exit 0), and exits 2 with one
error line naming the file (and line) for a missing, empty or malformed metrics.jsonl."""

from __future__ import annotations

import subprocess
import sys

from clawrl.metrics import MetricLogger

CLI = [sys.executable, "-m", "clawrl.cli.main", "report"]


def _report(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def _write_run(out_dir):
    with MetricLogger(out_dir, run_name="cli-run", config={"train": {"lr": 1e-6}}) as logger:
        for step in range(3):
            logger.log(step, {
                "rollout/raw_reward": 0.25 * step, "eval/toy": 0.5,
                "train": [{"train/ppo_kl": 0.0, "train/kl_loss": 0.01 * step, "train/entropy_loss": 2.0}],
                "perf/rollout_time": 1.0, "perf/train_time": 0.5,
            })  # fmt: skip


def test_report_writes_the_page_and_plots(tmp_path):
    _write_run(tmp_path / "run")
    done = _report(tmp_path / "run")
    assert done.returncode == 0, done.stderr
    index = tmp_path / "run" / "report" / "index.html"
    assert done.stdout == f"clawrl report: wrote {index}\n"
    html = index.read_text()
    for name in ("reward", "eval", "kl", "entropy", "step_time"):
        assert (tmp_path / "run" / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{name}.png"' in html
    assert "skipped: rollout/response_len/mean was not logged" in html


def test_report_out_dir(tmp_path):
    _write_run(tmp_path / "run")
    done = _report(tmp_path / "run", "--out", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "index.html").is_file() and not (tmp_path / "run" / "report").exists()


def test_missing_metrics_file_exits_2(tmp_path):
    done = _report(tmp_path / "nope")
    assert done.returncode == 2
    assert done.stderr == f"clawrl report: error: metrics file {tmp_path}/nope/metrics.jsonl does not exist\n"
    assert done.stdout == ""


def test_empty_and_malformed_metrics_exit_2(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    done = _report(tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        f"clawrl report: error: metrics file {tmp_path}/metrics.jsonl is empty: no step was logged\n",
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, oops}\n')
    done = _report(tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(f"clawrl report: error: {tmp_path}/metrics.jsonl:2: not valid JSON")
    assert not (tmp_path / "report").exists()


def test_report_is_listed_in_help():
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "report" in done.stdout
