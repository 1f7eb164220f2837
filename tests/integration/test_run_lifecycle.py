"""Run.close ends everything Run.start opened, also when start fails half-way: the engine actors, the rollout
manager actor and the trainer ranks are all dead afterwards, and the error that stopped the start is the one
raised. The start is made to fail at its last step, the metric logger, after the trainer ranks exist: the
output directory is a path below a regular file. A Ray that Run.start initialised itself is shut down by
close; one the caller initialised is left running.

    .venv/bin/pytest tests/integration/test_run_lifecycle.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import time

import pytest
from loop_assets import REWARD, build_loop_assets

from clawrl.config import parse_job_args

pytestmark = pytest.mark.slow  # 80-130 s measured on 2 cores shared with other test runs (engine start-up)

ACTOR_CLASSES = {"TrainWorker", "EngineActor", "RolloutManagerActor"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("lifecycle"), num_train=8, num_eval=2)


def _job(assets, output_dir):
    return parse_job_args([
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--custom-rm-path", REWARD, "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--output-dir", str(output_dir),
    ])  # fmt: skip


def _actor_states(before: set[str]) -> dict[str, str]:
    """Class name -> state of each Ray actor created since `before` (one of each class here)."""
    from ray._private import state

    return {
        info["ActorClassName"]: info["State"] for key, info in state.actors().items() if key not in before
    }


def _wait_all_dead(before: set[str], timeout_s: float = 20.0) -> dict[str, str]:
    """ray.kill returns before the actor's process is gone: poll until every new actor is DEAD."""
    deadline = time.monotonic() + timeout_s
    states = _actor_states(before)
    while any(s != "DEAD" for s in states.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        states = _actor_states(before)
    return states


def test_a_failed_start_shuts_down_the_ray_it_started(assets, tmp_path):
    # runs before the module's ray_session exists: Run.start initialises Ray itself, so close() ends it
    import ray

    from clawrl.loops.run import Run

    assert not ray.is_initialized()
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the output directory should go\n")
    with pytest.raises((FileExistsError, NotADirectoryError)):
        Run.start(_job(assets, blocker / "out"))
    assert not ray.is_initialized()


def test_a_start_that_fails_after_the_trainer_exists_ends_every_actor(assets, ray_session, tmp_path):
    from ray._private import state

    from clawrl.loops.run import Run

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the output directory should go\n")
    before = set(state.actors())
    # `failure` keeps the traceback, and with it Run.start's frame and the actor handles, alive: Ray would
    # otherwise end an actor whose last handle is gone, and the test could not tell that from a close.
    with pytest.raises((FileExistsError, NotADirectoryError)) as failure:
        Run.start(_job(assets, blocker / "out"))
    states = _wait_all_dead(before)
    assert set(states) == ACTOR_CLASSES, states  # every part was started before the failure ...
    assert set(states.values()) == {"DEAD"}, states  # ... and closed by it
    assert "not_a_dir" in str(failure.value)  # the error that stopped the start is the one raised
    import ray

    assert ray.is_initialized()  # the caller's Ray (ray_session) is left running
