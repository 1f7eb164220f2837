"""Timers on a fake clock: accumulation, perf/step_time from the first start, decorator use, errors,
and the CUDA-synchronising option (torch.cuda patched: there is no GPU here)."""

from __future__ import annotations

import time

import pytest
import torch

from clawrl.metrics import Timers


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_phases_accumulate_and_step_time_spans_the_step():
    clock = FakeClock()
    timers = Timers(clock=clock)
    clock.advance(50.0)  # before the first timer starts: not part of the step
    with timers("rollout"):
        clock.advance(3.0)
    clock.advance(0.5)  # untimed gap: in step_time only
    with timers("train"):
        clock.advance(2.0)
    with timers("rollout"):
        clock.advance(1.0)
    clock.advance(0.25)
    assert timers.pop() == {"perf/rollout_time": 4.0, "perf/train_time": 2.0, "perf/step_time": 6.75}
    assert timers.pop() == {}
    with timers("eval"):
        clock.advance(1.5)
    assert timers.pop() == {"perf/eval_time": 1.5, "perf/step_time": 1.5}


def test_decorator_and_start_stop():
    clock = FakeClock()
    timers = Timers(clock=clock)

    @timers("update_weights")
    def sync(seconds):
        clock.advance(seconds)
        return "done"

    assert sync(0.25) == "done"
    assert sync(0.5) == "done"
    timers.start("save")
    clock.advance(2.0)
    assert timers.stop("save") == 2.0
    assert timers.pop() == {"perf/update_weights_time": 0.75, "perf/save_time": 2.0, "perf/step_time": 2.75}


def test_timer_stops_when_the_body_raises():
    clock = FakeClock()
    timers = Timers(clock=clock)
    with pytest.raises(KeyError), timers("rollout"):
        clock.advance(1.0)
        raise KeyError("x")
    assert timers.pop() == {"perf/rollout_time": 1.0, "perf/step_time": 1.0}


def test_misuse_errors():
    timers = Timers()
    timers.start("train")
    with pytest.raises(RuntimeError, match="timer 'train' is already running"):
        timers.start("train")
    with pytest.raises(RuntimeError, match=r"timers still running at pop\(\): \['train'\]"):
        timers.pop()
    with pytest.raises(RuntimeError, match="timer 'eval' is not running"):
        timers.stop("eval")
    for bad in ("", "step", "a/b"):
        with pytest.raises(ValueError, match="timer name must be non-empty"):
            timers.start(bad)


def test_real_clock_measures_sleep():
    timers = Timers()
    with timers("sleep"):
        time.sleep(0.05)
    times = timers.pop()
    assert 0.04 <= times["perf/sleep_time"] <= times["perf/step_time"] < 1.0


def test_cuda_sync_synchronises_at_start_stop_and_pop(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    timers = Timers(cuda_sync=True)
    with timers("train"):
        assert calls == ["sync"]
    assert calls == ["sync", "sync"]
    timers.pop()
    assert calls == ["sync"] * 3


def test_cuda_sync_without_a_gpu_does_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: pytest.fail("synchronize without a GPU"))
    timers = Timers(cuda_sync=True, clock=FakeClock())
    with timers("train"):
        pass
    assert timers.pop() == {"perf/train_time": 0.0, "perf/step_time": 0.0}


def test_gc_pauses_count_the_collections_inside_and_none_after():
    import gc

    from clawrl.metrics.timer import GcPauses

    with GcPauses() as pauses:
        gc.collect()  # a full collection
        gc.collect(0)
    assert pauses.collections[2] >= 1 and pauses.collections[0] >= 1
    assert 0 < pauses.seconds < 5
    seen = (list(pauses.collections), pauses.seconds)
    gc.collect()
    assert (pauses.collections, pauses.seconds) == seen  # the callback went with the context
