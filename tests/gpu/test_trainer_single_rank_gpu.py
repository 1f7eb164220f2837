"""The trainer's world-size-1 fast path on a real GPU: bf16 module + fp32 master against FSDP2 at one rank.

Same checkpoint (a small Qwen2 with 0.5B-like layers), same batch, same seed: one optimizer step's fp32
gradients must equal the FSDP2 path's to bf16 rounding, and offload must free the bf16 copies and the
gradient buffers along with the master.

    .venv/bin/pytest tests/gpu/test_trainer_single_rank_gpu.py      # needs CUDA
"""

import sys
from pathlib import Path

import pytest
import torch

from clawrl.data.train_batch import TrainBatch
from clawrl.trainer.actor import TrainActor
from clawrl.trainer.single_rank import SingleRankModel

NUM_GPUS = 1
pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))
from trainer_reference import make_job  # noqa: E402

VOCAB = 32768
LR = 1e-5


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from clawrl.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("policy") / "qwen2"
    return str(build_tiny_model(out, arch="qwen2", vocab_size=VOCAB, hidden_size=896, num_layers=4, num_heads=14,
                                num_kv_heads=2, intermediate_size=4864, seed=0))  # fmt: skip


def rl_batch(rollout_id: int) -> TrainBatch:
    """8 samples of 200..900 tokens (responses of half their length): several packed micro-batches."""
    gen = torch.Generator().manual_seed(rollout_id)
    lengths = torch.randint(200, 900, (8,), generator=gen).tolist()
    tokens = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    responses = [n // 2 for n in lengths]
    rewards = torch.randn(8, generator=gen).tolist()
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=responses,
                      loss_masks=[[1] * r for r in responses], rewards=rewards, raw_rewards=rewards)  # fmt: skip


def new_actor(policy: str, fast: bool) -> TrainActor:
    train = dict(lr=LR, clip_grad=1.0, global_batch_size=8, max_tokens_per_gpu=2048, fast_single_rank=fast)
    actor = TrainActor(make_job(policy, train=train), device="cuda")
    actor.init(total_optimizer_steps=10)
    return actor


def one_step(policy: str, fast: bool):
    """(metrics, {name: fp32 gradient the optimizer read}, {name: fp32 weight after the step})."""
    actor = new_actor(policy, fast)
    try:
        assert isinstance(actor.wrapped, SingleRankModel) == fast
        names = {id(p): n for n, p in actor.master.named_parameters()}
        grads = {}

        def record(optimizer, *_):
            for p in optimizer.param_groups[0]["params"]:
                grads[names[id(p)]] = _full(p.grad).float().clone()

        actor.optimizer.register_step_pre_hook(record)
        metrics = actor.train(rl_batch(0))
        weights = {n: _full(p.detach()).clone() for n, p in actor.master.named_parameters()}
        return metrics, grads, weights
    finally:
        actor.shutdown()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_one_step_gradients_equal_fsdp2_to_bf16_rounding(policy):
    fast_metrics, fast_grads, fast_weights = one_step(policy, fast=True)
    fsdp_metrics, fsdp_grads, fsdp_weights = one_step(policy, fast=False)
    assert fast_metrics["rollout/log_probs"] == pytest.approx(fsdp_metrics["rollout/log_probs"], rel=1e-3)
    (fast_step,), (fsdp_step,) = fast_metrics["train"], fsdp_metrics["train"]
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert fast_step[key] == pytest.approx(fsdp_step[key], rel=1e-2, abs=1e-6), key
    assert fast_grads.keys() == fsdp_grads.keys() and len(fast_grads) > 0
    exact = 0
    for name, g in fast_grads.items():
        ref = fsdp_grads[name]
        exact += torch.equal(g, ref)
        rel = ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert rel <= 2**-7, (name, rel)  # bf16 rounding: 8 bits of mantissa
    print(f"{exact}/{len(fast_grads)} gradients bit-identical")
    for name, w in fast_weights.items():  # one AdamW step moves each weight by at most ~lr
        assert (w - fsdp_weights[name]).abs().max().item() <= 2.5 * LR, name


def test_bf16_copies_fused_adamw_and_offload_frees_everything(policy):
    actor = new_actor(policy, fast=True)
    try:
        assert {p.dtype for p in actor.model.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in actor.master.parameters()} == {torch.float32}
        assert actor.optimizer.param_groups[0]["fused"] is True
        actor.train(rl_batch(0))
        checksums = actor.checksums(torch.bfloat16)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        num_params = sum(p.numel() for p in actor.master.parameters())
        moved = actor.offload()
        # master (4 B) + AdamW (8 B) + reference (2 B) moved; bf16 copy (2 B) and gradients (6 B) freed
        assert moved >= 12 * num_params
        assert held - torch.cuda.memory_allocated() >= 0.95 * 20 * num_params
        assert actor.checksums(torch.bfloat16) == checksums  # the master comes back for the export alone
        actor.onload()
        assert actor.checksums(torch.bfloat16) == checksums
        for c, m in zip(actor.model.parameters(), actor.master.parameters(), strict=True):
            assert torch.equal(c, m.bfloat16())  # the copies were rebuilt from the master
        assert actor.train(rl_batch(1))["train"][0]["train/grad_norm"] > 0
    finally:
        actor.shutdown()
