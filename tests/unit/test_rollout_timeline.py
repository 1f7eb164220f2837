"""RolloutTimeline: the rollout phases computed from hand-made request timestamps."""

from __future__ import annotations

import pytest

from clawrl.rollout.timeline import RolloutTimeline


def test_phases_of_a_batch_that_fills_decodes_and_drains():
    # Ten requests sent 0.1 s apart; 90% of ten = 9 in flight first at t = 0.8 (the ninth send). The first
    # returns at 3.0 (9 left: still "full"), eight at 4.0 (1 left), the last at 6.0. Rewards take 0.5 s each.
    timeline = RolloutTimeline(started=0.0)
    generated = [3.0, *[4.0] * 8, 6.0]
    for i, back in enumerate(generated):
        timeline.add(0.1 * i, back, back + 0.5)
    m = timeline.metrics(ended=7.0)
    assert m["perf/rollout_first_sample_time"] == pytest.approx(3.0)
    assert m["perf/rollout_ramp_time"] == pytest.approx(0.8)
    assert m["perf/rollout_steady_time"] == pytest.approx(3.2)  # 0.8 -> 4.0
    assert m["perf/rollout_tail_time"] == pytest.approx(2.0)  # the 9th return (4.0) -> the last (6.0)
    assert m["perf/rollout_generate_time"] == pytest.approx(6.0)
    assert m["perf/rollout_reward_time"] == pytest.approx(5.0)  # 10 x 0.5
    assert m["perf/rollout_reward_tail_time"] == pytest.approx(0.5)  # 6.0 -> 6.5
    assert m["perf/rollout_finish_time"] == pytest.approx(0.5)  # 6.5 -> 7.0
    assert m["perf/rollout_max_in_flight"] == 10.0


def test_a_rollout_that_never_fills_has_no_ramp_or_steady_phase():
    # One request after the other: a request is not in flight at its own end, so at most 1 of 2 at once.
    timeline = RolloutTimeline(started=0.0)
    timeline.add(0.0, 1.0)  # no reward (e.g. aborted)
    timeline.add(1.0, 2.0, 2.25)
    m = timeline.metrics(ended=2.5)
    assert "perf/rollout_ramp_time" not in m and "perf/rollout_steady_time" not in m
    assert m["perf/rollout_max_in_flight"] == 1.0
    assert m["perf/rollout_reward_time"] == pytest.approx(0.25)
    assert m["perf/rollout_tail_time"] == 0.0  # ceil(90% of 2) = 2: the k-th return is the last one
    assert m["perf/rollout_reward_tail_time"] == pytest.approx(0.25)  # 2.0 -> 2.25
    assert m["perf/rollout_finish_time"] == pytest.approx(0.25)  # 2.25 -> 2.5


def test_no_request_no_metrics():
    assert RolloutTimeline(started=0.0).metrics(ended=1.0) == {}
