"""The trainer's GPU path on a real GPU (1 rank, NCCL): bf16 compute over fp32 master weights, FlashAttention
varlen, the bf16 LM-head log-prob function, fused AdamW, offload/onload of CUDA memory, export.

    .venv/bin/pytest tests/gpu/test_trainer_gpu.py      # skipped without CUDA
"""

import sys
from pathlib import Path

import pytest
import torch

from clawrl.models.attention import _flash_varlen_usable
from clawrl.trainer.actor import TrainActor

NUM_GPUS = 1
pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))
from trainer_reference import full_weights, make_batch, make_job, tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("policy"), seed=0)


@pytest.fixture
def actor(policy):
    # FSDP2 (its fp32 sharded parameters are asserted below); the fast path: test_trainer_single_rank_gpu.py
    actor = TrainActor(make_job(policy, train=dict(lr=1e-3, fast_single_rank=False)), device="cuda")
    actor.init(total_optimizer_steps=10)
    yield actor
    actor.shutdown()


def test_bf16_training_step_on_fp32_master_weights(actor):
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in actor.model.parameters())
    assert actor.optimizer.param_groups[0]["fused"] is True
    assert _flash_varlen_usable(torch.zeros(4, 4, 16, device="cuda", dtype=torch.bfloat16))  # head_dim 16
    first = actor.train(make_batch(0))
    step = first["train"][0]
    # Log-prob pass and training forward run the same kernels on the same micro-batches.
    assert abs(step["train/ppo_kl"]) <= 1e-6 and abs(step["train/kl_loss"]) <= 1e-6
    assert step["train/pg_clipfrac"] == 0.0
    assert 0 < first["train"][1]["train/grad_norm"] < float("inf")
    before = full_weights(actor)
    actor.train(make_batch(1))
    after = full_weights(actor)
    assert all(w.dtype == torch.float32 for w in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_offload_frees_cuda_memory_and_onload_restores_it(actor, tmp_path):
    actor.train(make_batch(0))
    checksums = actor.checksums()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = actor.offload()
    freed = held - torch.cuda.memory_allocated()
    assert moved > 0 and freed >= 0.9 * moved
    assert actor.checksums() == checksums  # parameters come back for the gather and leave again
    buckets = [pair for bucket in actor.weight_buckets(torch.bfloat16) for pair in bucket]
    assert all(t.dtype == torch.bfloat16 and t.is_cuda for _, t in buckets)
    actor.onload()
    assert actor.checksums() == checksums
    actor.train(make_batch(1))
    actor.export_hf(str(tmp_path / "export"))
    assert (tmp_path / "export" / "model.safetensors").is_file()
