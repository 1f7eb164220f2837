"""`clawrl train --rollout-external-engine-addrs` against a separately started `clawrl engine` process (real
HTTP, real Ray, CPU): 2 rollouts, weights pushed through SGLang's routes after each, checked by checksum.

Two weight paths: the broadcast in SGLang's payloads (gloo here; /init_weights_update_group then
/update_weights_from_distributed per bucket, one broadcast per tensor) and the HF directory
(--update-weight-transport disk: /update_weights_from_disk). `--check-weight-update-equal` makes each sync
compare the engine's checksums with the trainer's (a mismatch fails the run); afterwards the engine must
hold exactly the weights of the run's final HF export (--save-hf) as version 2. Also: discovery names the
address of an engine that serves another model, or does not answer.

    .venv/bin/pytest tests/integration/test_external_engines.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from loop_assets import REWARD, build_loop_assets

from clawrl.cluster.external_engines import ExternalEngineError, ExternalEnginePool
from clawrl.models.loader import iter_safetensors
from clawrl.models.tiny import build_tiny_model
from clawrl.weight_sync.checksum import tensor_checksum

pytestmark = pytest.mark.slow  # two training runs of ~45 s each on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("external-assets"), num_train=32, num_eval=4)


@pytest.fixture(scope="module")
def engine(assets, tmp_path_factory):
    """A `clawrl engine` process of its own on a free port; yields its address HOST:PORT."""
    port = free_port()
    log = tmp_path_factory.mktemp("external-engine") / "engine.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "clawrl.cli.main", "engine", "--model-path", assets["model"], "--port", str(port),
             "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://{addr}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "clawrl engine did not start within 120 s"
            time.sleep(0.5)
        yield addr
    finally:
        process.terminate()
        process.wait(30)


def train(assets, addr, workdir: Path, *extra: str) -> list[dict]:
    """Run 2 rollouts against the external engine; the metric rows."""
    argv = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--custom-rm-path", REWARD, "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "16", "--num-rollout", "2",
        "--rollout-external-engine-addrs", addr, "--check-weight-update-equal",
        "--save-hf", str(workdir / "hf_{rollout_id}"), "--output-dir", str(workdir / "out"), *extra,
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "train", *argv], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=400)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"external engine http://{addr}: model {assets['model']}, dtype float32" in result.stderr
    assert "1 engine(s) ready" in result.stderr
    return [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]


def engine_holds_the_final_export(addr, export_dir: Path) -> None:
    state = httpx.get(f"http://{addr}/weights_checksum", timeout=60).json()
    assert state["weight_version"] == "2"
    exported = {name: tensor_checksum(t.to(torch.float32)) for name, t in iter_safetensors(export_dir)}
    assert state["checksums"] == exported


def checked_syncs(rows: list[dict]) -> list[int]:
    return [row["step"] for row in rows if "perf/check_weight_update_time" in row]


def test_train_against_an_external_engine_through_sglangs_broadcast(assets, engine, tmp_path):
    rows = train(assets, engine, tmp_path)
    assert checked_syncs(rows) == [0, 1]  # a checked sync after each of the 2 rollouts
    assert all(row["perf/update_weights_bytes"] > 0 for row in rows if row["step"] in (0, 1))
    engine_holds_the_final_export(engine, tmp_path / "hf_1")


def test_train_against_an_external_engine_through_the_disk(assets, engine, tmp_path):
    disk = tmp_path / "weights"
    rows = train(
        assets, engine, tmp_path, "--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk)
    )
    assert checked_syncs(rows) == [0, 1]
    assert all("perf/update_weights_write_time" in row for row in rows if row["step"] in (0, 1))
    assert list(disk.iterdir()) == []  # each weight_v{N:06d}/ is removed once loaded (no --keep-files)
    engine_holds_the_final_export(engine, tmp_path / "hf_1")


def test_discovery_names_an_engine_serving_another_model(assets, engine, tmp_path):
    other = build_tiny_model(tmp_path / "other", arch="qwen2", vocab_size=4096, hidden_size=64, num_layers=2)
    with pytest.raises(ExternalEngineError) as info:
        ExternalEnginePool([engine], hf_checkpoint=str(other)).start(30)
    assert f"external engine http://{engine} serves another model" in str(info.value)
    assert "vocab_size 2048 != 4096" in str(info.value)
    assert ExternalEnginePool([engine], hf_checkpoint=assets["model"]).start(30) == [f"http://{engine}"]


def test_discovery_names_an_engine_that_does_not_answer():
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(ExternalEngineError, match=f"external engine http://{addr} .* does not answer"):
        ExternalEnginePool([addr], hf_checkpoint=None).start(5)
