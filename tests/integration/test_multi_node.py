"""A job across two Ray nodes: `clawrl train --ray-address` against a head node and a second node, both
started with `ray start` on this machine, with the trainer on one node and the engine on the other.

The second node registers under 127.0.0.2 (every 127.x address reaches this machine), so its node address
differs from the driver's as it would on another host: the engine listens on its node's address, the
trainer's rendezvous is on rank 0's node, and stacks of an actor there come back through a Ray task placed
on that node. Both nodes are stopped after the module, also when a test fails, and no Ray process of
theirs may remain (checked with `ps`).

    .venv/bin/pytest tests/integration/test_multi_node.py -x -q -p no:cacheprovider    # ~90 s
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from loop_assets import REWARD, build_loop_assets
from ray_processes import stop_group

from clawrl.cluster.placement import PlacementError, plan_placement
from clawrl.cluster.ray_cluster import bundle_order, check_nodes
from clawrl.config.resources import ResourcesConfig

RAY = str(Path(sys.executable).with_name("ray"))
WORKER_IP = "127.0.0.2"


# ----------------------------------------------------------------------------- pure placement rules
def test_bundle_order_puts_the_node_with_most_bundles_first():
    # Ray packed bundles 1 and 2 on node B: the trainer's slots (the first ones) go there together
    assert bundle_order({0: "A", 1: "B", 2: "B"}) == [1, 2, 0]
    # interleaved bundles: node A holds three, so slots 0-2 are A's bundles 1, 3, 4
    assert bundle_order({0: "B", 1: "A", 2: "B", 3: "A", 4: "A"}) == [1, 3, 4, 0, 2]
    # as many on each node: the node of bundle 0 first, Ray's order kept
    assert bundle_order({0: "A", 1: "A", 2: "B", 3: "B"}) == [0, 1, 2, 3]


def test_cpu_plan_numbers_trainer_then_engine_slots():
    res = ResourcesConfig(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=1)
    plan = plan_placement(res, cluster_gpus=0)
    assert (plan.mode, plan.trainer_slots, plan.engine_slots, plan.num_slots) == ("cpu", [0, 1], [2], 3)


def test_colocate_spread_over_two_nodes_is_refused():
    res = ResourcesConfig(actor_num_nodes=1, actor_num_gpus_per_node=4, colocate=True)
    plan = plan_placement(res, cluster_gpus=8)
    check_nodes(plan, ["a"] * 4)  # one host: CUDA IPC reaches every engine
    with pytest.raises(PlacementError, match="--colocate on 4 GPUs spans 2 nodes"):
        check_nodes(plan, ["a", "a", "b", "b"])
    split = plan_placement(ResourcesConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2), cluster_gpus=8)
    check_nodes(split, ["a", "a", "b", "b"])  # split placement broadcasts over NCCL: any nodes


# ----------------------------------------------------------------------------- a two-node cluster
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_mentioning(text: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line[:200] for line in ps.splitlines() if text in line and "ps -eo" not in line]


def _wait_for_two_nodes(dashboard: str, head: subprocess.Popen, worker: subprocess.Popen) -> dict:
    """{"head": node id, "worker": node id} once both nodes are alive."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert head.poll() is None and worker.poll() is None, "a `ray start` exited early"
        try:
            nodes = list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True)
        except Exception:  # the dashboard is still starting
            nodes = []
        ids = {
            role: n.node_id for n in nodes for role in ("head", "worker")
            if f"clawrl_test_{role}" in n.resources_total
        }  # fmt: skip
        if len(ids) == 2:
            return ids
        time.sleep(2)
    raise AssertionError(f"the two Ray nodes did not come up within 120 s: {nodes}")


@pytest.fixture(scope="module")
def cluster():
    """A head node (1 CPU, this machine's address) and a second node (2 CPUs, 127.0.0.2)."""
    temp = tempfile.mkdtemp(prefix="cmn", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    port, dash_port, agent_port = _free_port(), _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    common = ["--block", "--disable-usage-stats"]
    spawn = {
        "env": env,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "start_new_session": True,
    }
    head = subprocess.Popen(
        [RAY, "start", "--head", *common, "--port", str(port), "--num-cpus", "1", "--temp-dir", temp,
         "--resources", '{"clawrl_test_head": 1}', "--dashboard-host", "127.0.0.1",
         "--dashboard-port", str(dash_port)], **spawn,
    )  # fmt: skip
    worker = None
    try:
        _wait_for_port(port, head)
        worker = subprocess.Popen(
            [RAY, "start", *common, "--address", f"127.0.0.1:{port}", "--num-cpus", "2",
             "--node-ip-address", WORKER_IP, "--resources", '{"clawrl_test_worker": 1}',
             "--dashboard-agent-listen-port", str(agent_port)], **spawn,
        )  # fmt: skip
        dashboard = f"http://127.0.0.1:{dash_port}"
        nodes = _wait_for_two_nodes(dashboard, head, worker)
        yield {"address": f"127.0.0.1:{port}", "dashboard": dashboard, "nodes": nodes}
    finally:
        for process in (worker, head):
            if process is not None:
                stop_group(process)
        left = _processes_mentioning(temp)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes of the test cluster still run: {left}"


def _wait_for_port(port: int, head: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert head.poll() is None, "`ray start --head` exited early"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the head node's GCS did not listen on port {port} within 60 s")


# ----------------------------------------------------------------------------- clawrl on the cluster
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("mn"), num_train=32, num_eval=8)


def _train_flags(assets, out: Path, address: str) -> list[str]:
    return [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
        "--rollout-temperature", "0.9", "--global-batch-size", "8", "--lr", "1e-3",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--check-weight-update-equal", "--num-rollout", "2", "--ray-address", address,
        "--output-dir", str(out), "--run-name", out.name,
    ]  # fmt: skip


def _actor_nodes(dashboard: str, class_name: str) -> list[str]:
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, filters=[("class_name", "=", class_name)], detail=True)
    return [a.node_id for a in actors]


@pytest.mark.slow
def test_train_runs_with_trainer_and_engine_on_different_nodes(cluster, assets, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train", *_train_flags(assets, out, cluster["address"])],
        capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    log = result.stdout[-4000:] + result.stderr[-6000:]
    assert result.returncode == 0, log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # the engine and the trainer, on different nodes, compute the same log-probs for the same weights,
    # and the engine served the synced weights (checksums compared by --check-weight-update-equal)
    assert all(r["train/train_rollout_logprob_abs_diff"] <= 1e-5 for r in rows), log
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0]
    assert all(r["train/grad_norm"] > 0 and math.isfinite(r["train/loss"]) for r in rows)
    # PACK put two one-CPU bundles on the 2-CPU node and one on the head; the trainer's two ranks take the
    # node holding most bundles, the engine the other one
    head, worker = cluster["nodes"]["head"], cluster["nodes"]["worker"]
    assert _actor_nodes(cluster["dashboard"], "TrainWorker") == [worker, worker]
    assert _actor_nodes(cluster["dashboard"], "EngineActor") == [head]
    assert "placement over 2 nodes: trainer rank 0 -> " + worker[:8] in result.stdout + result.stderr, log


_STACKS_DRIVER = """
import sys, time
import ray
from clawrl.cluster.deadline import ActorInfo, DeadlineError, enable_stack_dumps, wait_all
from clawrl.cluster.ray_cluster import start_ray

start_ray(sys.argv[1])

@ray.remote(num_cpus=0, resources={"clawrl_test_worker": 0.01})
class Parked:
    def __init__(self):
        self.at = enable_stack_dumps("parked probe")

    def where(self):
        return self.at

    def engine_host(self):
        from clawrl.cluster.engine_actor import listen_host
        return listen_host(multi_node=True)

    def park(self):
        def parked_on_the_second_node():
            time.sleep(120)
        parked_on_the_second_node()

actor = Parked.remote()
pid, ip = ray.get(actor.where.remote(), timeout=120)
print("DRIVER", ray.util.get_node_ip_address(), "ACTOR", ip, flush=True)
print("ENGINE HOST", ray.get(actor.engine_host.remote(), timeout=60), flush=True)
try:
    wait_all([actor.park.remote()], "parking", 3.0, [ActorInfo("parked probe", pid, ip)], ["the probe"])
except DeadlineError as error:
    print("DEADLINE", error, flush=True)
ray.kill(actor)
"""


@pytest.mark.slow
def test_actor_on_another_node_listens_there_and_its_stacks_come_back(cluster):
    result = subprocess.run(
        [sys.executable, "-c", _STACKS_DRIVER, cluster["address"]], capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    log = result.stdout[-3000:] + result.stderr[-5000:]
    assert result.returncode == 0, log
    driver_ip = result.stdout.split("DRIVER ")[1].split()[0]
    assert f"ACTOR {WORKER_IP}" in result.stdout and driver_ip != WORKER_IP, log
    # an engine there would listen on its node's address, reachable from other hosts, not on loopback
    assert f"ENGINE HOST {WORKER_IP}" in result.stdout, log
    assert "DEADLINE parking: the probe did not finish within the 3 s deadline" in result.stdout, log
    stacks = result.stderr.split("---- stacks of parked probe ----", 1)
    assert len(stacks) == 2, log
    assert "parked_on_the_second_node" in stacks[1], log  # the frame the actor is stuck in, read there
