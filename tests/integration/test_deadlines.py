"""Every wait of the driver has a deadline: a stuck actor fails the run within it, with the stacks of the
job's processes printed and, as the last line, what was waited for; a trainer rank that dies fails the run
at once, naming the rank and the checkpoint to resume from. Real `clawrl train` subprocesses on CPU; the
tests' own timeouts are far above the deadlines."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loop_assets import REWARD, build_loop_assets

pytestmark = pytest.mark.slow

PLUGINS = """
import os
import time

def stuck_reward(sample, **kwargs):
    time.sleep(600)  # a reward service that never answers
    return 0.0

def stuck_loss(args, batch, logits, sum_of_sample_mean):
    time.sleep(600)  # a trainer rank wedged in a collective

_calls = [0]

def dying_loss(args, batch, logits, sum_of_sample_mean):
    _calls[0] += 1
    if _calls[0] == 5:  # the second rollout (4 micro-batches each): a checkpoint of the first exists
        os._exit(3)
    log_probs = logits.log_softmax(-1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
    return sum_of_sample_mean(-batch["advantages"] * log_probs), {}
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("deadlines")
    (root / "plugins.py").write_text(PLUGINS)
    return {**build_loop_assets(root, num_train=16, num_eval=2), "plugins": str(root / "plugins.py")}


def _train(assets, out: Path, *extra, env=None) -> tuple[subprocess.CompletedProcess, float]:
    argv = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--output-dir", str(out), *extra,
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "train", *argv], capture_output=True,
                            text=True, timeout=300, env=env)  # fmt: skip
    return result, time.monotonic() - started


def _last_line(result) -> str:
    return [line for line in result.stderr.splitlines() if line.strip()][-1]


def test_stuck_rollout_fails_within_its_deadline_with_the_managers_stack(assets, tmp_path):
    result, seconds = _train(assets, tmp_path / "out", "--custom-rm-path", f"{assets['plugins']}:stuck_reward",
                             "--num-rollout", "1", "--rollout-timeout", "8")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "---- stacks of rollout manager ----" in result.stderr
    assert "stuck_reward" in result.stderr  # the stuck plugin's frame is in the dump
    assert _last_line(result) == (
        "clawrl train: error: rollout 0: the rollout manager did not finish within the 8 s deadline (stacks "
        "printed above)"
    )
    assert seconds < 120


def test_stuck_trainer_fails_within_its_deadline_with_the_ranks_stack(assets, tmp_path):
    result, seconds = _train(assets, tmp_path / "out", "--custom-rm-path", REWARD, "--num-rollout", "1",
                             "--loss-type", "custom_loss", "--custom-loss-function-path",
                             f"{assets['plugins']}:stuck_loss", "--train-timeout", "10")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "---- stacks of trainer rank 0 ----" in result.stderr and "stuck_loss" in result.stderr
    last = _last_line(result)
    assert last.startswith(
        "clawrl train: error: trainer train: trainer rank 0 did not finish within the 10 s"
    )
    assert last.endswith("no checkpoint to resume from (--save unset)")
    assert seconds < 120


def test_dead_trainer_rank_names_the_checkpoint_to_resume_from(assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    result, _ = _train(assets, tmp_path / "out", "--custom-rm-path", REWARD, "--num-rollout", "3",
                       "--loss-type", "custom_loss", "--custom-loss-function-path",
                       f"{assets['plugins']}:dying_loss", "--save", str(ckpt), "--save-interval", "1")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    last = _last_line(result)
    assert last.startswith("clawrl train: error: trainer train: trainer rank 0 died"), last
    assert last.endswith(
        f"last complete checkpoint: {ckpt} (iteration 1, after rollout 0); resume with --load {ckpt}"
    ), last


# Each blocking call of the driver, made stuck once with a stall point (clawrl/stall_points.py): the point,
# the flags (a short deadline, and what makes the call happen), the start of the last line, and the process
# whose printed stacks must show the stall.
STALLS = {
    "engine.start": (["--engine-start-timeout", "8"],
                     "clawrl train: error: engine start: engine 0 did not finish within the 8 s deadline", "engine 0"),
    "trainer.start": (["--train-timeout", "8"],
                      "clawrl train: error: trainer start: trainer rank 0 did not finish within the 8 s deadline",
                      "trainer rank 0"),
    "trainer.init": (["--train-timeout", "8"],
                     "clawrl train: error: trainer init: trainer rank 0 did not finish within the 8 s deadline",
                     "trainer rank 0"),
    "engine.update_weights": (
        ["--update-weights-timeout", "8"],
        "clawrl train: error: trainer update_weights: trainer rank 0 did not finish within the 8 s deadline",
        "engine 0",
    ),
    "rollout.eval": (["--rollout-timeout", "8", "--eval-interval", "1", "--eval-prompt-data", "demo", "{eval}"],
                     "clawrl train: error: eval 0: the rollout manager did not finish within the 8 s deadline",
                     "rollout manager"),
    "trainer.save": (["--train-timeout", "8", "--save", "{tmp}/ckpt"],
                     "clawrl train: error: trainer save: trainer rank 0 did not finish within the 8 s deadline",
                     "trainer rank 0"),
    "rollout.state_dict": (
        ["--rollout-timeout", "8", "--save", "{tmp}/ckpt"],
        "clawrl train: error: rollout state for the checkpoint: the rollout manager did not finish within the 8 s "
        "deadline", "rollout manager",
    ),
}  # fmt: skip


@pytest.mark.parametrize("point", list(STALLS))
def test_each_blocking_call_fails_within_its_deadline_with_the_stuck_process_stack(assets, tmp_path, point):
    flags, last_start, stuck = STALLS[point]
    flags = [f.format(eval=assets["eval"], tmp=tmp_path) for f in flags]
    env = {**os.environ, "CLAWRL_STALL_AT": point}
    result, seconds = _train(assets, tmp_path / "out", "--custom-rm-path", REWARD, "--num-rollout", "1",
                             *flags, env=env)  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    last = _last_line(result)
    assert last.startswith(last_start), last
    section = result.stderr.split(f"---- stacks of {stuck} ----", 1)
    assert len(section) == 2, result.stderr[-3000:]
    assert (
        "stall_point" in section[1].split("---- stacks of", 1)[0]
    )  # the stuck frame, in that process's dump
    assert seconds < 90  # a deadline of 8 s plus start-up; the stall itself lasts an hour
