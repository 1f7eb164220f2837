"""Run.start starts the engines, the rollout manager and the trainer ranks at once; a part that fails while
another loads still ends the start with its own error, at once, and every actor is ended after it.

- A trainer rank that fails while the engines load: the engines are held in their start for an hour (the
  `engine.start` stall point, clawrl/stall_points.py), so the trainer's error can only come from the driver
  watching the trainer while it waits for them (before, the trainer started only after the engines).
- An engine that fails to load (a context length beyond the model's) while the trainer ranks build theirs.

    .venv/bin/pytest tests/integration/test_startup_overlap.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from loop_assets import REWARD, build_loop_assets

from clawrl.config import parse_job_args

pytestmark = pytest.mark.slow  # two Ray start-ups and two partial job start-ups: 40-70 s on 2 shared cores

ACTOR_CLASSES = {"TrainWorker", "EngineActor", "RolloutManagerActor"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("startup"), num_train=8, num_eval=2)


@contextlib.contextmanager
def _ray(**env: str):
    """A local Ray instance whose actors see `env` (the job's runtime_env is taken when Ray starts)."""
    import ray

    from clawrl.cluster.ray_cluster import start_ray

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # start_ray reuses a Ray an earlier test of this worker left running, whose actors would not see `env`
        # (the stall then never happens and Run.start succeeds): start a fresh one.
        ray.shutdown()
        start_ray(num_cpus=2)
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _job(assets, output_dir, *extra):
    return parse_job_args([
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--custom-rm-path", REWARD, "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--output-dir", str(output_dir), *extra,
    ])  # fmt: skip


def _new_actor_states(before: set[str], timeout_s: float = 20.0) -> dict[str, str]:
    """Class name -> state of each actor created since `before`, once all are DEAD (or the timeout passed):
    ray.kill returns before the process is gone."""
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while True:
        states = {i["ActorClassName"]: i["State"] for k, i in state.actors().items() if k not in before}
        if all(s == "DEAD" for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)


def test_a_trainer_that_fails_while_the_engines_load_ends_the_start_with_its_error(assets, tmp_path):
    from ray._private import state

    from clawrl.loops.run import Run

    # 60 s for the engines: far beyond what the trainer needs to fail, and what a start that waited for the
    # engines before starting the trainer would end with instead (a DeadlineError naming engine 0)
    job = _job(assets, tmp_path / "out", "--loss-type", "custom_loss", "--custom-loss-function-path",
               "no_such_module.loss", "--engine-start-timeout", "60")  # fmt: skip
    with _ray(CLAWRL_STALL_AT="engine.start"):
        before = set(state.actors())
        # `failure` keeps Run.start's frame (and the actor handles) alive: ended actors are close's doing
        with pytest.raises(Exception, match="no_such_module") as failure:
            Run.start(job)  # the stalled engine never answers
        assert "TrainWorker.init" in str(failure.value)  # the trainer rank's model build, named
        states = _new_actor_states(before)
    assert set(states) == ACTOR_CLASSES, states
    assert set(states.values()) == {"DEAD"}, states  # the stalled engine too


def test_an_engine_that_fails_to_load_ends_the_start_with_its_error(assets, tmp_path):
    from ray._private import state

    from clawrl.loops.run import Run

    job = _job(assets, tmp_path / "out", "--sglang-context-length", "100000000")
    with _ray():
        before = set(state.actors())
        with pytest.raises(ValueError, match="context_length=100000000 exceeds") as failure:
            Run.start(job)
        assert "EngineActor.start" in str(failure.value)
        states = _new_actor_states(before)
    assert set(states) == ACTOR_CLASSES, states  # the trainer ranks were building meanwhile ...
    assert set(states.values()) == {"DEAD"}, states  # ... and were ended with the rest
