"""Colocated weight sync over CUDA IPC on a real GPU: a trainer-side model in this process, the engine
server (`clawrl engine`) in a subprocess on the same device (an IPC handle cannot be opened by the
process that made it), synced bucket by bucket in bf16 with the version flip.

    .venv/bin/pytest tests/gpu/test_weight_sync_gpu.py      # skipped without CUDA
"""

import subprocess
import sys
import time

import pytest
import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.http.client import EngineClient, EngineClientError
from clawrl.models.hf_io import load_model
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from clawrl.trainer.distributed import free_port
from clawrl.trainer.weights import iter_full_tensors, iter_weight_buckets
from clawrl.weight_sync import make_sender, tensor_checksum, verify_engine_weights

NUM_GPUS = 1
pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 300, 42], [7, 8, 9]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-sync-gpu")
    tokenizer = build_tiny_tokenizer(2048)
    kwargs = dict(vocab_size=2048, tokenizer=tokenizer, tie_word_embeddings=False)
    return str(build_tiny_model(root / "a", seed=0, **kwargs)), str(
        build_tiny_model(root / "b", seed=1, **kwargs)
    )


@pytest.fixture(scope="module")
def engine_url(models):
    port = free_port()
    command = [sys.executable, "-m", "clawrl.cli.main", "engine", "--model-path", models[0], "--port", str(port),
               "--device", "cuda", "--dtype", "bfloat16", "--mem-fraction-static", "0.1",
               "--max-running-requests", "8", "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                EngineClient(url, timeout=5).health()
                break
            except EngineClientError:
                assert process.poll() is None, "the engine server exited during start-up"
                assert time.monotonic() < deadline, "the engine server did not start within 300 s"
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def test_cuda_ipc_sync_loads_bf16_weights_and_flips_version(models, engine_url):
    trainer = load_model(models[1], fused=False, device="cuda", dtype=torch.float32)
    with make_sender("colocated", engine_urls=[engine_url]) as sender:
        sender.begin("gpu-1")
        for bucket in iter_weight_buckets(iter_full_tensors(trainer, torch.bfloat16), 256 * 1024):
            assert bucket[0][1].is_cuda  # the CUDA IPC path, not shared memory
            sender.send(bucket)
        assert sender.finish() == {engine_url: "gpu-1"}
        assert len(sender.stats) > 1
    checksums = {name: tensor_checksum(t) for name, t in iter_full_tensors(trainer, torch.bfloat16)}
    verify_engine_weights([engine_url], checksums, expected_version="gpu-1")
    reference = Engine(EngineConfig(model_path=models[1], device="cuda", dtype="bfloat16", num_kv_blocks=64,
                                    max_running_requests=8, enable_cuda_graph=False))  # fmt: skip
    expected = [r["output_ids"] for r in reference.generate(PROMPTS, GREEDY)]
    with EngineClient(engine_url, timeout=60) as client:
        out = client.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, "temperature": 0.0,
                                                                  "ignore_eos": True})  # fmt: skip
    assert [o["output_ids"] for o in out] == expected
