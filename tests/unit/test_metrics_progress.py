"""The console progress line: exact strings, parts only for logged metrics, in a fixed order."""

from __future__ import annotations

import io

from clawrl.metrics import format_progress, print_progress

FULL = {
    "rollout/raw_reward": 0.404,
    "rollout/rewards": 0.0,
    "eval/gsm8k": 0.5512,
    "eval/gsm8k-truncated_ratio": 0.1,
    "eval/aime": 0.1,
    "eval/aime/pass@1": 0.1,
    "train/kl_loss": 0.00123,
    "train/ppo_kl": 0.0,
    "train/ppo_kl@first": 0.0,
    "rollout/response_len/mean": 57.4,
    "perf/rollout_time": 12.34,
    "perf/train_time": 4.06,
    "perf/update_weights_time": 0.21,
    "perf/eval_time": 3.0,
    "perf/log_probs_time": 1.0,
    "perf/tokens_per_gpu_per_sec": 1234.5,
}


def test_full_line():
    assert format_progress(2, 20, FULL) == (
        "[rollout 3/20] reward 0.40 | eval aime 0.10 gsm8k 0.55 | kl 1.2e-03 ppo_kl 0.0e+00 | resp 57 tok | "
        "rollout 12.3s train 4.1s sync 0.2s eval 3.0s | 1.2k tok/s/gpu"
    )


def test_only_logged_parts_appear():
    assert format_progress(0, 3, {}) == "[rollout 1/3]"
    assert format_progress(0, 3, {"rollout/raw_reward": 1.0, "perf/train_time": 0.04}) == (
        "[rollout 1/3] reward 1.00 | train 0.0s"
    )
    assert format_progress(9, 10, {"train/ppo_kl": 2.5e-5, "perf/tokens_per_gpu_per_sec": 57.2}) == (
        "[rollout 10/10] ppo_kl 2.5e-05 | 57 tok/s/gpu"
    )
    assert format_progress(1, 3, {"rollout/rewards": 0.3, "eval/math-500": 0.125}) == (
        "[rollout 2/3] eval math-500 0.12"
    )


def test_throughput_units():
    line = format_progress(0, 1, {"perf/tokens_per_gpu_per_sec": 2.5e6})
    assert line == "[rollout 1/1] 2.5M tok/s/gpu"


def test_print_progress_prints_and_returns_the_line():
    out = io.StringIO()
    line = print_progress(4, 5, {"rollout/raw_reward": 0.5}, file=out)
    assert line == "[rollout 5/5] reward 0.50"
    assert out.getvalue() == line + "\n"
