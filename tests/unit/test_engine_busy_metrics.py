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
