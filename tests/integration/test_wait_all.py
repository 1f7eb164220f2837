"""wait_all, the driver's one way to wait on actors: results, the deadline with its message, a dead actor,
and `poll` ending a wait early (a failed engine recovery must not leave a rollout waiting for its deadline).
Real Ray, in this process."""

import time

import pytest
import ray

from clawrl.cluster.deadline import ActorFailure, DeadlineError, wait_all


@ray.remote(num_cpus=0)
class Sleeper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def die(self) -> None:
        import os

        os._exit(1)


def test_results_deadline_and_dead_actor(ray_session):
    a = Sleeper.remote()
    assert wait_all([a.nap.remote(0.1), a.nap.remote(0.2)], "naps", 30) == [0.1, 0.2]
    started = time.monotonic()
    with pytest.raises(DeadlineError) as error:
        wait_all([a.nap.remote(30)], "a long nap", 1.5, owners=["the sleeper"])
    assert time.monotonic() - started < 5
    assert (
        str(error.value)
        == "a long nap: the sleeper did not finish within the 1.5 s deadline (stacks printed above)"
    )
    b = Sleeper.remote()
    with pytest.raises(ActorFailure, match=r"^dying: the doomed died \("):
        wait_all([b.die.remote()], "dying", 30, owners=["the doomed"])
    ray.kill(a)


def test_poll_ends_the_wait_early(ray_session):
    a = Sleeper.remote()
    calls = []

    def poll():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise RuntimeError("engine recovery failed")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="engine recovery failed"):
        wait_all([a.nap.remote(60)], "rollout 2", 600, poll=poll)
    assert 2.5 < time.monotonic() - started < 10  # polled about once a second, not at the 600 s deadline
    # a poll that never raises leaves the deadline in charge, with the full timeout in the message
    with pytest.raises(DeadlineError, match="within the 2 s deadline"):
        wait_all([a.nap.remote(60)], "rollout 3", 2, poll=lambda: None)
    ray.kill(a)
