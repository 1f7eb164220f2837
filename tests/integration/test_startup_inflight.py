"""InFlight (clawrl/cluster/startup.py) on real Ray actor calls: when the calls ended, deadlines of calls queued
behind others, and `check()`, which the driver calls while it waits for another part; and the start-up lines
StartupClock prints.

    .venv/bin/pytest tests/integration/test_startup_inflight.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import logging
import re
import time

import pytest
import ray

from clawrl.cluster.deadline import DeadlineError
from clawrl.cluster.startup import InFlight, StartupClock


@ray.remote
class Sleeper:
    """A test actor (not a clawrl part): calls that take a given time, or fail."""

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self) -> None:
        raise ValueError("the model file is corrupt")


@pytest.fixture(scope="module")
def sleeper(ray_session):
    actor = Sleeper.options(num_cpus=0).remote()
    ray.get(actor.nap.remote(0))  # its process is up: the tests' calls start at once
    yield actor
    ray.kill(actor)


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_ready_at_is_when_the_calls_ended_not_when_the_driver_waited(sleeper):
    flight = InFlight.of([sleeper.nap.remote(0.0)], "nap", ["sleeper"], timeout_s=60)
    _until(lambda: flight.ready_at is not None)  # recorded by Ray's callback: nobody waited yet
    ended = flight.ready_at
    time.sleep(0.3)
    waited = time.monotonic()
    assert flight.result([]) == [0.0]
    assert flight.ready_at == ended < waited


def test_the_deadline_of_queued_calls_counts_from_the_end_of_those_before_them(sleeper):
    first = InFlight.of([sleeper.nap.remote(3.0)], "first", ["sleeper"], timeout_s=60)
    # sent together with `first`, it waits behind it on the actor: 3 s, more than its own 2 s deadline
    queued = InFlight.of([sleeper.nap.remote(0.0)], "queued", ["sleeper"], timeout_s=2, after=first)
    assert queued.deadline_start() is None  # not running yet: its deadline has not begun
    assert queued.result([]) == [0.0]
    assert queued.deadline_start() == first.ready_at
    # the same queue without `after`: the deadline ran from sending, while the call waited its turn
    first = InFlight.of([sleeper.nap.remote(3.0)], "first", ["sleeper"], timeout_s=60)
    alone = InFlight.of([sleeper.nap.remote(0.0)], "alone", ["sleeper"], timeout_s=2)
    with pytest.raises(DeadlineError, match=r"^alone: sleeper did not finish within the 2 s deadline"):
        alone.result([])
    first.result([])


def test_check_returns_while_in_time_and_raises_a_failure_or_a_passed_deadline_at_once(sleeper):
    running = InFlight.of([sleeper.nap.remote(2.0)], "nap", ["sleeper"], timeout_s=60)
    running.check([])  # still running, in time: returns
    running.result([])
    failed = InFlight.of([sleeper.fail.remote()], "engine start", ["engine 0"], timeout_s=60)
    _until(lambda: failed.ready_at is not None)
    with pytest.raises(ValueError, match="the model file is corrupt"):
        failed.check([])
    late = InFlight.of([sleeper.nap.remote(3.0)], "trainer init", ["trainer rank 0"], timeout_s=1)
    late.check([])  # 1 s not yet over
    time.sleep(1.2)
    with pytest.raises(DeadlineError, match=r"^trainer init: trainer rank 0 did not finish within the 1 s"):
        late.check([])
    ray.get(late.refs)


def test_queued_calls_are_checked_after_those_before_them(sleeper):
    setup = InFlight.of([sleeper.fail.remote()], "trainer start", ["trainer rank 0"], timeout_s=60)
    init = InFlight.of(
        [sleeper.nap.remote(0.0)], "trainer init", ["trainer rank 0"], timeout_s=60, after=setup
    )
    _until(lambda: init.ready_at is not None)
    with pytest.raises(ValueError, match="the model file is corrupt"):  # the set-up's error, not init's
        init.check([])
    with pytest.raises(ValueError, match="the model file is corrupt"):
        init.result([])


def test_startup_clock_prints_each_phase_with_its_seconds_and_when_it_was_ready(caplog):
    clock = StartupClock()
    clock.began -= 10.0  # the start-up began 10 s ago
    with caplog.at_level(logging.INFO, logger="clawrl.cluster.startup"):
        clock.phase("1 engine(s) ready", clock.began + 2.0, clock.began + 8.5)
        clock.phase("trainer ready", clock.began + 2.5, clock.began + 6.0)
        clock.done()
    lines = [record.getMessage() for record in caplog.records]
    assert lines[:2] == ["1 engine(s) ready (6.5 s, at 8.5 s)", "trainer ready (3.5 s, at 6.0 s)"]
    total = float(re.fullmatch(r"start-up done in (\d+\.\d) s", lines[2])[1])
    assert 10.0 <= total < 11.0  # the wall time since the start-up began, not a sum of the phases
