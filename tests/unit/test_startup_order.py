"""Which start-up steps may overlap (`early_init_steps` in clawrl/cluster/startup.py, used by Run.start): the
trainer builds its model and optimizer while the engines load, except with --colocate, where the engines size
their KV cache from the free GPU memory and must do so before the trainer allocates on the same GPUs, and
without --num-rollout, where the optimizer steps come from the rollout manager's prompt count.

    .venv/bin/pytest tests/unit/test_startup_order.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

from clawrl.cluster.placement import plan_placement
from clawrl.cluster.startup import early_init_steps, optimizer_steps
from clawrl.config.resources import ResourcesConfig
from clawrl.config.train import TrainConfig


def _plan(*, gpus: int, colocate: bool):
    res = ResourcesConfig(
        actor_num_gpus_per_node=1, rollout_num_gpus=None if colocate else 1, colocate=colocate
    )
    return plan_placement(res, cluster_gpus=gpus)


@pytest.mark.parametrize(
    ("gpus", "colocate", "mode"), [(0, False, "cpu"), (0, True, "cpu"), (2, False, "split")]
)
def test_the_trainer_builds_while_the_engines_load_off_a_shared_gpu(gpus, colocate, mode):
    plan = _plan(gpus=gpus, colocate=colocate)
    assert plan.mode == mode
    assert early_init_steps(plan, TrainConfig(num_steps_per_rollout=2), 3) == 6  # 3 rollouts x 2 steps


def test_colocated_trainer_waits_for_the_engines_kv_cache_sizing():
    plan = _plan(gpus=1, colocate=True)
    assert plan.mode == "colocate"
    assert early_init_steps(plan, TrainConfig(), 3) is None


@pytest.mark.parametrize("num_rollout", [None, 0])
def test_without_num_rollout_the_build_waits_for_the_prompt_count(num_rollout):
    assert early_init_steps(_plan(gpus=0, colocate=False), TrainConfig(), num_rollout) is None


def test_optimizer_steps_of_the_run():
    assert optimizer_steps(TrainConfig(), 5) == 5  # one step per rollout unless --num-steps-per-rollout
    assert optimizer_steps(TrainConfig(num_steps_per_rollout=4), 5) == 20
