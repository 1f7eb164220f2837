"""The colocated loop's early onload (clawrl/loops/run.py): with --colocate --offload-train the trainer is
asked to onload as a rollout starts (it does where the GPU has room beside the engines), the train step waits
for that instead of onloading after the engines released their memory, a trainer that had the room keeps its
state on the GPU after the step, and an engine replaced during the rollout sizes its KV cache with the
trainer offloaded again.

Colocation needs a GPU, so the trainer group and the rollout manager here are stand-ins that record the
driver's calls; TrainActor.onload_if_room itself runs for real in tests/integration/test_trainer_memory.py.

    .venv/bin/pytest tests/unit/test_early_onload.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

from clawrl.cluster.placement import plan_placement
from clawrl.config.job import JobConfig
from clawrl.config.resources import ResourcesConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.loops.run import EARLY_ONLOAD_HEADROOM, Run


class _Trainer:
    """A TrainGroup's onload / train / offload calls, in order; `room` is what every rank answers."""

    def __init__(self, room: bool = True, keeps: bool = True):
        self.room, self.keeps, self.calls = room, keeps, []

    def start_onload_if_room(self, headroom_fraction):
        self.calls.append(("start_onload_if_room", headroom_fraction))
        return ["onload-refs"]

    def finish_onload(self, started):
        self.calls.append(("finish_onload", started))
        return started is not None and self.room

    def undo_onload(self, started):
        self.calls.append(("undo_onload", started))

    def train(self, batch):
        self.calls.append(("train", batch))
        return {"perf/log_probs_time": 0.1}

    def offload(self, *, keep_weights=False):
        self.calls.append(("offload", keep_weights))

    def offload_after_step(self):
        self.calls.append(("offload_after_step",))
        return self.keeps


class _Remote:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, *args))
        return f"{self.name}-ref"


class _Manager:
    def __init__(self, calls):
        self.generate = _Remote(calls, "generate")


class _Pool:
    urls = ["http://127.0.0.1:1"]

    def __init__(self, calls):
        self.calls = calls

    def restart(self, index, timeout_s):
        self.calls.append(("restart", index))
        raise RuntimeError("stop here")  # the rest of the recovery needs live engines


def _run(trainer, **resources) -> Run:
    res = ResourcesConfig(actor_num_gpus_per_node=1, colocate=True, offload_train=True, offload_rollout=False,
                          **resources)  # fmt: skip
    plan = plan_placement(res, cluster_gpus=1)
    assert plan.mode == "colocate"
    run = Run(
        job=JobConfig(resources=res, rollout=RolloutConfig(rollout_batch_size=1)), plan=plan, trainer=trainer
    )
    run.manager = _Manager(trainer.calls)
    return run


@pytest.mark.parametrize(("room", "keeps"), [(True, True), (True, False), (False, False)])
def test_the_rollout_starts_the_onload_and_the_train_step_waits_for_it(room, keeps):
    trainer = _Trainer(room=room, keeps=keeps)
    run = _run(trainer)
    assert run.generate_async(3) == "generate-ref"
    assert trainer.calls == [("generate", 3), ("start_onload_if_room", EARLY_ONLOAD_HEADROOM)]
    metrics = run.train("batch")
    # With room the trainer decides after the step whether its state still fits (then the sync does not
    # offload the weights); without, everything but the weights leaves, then the weights after the sync.
    after = ("offload_after_step",) if room else ("offload", True)
    assert trainer.calls[2:] == [("finish_onload", ["onload-refs"]), ("train", "batch"), after]
    assert metrics["perf/trainer_onload_early"] == float(room)
    assert metrics["perf/trainer_stays_resident"] == float(keeps)
    assert metrics["perf/trainer_onload_time"] >= 0.0 and metrics["perf/log_probs_time"] == 0.1
    assert run._early_onload is None  # used once: the next step starts its own
    assert run._trainer_weights_resident is not keeps


def test_disabled_the_train_step_onloads_after_the_rollout():
    trainer = _Trainer()
    run = _run(trainer, disable_onload_during_rollout=True)
    run.generate_async(0)
    metrics = run.train("batch")
    assert [c[0] for c in trainer.calls] == ["generate", "finish_onload", "train", "offload"]
    assert trainer.calls[1] == ("finish_onload", None) and metrics["perf/trainer_onload_early"] == 0.0


def test_no_early_onload_without_offload_or_while_an_engine_is_replaced():
    trainer = _Trainer()
    run = _run(trainer)
    run.job.resources.offload_train = False
    run.generate_async(0)
    assert [c[0] for c in trainer.calls] == ["generate"]
    run.job.resources.offload_train = True
    with run._trainer_lock:  # held by a recovery: its new engine is sizing its KV cache from the free memory
        run.generate_async(1)
    assert [c[0] for c in trainer.calls] == ["generate", "generate"] and run._early_onload is None


def test_an_engine_replaced_mid_rollout_starts_with_the_trainer_offloaded_again():
    trainer = _Trainer()
    run = _run(trainer)
    run.pool = _Pool(trainer.calls)
    run.generate_async(0)
    with pytest.raises(RuntimeError, match="stop here"):
        run._recover(0, "health check failed")
    assert trainer.calls[-2:] == [("undo_onload", ["onload-refs"]), ("restart", 0)]
    assert run._early_onload is None
    run.train("batch")  # the step onloads as without the early onload
    assert trainer.calls[-3] == ("finish_onload", None)
