"""Shared by the deadline tests (test_deadlines.py, test_deadlines_stall_points.py): the tiny job's assets, a
`clawrl train` subprocess run, and the stall-point cases. Two files so that CI's workers (one per file) share them.

Every run of a module joins one Ray head node started for that module (`ray_head`, passed as `--ray-address`)
instead of starting and stopping a Ray instance of its own: the deadlines under test are the driver's, so
where Ray runs does not change what is asserted, and the module pays Ray's start-up once."""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loop_assets import REWARD, build_loop_assets
from ray_processes import stop_group

RAY = str(Path(sys.executable).with_name("ray"))

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


def build_assets(root: Path) -> dict[str, str]:
    (root / "plugins.py").write_text(PLUGINS)
    return {**build_loop_assets(root, num_train=16, num_eval=2), "plugins": str(root / "plugins.py")}


@contextlib.contextmanager
def ray_head():
    """A Ray head node on this machine for a module's runs; yields its address, stops its process group after.

    8 logical CPUs: an actor of a failed run may hold its CPU for a moment after the driver exits, and the next
    run must not wait for it (the trainer rank and the engine take one each)."""
    temp = tempfile.mkdtemp(prefix="cdl", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--disable-usage-stats", "--port", str(port), "--num-cpus", "8",
         "--temp-dir", temp, "--include-dashboard", "false"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for_port(port, head)
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(head)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_port(port: int, head: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert head.poll() is None, "`ray start --head` exited early"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head's GCS did not listen on port {port} within 60 s")


def train(assets, out: Path, *extra, env=None) -> tuple[subprocess.CompletedProcess, float]:
    argv = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--output-dir", str(out), *extra,
    ]  # fmt: skip
    if "ray_address" in assets:
        argv += ["--ray-address", assets["ray_address"]]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "train", *argv], capture_output=True,
                            text=True, timeout=300, env=env)  # fmt: skip
    return result, time.monotonic() - started


def last_line(result) -> str:
    return [line for line in result.stderr.splitlines() if line.strip()][-1]


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


def check_stall(assets, tmp_path, point: str) -> None:
    """Run the tiny job with `point` stalled; assert the deadline fired with that process's stack printed."""
    flags, last_start, stuck = STALLS[point]
    flags = [f.format(eval=assets["eval"], tmp=tmp_path) for f in flags]
    env = {**os.environ, "CLAWRL_STALL_AT": point}
    result, seconds = train(assets, tmp_path / "out", "--custom-rm-path", REWARD, "--num-rollout", "1",
                            *flags, env=env)  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    last = last_line(result)
    assert last.startswith(last_start), last
    section = result.stderr.split(f"---- stacks of {stuck} ----", 1)
    assert len(section) == 2, result.stderr[-3000:]
    assert (
        "stall_point" in section[1].split("---- stacks of", 1)[0]
    )  # the stuck frame, in that process's dump
    assert seconds < 90  # a deadline of 8 s plus start-up; the stall itself lasts an hour
