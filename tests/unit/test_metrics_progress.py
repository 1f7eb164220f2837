"""The console progress line (exact strings, parts only for logged metrics, in a fixed order) and the
progress bar of a rollout in flight (formatting, rates and ETA by hand, terminal vs plain-line output)."""

from __future__ import annotations

import io

import pytest

from clawrl.config.errors import ConfigError
from clawrl.config.logs import LoggingConfig
from clawrl.data.sample import Sample
from clawrl.metrics import format_progress, print_progress
from clawrl.metrics.progress import (
    ProgressBar,
    RolloutCounter,
    format_bar,
    format_duration,
)

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


# ------------------------------------------------------------------------------------------- progress bar


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_bar_line_rates_and_eta():
    # 12 of 32 samples in 3 s: 4.0 samples/s, 1536 tokens / 3 s = 512 tok/s, 20 left / 4.0 = 5 s
    assert format_bar("rollout 3/20", 12, 32, 1536, 3.0) == (
        "rollout 3/20 |########------------| 12/32 samples 38% | 4.0 samples/s 512 tok/s | 3s, ETA 5s"
    )
    # 100 of 1000 in 250 s: 0.4 samples/s, 2.5M tokens / 250 s = 10.0k tok/s, 900 / 0.4 = 2250 s = 37m30s
    assert format_bar("rollout 1/5", 100, 1000, 2_500_000, 250.0) == (
        "rollout 1/5 |##------------------| 100/1000 samples 10% | 0.4 samples/s 10.0k tok/s | 4m10s, ETA 37m30s"
    )


def test_bar_before_the_first_sample_and_past_the_target():
    assert (
        format_bar("rollout 1/2", 0, 32, 0, 1.4) == "rollout 1/2 |--------------------| 0/32 samples 0% | 1s"
    )
    # over-sampling finished 40 samples for a batch of 32: shown as 32/32, rate counts all 40
    assert format_bar("rollout 2/2", 40, 32, 8000, 10.0) == (
        "rollout 2/2 |####################| 32/32 samples 100% | 4.0 samples/s 800 tok/s | 10s, ETA 0s"
    )


def test_durations():
    assert [format_duration(s) for s in (0, 4.4, 59.6, 125, 3599, 3725, -1)] == [
        "0s", "4s", "1m00s", "2m05s", "59m59s", "1h02m", "0s",
    ]  # fmt: skip


def test_counter_counts_samples_and_tokens():
    clock = FakeClock(100.0)
    counter = RolloutCounter(clock=clock)
    counter.start(32)
    counter.add([Sample(response_length=10), Sample(response_length=20)])
    counter.add([Sample(response_length=5)])
    clock.now = 103.5
    assert counter.snapshot() == {"done": 3, "total": 32, "tokens": 35, "elapsed_s": 3.5}
    counter.start(8)  # the next rollout starts from zero
    assert counter.snapshot() == {"done": 0, "total": 8, "tokens": 0, "elapsed_s": 0.0}


def _counts(done: int, elapsed: float) -> dict:
    return {"done": done, "total": 8, "tokens": 10 * done, "elapsed_s": elapsed}


def test_terminal_bar_redraws_in_place_and_ends_its_line():
    out = io.StringIO()
    bar = ProgressBar("rollout 1/1", file=out, tty=True)
    bar.update(_counts(0, 0.5))
    bar.update(_counts(4, 2.0))
    bar.close()
    first = "rollout 1/1 |--------------------| 0/8 samples 0% | 0s"
    second = "rollout 1/1 |##########----------| 4/8 samples 50% | 2.0 samples/s 20 tok/s | 2s, ETA 2s"
    assert out.getvalue() == f"\r{first}\r{second}\n"
    bar.close()  # a second close adds nothing
    assert out.getvalue().count("\n") == 1


def test_terminal_bar_wipes_a_longer_earlier_line():
    out = io.StringIO()
    bar = ProgressBar("r", file=out, tty=True)
    bar.update(_counts(4, 2.0))
    long_line = out.getvalue()[1:]
    bar.update({"done": 0, "total": 8, "tokens": 0, "elapsed_s": 0.0})
    short = "r |--------------------| 0/8 samples 0% | 0s"
    assert out.getvalue() == f"\r{long_line}\r{short}{' ' * (len(long_line) - len(short))}"


def test_plain_lines_are_spaced_by_the_interval():
    out, clock = io.StringIO(), FakeClock(0.0)
    bar = ProgressBar("rollout 2/3", file=out, tty=False, interval_s=30.0, clock=clock)
    for now, done in ((1.0, 0), (29.0, 2), (30.0, 3), (45.0, 4), (59.0, 5), (60.5, 6)):
        clock.now = now
        bar.update(_counts(done, now))
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" samples")[0].split("| ")[-1] for line in lines] == ["3/8", "6/8"]  # at 30 s, 60.5 s
    assert "\r" not in out.getvalue()


def test_final_counts_print_only_after_a_rollout_that_lasted_an_interval():
    out, clock = io.StringIO(), FakeClock(0.0)
    short = ProgressBar("rollout 1/2", file=out, tty=False, interval_s=30.0, clock=clock)
    clock.now = 12.0
    short.update(_counts(8, 12.0), final=True)  # a 12 s rollout: silent
    assert out.getvalue() == ""
    long = ProgressBar("rollout 2/2", file=out, tty=False, interval_s=30.0, clock=clock)
    clock.now = 42.0
    long.update(_counts(4, 30.0))  # the 30 s line
    clock.now = 50.0
    long.update(_counts(8, 38.0), final=True)  # 8 s later, but the rollout lasted 38 s: its totals
    assert out.getvalue().splitlines() == [
        "rollout 2/2 |##########----------| 4/8 samples 50% | 0.1 samples/s 1 tok/s | 30s, ETA 30s",
        "rollout 2/2 |####################| 8/8 samples 100% | 0.2 samples/s 2 tok/s | 38s, ETA 0s",
    ]


def test_progress_off_and_interval_setting():
    out = io.StringIO()
    bar = ProgressBar("x", file=out, tty=True, interval_s=None)
    bar.update(_counts(4, 2.0))
    bar.close()
    assert out.getvalue() == ""
    assert LoggingConfig().progress_interval_s == 30.0
    assert LoggingConfig(progress_interval=" 2.5 ").progress_interval_s == 2.5
    assert LoggingConfig(progress_interval="OFF").progress_interval_s is None
    for bad in ("soon", "-1"):
        with pytest.raises(ConfigError) as info:
            LoggingConfig(progress_interval=bad)
        assert (
            str(info.value) == f"--progress-interval must be a number of seconds >= 0 or 'off', got {bad!r}"
        )
