"""Every wait of the driver has a deadline: a stuck actor fails the run within it, with the stacks of the
job's processes printed and, as the last line, what was waited for; a trainer rank that dies fails the run
at once, naming the rank and the checkpoint to resume from. Real `clawrl train` subprocesses on CPU; the
tests' own timeouts are far above the deadlines."""

import pytest
from deadline_runs import STALLS, build_assets, check_stall, last_line, ray_head, train
from loop_assets import REWARD

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    with ray_head() as address:  # every run joins it: one Ray start-up per module, not per run
        yield {**build_assets(tmp_path_factory.mktemp("deadlines")), "ray_address": address}


def test_stuck_rollout_fails_within_its_deadline_with_the_managers_stack(assets, tmp_path):
    result, seconds = train(assets, tmp_path / "out", "--custom-rm-path", f"{assets['plugins']}:stuck_reward",
                             "--num-rollout", "1", "--rollout-timeout", "8")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "---- stacks of rollout manager ----" in result.stderr
    assert "stuck_reward" in result.stderr  # the stuck plugin's frame is in the dump
    assert last_line(result) == (
        "clawrl train: error: rollout 0: the rollout manager did not finish within the 8 s deadline (stacks "
        "printed above)"
    )
    assert seconds < 120


def test_stuck_trainer_fails_within_its_deadline_with_the_ranks_stack(assets, tmp_path):
    result, seconds = train(assets, tmp_path / "out", "--custom-rm-path", REWARD, "--num-rollout", "1",
                             "--loss-type", "custom_loss", "--custom-loss-function-path",
                             f"{assets['plugins']}:stuck_loss", "--train-timeout", "10")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "---- stacks of trainer rank 0 ----" in result.stderr and "stuck_loss" in result.stderr
    last = last_line(result)
    assert last.startswith(
        "clawrl train: error: trainer train: trainer rank 0 did not finish within the 10 s"
    )
    assert last.endswith("no checkpoint to resume from (--save unset)")
    assert seconds < 120


def test_dead_trainer_rank_names_the_checkpoint_to_resume_from(assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    result, _ = train(assets, tmp_path / "out", "--custom-rm-path", REWARD, "--num-rollout", "3",
                       "--loss-type", "custom_loss", "--custom-loss-function-path",
                       f"{assets['plugins']}:dying_loss", "--save", str(ckpt), "--save-interval", "1")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    last = last_line(result)
    assert last.startswith("clawrl train: error: trainer train: trainer rank 0 died"), last
    assert last.endswith(
        f"last complete checkpoint: {ckpt} (iteration 1, after rollout 0); resume with --load {ckpt}"
    ), last


# The stall points of the rollout manager here, the trainer's and the engines' in test_deadlines_stall_points.py.
MANAGER_POINTS = [point for point in STALLS if point.startswith("rollout.")]


@pytest.mark.parametrize("point", MANAGER_POINTS)
def test_each_blocking_call_fails_within_its_deadline_with_the_stuck_process_stack(assets, tmp_path, point):
    check_stall(assets, tmp_path, point)
