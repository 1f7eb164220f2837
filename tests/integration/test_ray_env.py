"""Environment variables given to the driver reach every Ray actor of the job, also on a cluster that was
started without them (`--ray-address`): the job-level runtime_env of `start_ray` carries them, so e.g.
`CUDA_LAUNCH_BLOCKING=1 clawrl train ...` affects the engines and the trainer ranks."""

import os
import socket
import subprocess
import sys
import time

import pytest
from ray_processes import stop_group

from clawrl.cluster.ray_cluster import forwarded_env


def test_forwarded_env_keeps_settings_and_drops_machine_specific_variables():
    env = {
        "CUDA_LAUNCH_BLOCKING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "MY_PLAIN_VAR": "x",
        "CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin", "HOME": "/root", "RAY_ADDRESS": "a:1", "SSH_TTY": "t",
    }  # fmt: skip
    assert forwarded_env(env) == {
        "CUDA_LAUNCH_BLOCKING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "MY_PLAIN_VAR": "x",
    }


_DRIVER = """
import os, ray
os.environ["CLAWRL_PLAIN_PROBE"] = "hello-42"      # set in the driver only, after the cluster started
from clawrl.cluster.ray_cluster import start_ray
start_ray("127.0.0.1:{port}")

@ray.remote(num_cpus=0)
class Probe:
    def value(self):
        return os.environ.get("CLAWRL_PLAIN_PROBE")

print("PROBE", ray.get(Probe.remote().value.remote(), timeout=60))
"""


@pytest.mark.slow
def test_plain_env_var_reaches_actors_of_a_joined_cluster():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "CLAWRL_PLAIN_PROBE"}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
         "--include-dashboard=false", "--node-ip-address", "127.0.0.1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        out = _run_driver(port, env)
        assert "PROBE hello-42" in out, out[-3000:]
    finally:
        stop_group(head)


def _run_driver(port: int, env: dict) -> str:
    deadline = time.monotonic() + 90
    while True:  # the head takes a few seconds to accept drivers
        result = subprocess.run(
            [sys.executable, "-c", _DRIVER.format(port=port)], env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        if "PROBE" in result.stdout or time.monotonic() > deadline:
            return result.stdout + result.stderr
        time.sleep(2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
