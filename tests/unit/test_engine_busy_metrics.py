"""perf/engine_busy_* from the engines' cumulative step counters, by hand-computed numbers."""

from clawrl.rollout.manager import engine_busy_metrics


def test_means_over_engines_and_share_of_the_rollout():
    before = {"a": {"steps": 10, "busy_s": 1.0, "outputs": 5}, "b": {"steps": 0, "busy_s": 0.0, "outputs": 0}}
    after = {
        "a": {"steps": 110, "busy_s": 1.6, "outputs": 900},
        "b": {"steps": 60, "busy_s": 0.2, "outputs": 400},
    }
    metrics = engine_busy_metrics(before, after, rollout_s=0.8)
    assert metrics["perf/engine_busy_time"] == 0.4  # (0.6 + 0.2) / 2
    assert metrics["perf/engine_busy_ratio"] == 0.5  # 0.4 / 0.8
    assert metrics["perf/engine_steps"] == 80  # (100 + 60) / 2


def test_nothing_when_an_engine_has_no_counters_or_was_replaced():
    stats = {"a": {"steps": 1, "busy_s": 0.1, "outputs": 1}}
    assert engine_busy_metrics(None, stats, 1.0) == {}  # an SGLang server reports no counters
    assert engine_busy_metrics(stats, {"b": stats["a"]}, 1.0) == {}  # another engine set
    restarted = {"a": {"steps": 0, "busy_s": 0.0, "outputs": 0}}
    assert engine_busy_metrics(stats, restarted, 1.0) == {}  # counters began again


def test_cpu_and_gpu_counters_where_every_engine_reports_them():
    before = {
        "a": {"steps": 0, "busy_s": 0.0, "cpu_s": 0.0, "process_cpu_s": 1.0, "wait_s": 0.0, "gpu_s": 0.0,
              "idle_s": 5.0, "command_s": 1.0},
        "b": {"steps": 0, "busy_s": 0.0, "cpu_s": 0.0, "process_cpu_s": 2.0, "wait_s": 0.0, "gpu_s": 0.0,
              "idle_s": 5.0, "command_s": 1.0},
    }  # fmt: skip
    after = {
        "a": {"steps": 10, "busy_s": 1.0, "cpu_s": 0.5, "process_cpu_s": 2.5, "wait_s": 0.25, "gpu_s": 0.75,
              "idle_s": 5.5, "command_s": 1.125},
        "b": {"steps": 10, "busy_s": 1.0, "cpu_s": 0.25, "process_cpu_s": 3.0, "wait_s": 0.5, "gpu_s": 0.25,
              "idle_s": 5.25, "command_s": 1.125},
    }  # fmt: skip
    metrics = engine_busy_metrics(before, after, rollout_s=2.0)
    assert metrics["perf/engine_step_cpu_time"] == 0.375  # (0.5 + 0.25) / 2
    assert metrics["perf/engine_process_cpu_time"] == 1.25  # (1.5 + 1.0) / 2
    assert metrics["perf/engine_gpu_wait_time"] == 0.375
    assert metrics["perf/engine_gpu_time"] == 0.5
    assert metrics["perf/engine_idle_time"] == 0.375  # (0.5 + 0.25) / 2
    assert metrics["perf/engine_command_time"] == 0.125
    # A CPU engine counts no GPU time: those two metrics are left out, not logged as 0.
    for stats in (*before.values(), *after.values()):
        del stats["wait_s"], stats["gpu_s"]
    metrics = engine_busy_metrics(before, after, rollout_s=2.0)
    assert "perf/engine_gpu_time" not in metrics and "perf/engine_gpu_wait_time" not in metrics
    assert metrics["perf/engine_step_cpu_time"] == 0.375
