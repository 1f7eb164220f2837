"""bench/loop_step.py's table arithmetic on a hand-made metrics.jsonl: phases, ratios, shares, efficiency.

bench/ is not a package, so the script is loaded from its file. Nothing is timed here.
"""

from __future__ import annotations

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def loop_step():
    yield load_bench("loop_step")
    unload_bench("loop_step")


TRAIN_PARTS = {
    "perf/engine_release_time": 0.1,
    "perf/trainer_onload_time": 0.2,
    "perf/log_probs_time": 0.5,
    "perf/ref_log_probs_time": 0.4,
    "perf/actor_train_time": 1.0,
    "perf/trainer_offload_time": 0.3,
}  # 2.5 s of named parts inside each train call

ROWS = [
    # rollout 0: the warm-up, never counted (its 50 s train would move every median)
    {"step": 0, "time": 100.0, "perf/rollout_time": 20.0, "perf/train_time": 50.0, "perf/rollout_ramp_time": 9.0},
    # step = 110 - 100 = 10; train other = 3 - 2.5 = 0.5; step other = 10 - (4 + 3 + 0.25 + 0.3 + 0.1) = 2.35
    {"step": 1, "time": 110.0, "perf/rollout_time": 4.0, "perf/train_time": 3.0, **TRAIN_PARTS,
     "perf/update_weights_time": 0.25, "perf/engine_resume_time": 0.3, "perf/rollout_ramp_time": 1.0,
     "perf/trainer_weights_offload_time": 0.1, "rollout/raw_reward": 0.5},
    # step = 9; train other = 1.0; step other = 9 - (3 + 3.5 + 0.35 + 0.3 + 0.1) = 1.75
    {"step": 2, "time": 119.0, "perf/rollout_time": 3.0, "perf/train_time": 3.5, **TRAIN_PARTS,
     "perf/update_weights_time": 0.35, "perf/engine_resume_time": 0.3, "perf/rollout_ramp_time": 0.6,
     "perf/trainer_weights_offload_time": 0.1},
    # the final eval row: no rollout, not a step
    {"step": 3, "time": 130.0, "perf/eval_time": 2.0, "eval/arith": 0.25},
]  # fmt: skip

STANDALONE = {
    "rollout": 1.75,
    "rollout_prefill": 0.2,
    "log_probs": 0.25,
    "ref_log_probs": None,
    "actor_train": 0.8,
    "weight_sync": 0.03,
}


def test_loop_phases_are_medians_over_the_rollouts_after_the_warm_up(loop_step):
    phases = loop_step.loop_phases(ROWS, warmup=1)
    assert phases["step"] == pytest.approx(9.5)  # (10 + 9) / 2
    assert phases["perf/rollout_time"] == pytest.approx(3.5)
    assert phases["perf/rollout_ramp_time"] == pytest.approx(0.8)
    assert phases["train_other"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2
    assert phases["step_other"] == pytest.approx(2.05)  # (2.35 + 1.75) / 2
    assert phases["perf/update_weights_time"] == pytest.approx(0.3)
    assert "perf/eval_time" not in phases  # only in the eval row, which is not a step


def test_loop_phases_without_a_measured_rollout_is_an_error(loop_step):
    with pytest.raises(ValueError, match="warm-up"):
        loop_step.loop_phases(ROWS[:1], warmup=1)


def test_table_ratios_shares_and_efficiency(loop_step):
    table = loop_step.build_table(loop_step.loop_phases(ROWS, warmup=1), STANDALONE)
    rows = {r["phase"].strip(): r for r in table["rows"]}
    assert rows["rollout"]["ratio"] == pytest.approx(2.0)  # 3.5 / 1.75
    assert rows["rollout"]["share"] == pytest.approx(3.5 / 9.5)
    assert rows["ramp (to 90% in flight)"]["loop_s"] == pytest.approx(0.8)
    assert rows["ramp (to 90% in flight)"]["ratio"] is None  # no standalone ramp: the prefill is in the JSON
    assert rows["log_probs"]["ratio"] == pytest.approx(2.0)
    assert rows["actor_train"]["ratio"] == pytest.approx(1.25)
    assert rows["weight sync"]["ratio"] == pytest.approx(10.0)
    assert rows["ref_log_probs"]["standalone_s"] is None and rows["ref_log_probs"]["ratio"] is None
    assert rows["engine resume"]["loop_s"] == pytest.approx(0.3) and rows["engine resume"]["ratio"] is None
    # The level-0 rows partition the step: rollout + train parts + train other + sync + resume + step other.
    top = sum(r["loop_s"] for r in table["rows"] if r["level"] == 0)
    assert top == pytest.approx(9.5)
    # Only the standalone times of level-0 rows count (not the engine's prefill, part of its 1.75 s).
    assert table["standalone_sum_s"] == pytest.approx(1.75 + 0.25 + 0.8 + 0.03)
    assert table["efficiency"] == pytest.approx(2.83 / 9.5)


def test_table_rows_without_a_loop_metric_are_na(loop_step):
    loop = {"step": 2.0, "perf/rollout_time": 1.0}  # e.g. a cpu-mode run: no offload, no resume
    table = loop_step.build_table(loop, {"rollout": 0.5})
    rows = {r["phase"].strip(): r for r in table["rows"]}
    assert rows["trainer onload"]["loop_s"] is None and rows["trainer onload"]["share"] is None
    assert table["efficiency"] == pytest.approx(0.25)


def test_markdown_prints_numbers_and_na(loop_step):
    text = loop_step.markdown(loop_step.build_table(loop_step.loop_phases(ROWS), STANDALONE), "tiny, cpu")
    lines = text.splitlines()
    assert lines[0] == "### tiny, cpu"
    assert "| rollout | 3.500 | 1.750 | 2.00x | 36.8% |" in lines
    assert "| ref_log_probs | 0.400 | n/a | n/a | 4.2% |" in lines
    assert "| **step** | **9.500** | 2.830 (sum) | | |" in lines
    assert lines[-1] == "loop efficiency = 2.830 / 9.500 = **0.30**"


def test_split_needs_two_gpus_and_cpu_runs_one_mode(loop_step):
    assert loop_step.split_reason("split", "cuda", 2) is None
    assert "has 1" in loop_step.split_reason("split", "cuda", 1)
    assert loop_step.split_reason("no-offload", "cuda", 1) is None
    assert loop_step.split_reason("cpu", "cpu", 0) is None
    assert "cpu mode" in loop_step.split_reason("colocate", "cpu", 0)


def test_per_rollout_gives_the_engine_counters_per_step_and_na_where_not_logged(loop_step):
    rows = [
        {"step": 0, "time": 1.0, "perf/rollout_time": 2.0, "perf/engine_steps": 200.0,
         "perf/engine_busy_time": 0.5, "perf/engine_step_cpu_time": 0.3, "perf/engine_gpu_time": 0.4,
         "perf/engine_idle_time": 0.25, "perf/engine_command_time": 0.0125},
        {"step": 1, "time": 2.0, "perf/rollout_time": 3.0},  # an external engine: no counters
        {"step": 2, "time": 3.0, "perf/eval_time": 1.0},  # not a rollout
    ]  # fmt: skip
    first, second = loop_step.per_rollout(rows)
    assert first["step"] == 0 and first["engine_steps"] == 200.0
    assert first["busy_ms_per_step"] == pytest.approx(2.5)
    assert first["cpu_ms_per_step"] == pytest.approx(1.5)
    assert first["gpu_ms_per_step"] == pytest.approx(2.0)
    assert first["gpu_wait_ms_per_step"] is None
    assert second["busy_ms_per_step"] is None and second["engine_steps"] is None
    table = loop_step.per_rollout_markdown([first, second]).splitlines()
    assert first["idle_s"] == 0.25 and second["idle_s"] is None
    assert table[2] == "| 0 | 2.000 | 200 | 2.50 | 1.50 | n/a | 2.00 | n/a | 0.250 | 0.013 |"
    assert table[3] == "| 1 | 3.000 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |"


def test_the_train_calls_other_time_splits_into_the_trainers_and_the_ray_calls(loop_step):
    # train other = 3.0 - 2.5 = 0.5; in the trainer 2.15 s of which log/ref/advantages/train are 2.0 s:
    # 0.15 s other there, 0.1 s advantages, so the Ray call itself is 0.5 - 0.15 - 0.1 = 0.25 s.
    row = {**ROWS[1], "perf/advantages_time": 0.1, "perf/train_actor_time": 2.15}
    phases = loop_step.loop_phases([ROWS[0], row], warmup=1)
    assert phases["train_other"] == pytest.approx(0.5)
    assert phases["trainer_other"] == pytest.approx(0.15)
    assert phases["ray_train_call"] == pytest.approx(0.25)
    assert "trainer_other" not in loop_step.loop_phases(ROWS, warmup=1)  # older runs: not split
