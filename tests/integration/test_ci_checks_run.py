"""`clawrl train --ci-test` as a person reads it: a real tiny run (Ray, engine actor over HTTP, one FSDP2 CPU
rank) whose checks fail or pass.

- A first-step check made to fail (`--ci-first-step-grad-norm-max 1e-12`) while a metric checker is also set
  on a metric that is never logged: exit code 1, and the last line printed names the first-step check, its
  value and its bound; no traceback, no second error from the metric checker at close.
- A passing run prints the table of every check: measured values, bounds, and the checks that could not run
  with the reason (no reference model without --use-kl-loss); --ci-save-grad-norm writes each optimizer
  step's grad norm.

Each run is a `clawrl` subprocess (~30 s on 2 CPU cores).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from loop_assets import REWARD, build_loop_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("ci_checks"), num_train=64, num_eval=8)


def _train(assets, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `clawrl train` on the tiny model; returns the result and the non-empty lines of the combined
    stdout + stderr, in the order the user sees them."""
    flags = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
        "--rollout-temperature", "0.9", "--global-batch-size", "8", "--lr", "1e-3",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--num-rollout", "2",
        # a random tiny model's log-probs are near -log(2048) = -7.6, far below a trained model's (-1, 0)
        "--ci-test", "--ci-log-probs-margin", "10",
        "--output-dir", str(out), "--run-name", out.name, *extra,
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )  # fmt: skip
    return result, [line for line in result.stdout.splitlines() if line.strip()]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_failed_first_step_check_is_the_last_line(assets, tmp_path):
    out = tmp_path / "fail"
    result, lines = _train(
        assets, out, "--use-kl-loss", "--kl-loss-coef", "0.0", "--ci-first-step-grad-norm-max", "1e-12",
        "--ci-metric-checker-key", "eval/toy", "--ci-metric-checker-threshold", "0.5",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-5000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0]  # the run stopped at the failing step, which is on disk
    grad_norm = rows[0]["train/grad_norm@first"]
    assert lines[-1] == (
        f"clawrl train: check failed: --ci-test: train/grad_norm@first = {grad_norm!r} at step 0, "
        "expected <= 1e-12 (--ci-first-step-grad-norm-max)"
    ), "\n".join(lines[-20:])
    assert "Traceback" not in result.stdout
    assert "was never logged" not in result.stdout  # the metric checker's close-time verdict did not run
    table = lines[lines.index("checks:") :]
    assert any(re.match(r"  FAIL +train/grad_norm@first \(first step\) ", line) for line in table)
    assert any(re.match(r"  pass +\|log_probs - ref_log_probs\| \(first step\) +0 \(step 0\) +== 0$", line)
               for line in table)  # fmt: skip
    assert any(re.match(r"  not run +eval/toy at least once .* judged at the end of a run that ends well", line)
               for line in table)  # fmt: skip


def test_passing_run_prints_the_check_table(assets, tmp_path):
    out = tmp_path / "pass"
    norms = tmp_path / "grad_norms.json"
    result, lines = _train(
        assets, out, "--eval-prompt-data", "toy", assets["eval"], "--eval-interval", "1",
        "--ci-metric-checker-key", "eval/toy", "--ci-metric-checker-threshold", "0.0",
        "--ci-save-grad-norm", str(norms),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:]
    rows = _rows(out)
    table = lines[lines.index("checks:") :]
    results = {}
    for line in table[2:]:
        match = re.match(r"  (pass|FAIL|not run) +(\S.*?)  +", line)
        if match:
            results[match.group(2)] = match.group(1)
    assert results == {
        "NaN metrics per step": "pass",
        "rollout/log_probs (--ci-log-probs-margin)": "pass",
        "train/train_rollout_logprob_abs_diff (mean, @first)": "pass",
        "train/ppo_kl@first (every rollout)": "pass",
        "train/pg_clipfrac@first (every rollout)": "pass",
        "|log_probs - ref_log_probs| (first step)": "not run",
        "train/kl_loss@first (first step)": "not run",
        "train/grad_norm@first (first step)": "pass",
        "rollout/text/empty_ratio": "pass",
        "rollout/text/bad_char_ratio": "pass",
        "rollout/text/repetition": "pass",
        f"train/grad_norm saved to {norms} (--ci-save-grad-norm)": "pass",
        "eval/toy at least once (--ci-metric-checker-key)": "pass",
    }, "\n".join(table)
    assert any("no reference model (--use-kl-loss / --kl-coef unset)" in line for line in table)
    first = next(line for line in table if "train/grad_norm@first" in line)
    assert f"{rows[0]['train/grad_norm@first']:.4g} (step 0)" in first and "<= 10 " in first
    saved = json.loads(norms.read_text())["grad_norms"]
    # one optimizer step per rollout (global batch = the rollout's 8 samples)
    assert saved == [
        {"rollout_id": r["step"], "step_index": 0, "grad_norm": r["train/grad_norm"]} for r in rows[:2]
    ]
