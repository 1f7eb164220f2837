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


def _item(received, finished, answered):
    return {
        "text": "",
        "meta_info": {"received_at": received, "finished_at": finished, "answered_at": answered},
    }


def test_answer_path_of_the_engine_calls():
    # Three calls (medians of three values); the last one back (at 5.0) was finished by the engine at 4.2.
    timeline = RolloutTimeline(started=0.0)
    timeline.add_engine_call(0.0, 2.0, [_item(0.01, 1.5, 1.52), _item(0.01, 1.8, 1.82)])  # a batch of two
    timeline.add_engine_call(0.1, 3.0, [_item(0.13, 2.9, 2.95)])
    timeline.add_engine_call(0.2, 5.0, [_item(0.22, 4.2, 4.21)])
    timeline.add(0.0, 2.0)
    m = timeline.metrics(ended=5.0)
    # send: 0.01, 0.03, 0.02; engine: 1.8 - 0.01 (the batch's last sample), 2.77, 3.98; answer: 1.82 - 1.8
    # (the last answer built), 0.05, 0.01; return: 0.18, 0.05, 0.79
    assert m["perf/rollout_request_send_time"] == pytest.approx(0.02)
    assert m["perf/rollout_request_engine_time"] == pytest.approx(2.77)
    assert m["perf/rollout_request_answer_time"] == pytest.approx(0.02)
    assert m["perf/rollout_request_return_time"] == pytest.approx(0.18)
    assert m["perf/rollout_last_answer_time"] == pytest.approx(0.8)  # 4.2 -> 5.0


def test_answer_path_is_left_out_without_stamps_or_a_shared_clock():
    timeline = RolloutTimeline(started=0.0)
    timeline.add_engine_call(0.0, 1.0, [{"text": "", "meta_info": {"e2e_latency": 0.9}}])  # e.g. SGLang
    timeline.add_engine_call(0.0, 1.0, [_item(0.1, 0.5, 0.6), {"meta_info": {"received_at": 0.1}}])
    assert timeline.engine_calls == []
    timeline.add(0.0, 1.0)
    assert not any(k.startswith("perf/rollout_request") for k in timeline.metrics(ended=1.0))
    # An engine on another host: its clock reads 1000 s ahead of the client's
    timeline.add_engine_call(0.0, 1.0, [_item(1000.1, 1000.5, 1000.6)])
    assert len(timeline.engine_calls) == 1
    m = timeline.metrics(ended=1.0)
    assert "perf/rollout_request_send_time" not in m and "perf/rollout_last_answer_time" not in m
