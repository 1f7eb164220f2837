"""LoRA through the real trainer: TrainActor (FSDP2, gloo, CPU, one rank in this process) with --lora-rank 4
on a tiny qwen2.

- a step moves the adapters only (base weights bitwise unchanged), the merged weights move, the reference
  log-probs stay those of the base model; the optimizer holds the adapters alone;
- weight sync sends merged weights: an engine server that loaded the base model matches the trainer's
  checksums (--check-weight-update-equal's comparison) after a sync, not before;
- --save holds the adapters and their optimizer state, --load resumes bit for bit, a mismatching
  --lora-rank is one CheckpointError; --save-hf and `clawrl convert-checkpoint` write the merged model
  and the PEFT adapter directory, the same bytes.

    .venv/bin/pytest tests/integration/test_lora_trainer.py -x -q -p no:cacheprovider
"""

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from clawrl.config.flags import parse_job_args
from clawrl.data.train_batch import TrainBatch
from clawrl.models.loader import iter_safetensors
from clawrl.models.tiny import build_tiny_model
from clawrl.trainer.actor import TrainActor
from clawrl.trainer.checkpoint import CheckpointError, read_model_state
from clawrl.trainer.weights import iter_adapter_tensors, iter_full_tensors, local_tensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py

RESPONSE_LENGTHS = [4, 3, 5, 2]
REWARDS = [1.0, 0.0, 0.5, -1.0]
LORA = ("--lora-rank", "4", "--lora-alpha", "8")
# Per decoder block, rank * (in + out) of q, k, v, o (hidden 64, 4 heads and 2 KV heads of 16) and
# gate, up, down (intermediate 128): 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192) = 4096; two blocks.
NUM_ADAPTER_PARAMS = 8192


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return str(build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2))


def _batch(rollout_id: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(rollout_id)
    tokens = [torch.randint(1, 500, (3 + r,), generator=gen).tolist() for r in RESPONSE_LENGTHS]
    masks = [[1] * r for r in RESPONSE_LENGTHS]
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=RESPONSE_LENGTHS, loss_masks=masks,
                      rewards=REWARDS, raw_rewards=REWARDS)  # fmt: skip


def _actor(model_dir, *flags) -> TrainActor:
    job = parse_job_args([
        "--hf-checkpoint", model_dir, "--rollout-batch-size", "4", "--num-rollout", "8", "--global-batch-size", "2", "--lr", "1e-2",
        "--use-kl-loss", "--kl-loss-coef", "0.1", *flags,
    ])  # fmt: skip
    actor = TrainActor(job, device="cpu")
    try:
        actor.init(total_optimizer_steps=8)
    except Exception:
        actor.shutdown()  # leave the process group for the next test
        raise
    return actor


def _params(actor) -> dict[str, torch.Tensor]:
    return {n: local_tensor(p).detach().clone() for n, p in actor.model.named_parameters()}


def test_step_trains_adapters_only_and_optimizer_holds_only_them(model_dir):
    actor = _actor(model_dir, *LORA)
    try:
        before = _params(actor)
        merged_before = dict(iter_full_tensors(actor.model))
        adapted = {n for n in before if ".lora_" in n}
        assert len(adapted) == 28  # 7 linears x 2 blocks x (A, B)
        optimized = [p for group in actor.optimizer.param_groups for p in group["params"]]
        assert sum(p.numel() for p in optimized) == NUM_ADAPTER_PARAMS
        first = actor.train(_batch(0))
        second = actor.train(_batch(0))
        after = _params(actor)
        for name, tensor in before.items():
            if name not in adapted:
                assert torch.equal(after[name], tensor), f"{name}: a frozen base weight moved"
        assert all(after[n].abs().sum() > 0 for n in adapted if "lora_B" in n)  # B left zero: it trained
        state = [v for st in actor.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert sum(t.numel() for t in state) == 2 * NUM_ADAPTER_PARAMS  # AdamW's two moments, adapters only
        merged = dict(iter_full_tensors(actor.model))
        assert merged.keys() == merged_before.keys() and not any(".lora_" in n for n in merged)
        q = "model.layers.1.self_attn.q_proj"
        by_hand = after[f"{q}.weight"] + 2.0 * after[f"{q}.lora_B.weight"] @ after[f"{q}.lora_A.weight"]
        assert torch.allclose(merged[f"{q}.weight"], by_hand, rtol=0, atol=1e-6)
        assert not torch.equal(merged[f"{q}.weight"], merged_before[f"{q}.weight"])
        assert torch.equal(merged["model.embed_tokens.weight"], merged_before["model.embed_tokens.weight"])
        # The reference is the base model (adapters off): its log-probs of one batch stay put while the
        # policy's move, and at step 0 (B = 0) they are the policy's.
        assert first["rollout/ref_log_probs"] == second["rollout/ref_log_probs"]
        assert first["rollout/log_probs"] == first["rollout/ref_log_probs"]
        assert second["rollout/log_probs"] != second["rollout/ref_log_probs"]
        assert actor.ref_bank.shards == []  # no second copy of the base weights
    finally:
        actor.shutdown()


def test_weight_sync_sends_merged_weights_that_the_engine_checksums_match(model_dir):
    from clawrl.engine.async_engine import AsyncEngine
    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine
    from clawrl.engine.http.app import ServerThread, create_app
    from clawrl.weight_sync import WeightMismatchError, make_sender, verify_engine_weights

    actor = _actor(model_dir, *LORA)
    try:
        actor.train(_batch(0))
        dtype = actor.engine_dtype
        checksums = actor.checksums(dtype)
        assert not any(".lora_" in name for name in checksums)
        engine = AsyncEngine(Engine(EngineConfig(model_path=model_dir)), step_timeout_s=120)
        with ServerThread(create_app(engine)) as server:
            with pytest.raises(WeightMismatchError):  # the engine still has the base weights
                verify_engine_weights([server.url], checksums)
            with make_sender("colocated", engine_urls=[server.url]) as sender:
                sender.begin("1")
                for bucket in actor.weight_buckets(dtype):
                    sender.send(bucket)
                sender.finish()
            verify_engine_weights([server.url], checksums, expected_version="1")
    finally:
        actor.shutdown()


def test_checkpoint_holds_adapters_and_resumes_bit_for_bit(model_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    actor = _actor(model_dir, *LORA, "--save", str(ckpt))
    try:
        actor.train(_batch(0))
        path = actor.save(0)
        expected = actor.train(_batch(1))
        expected_params = _params(actor)
    finally:
        actor.shutdown()
    state, meta = read_model_state(path)
    assert state and all(".lora_" in name for name in state) and len(state) == 28
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"],
                            "base_model": str(Path(model_dir).resolve())}  # fmt: skip

    resumed = _actor(model_dir, *LORA, "--load", str(ckpt))
    try:
        assert resumed.rollout_id_next == 1
        got = resumed.train(_batch(1))
        assert got["train"] == expected["train"]
        got_params = _params(resumed)
        for name, tensor in expected_params.items():
            assert torch.equal(got_params[name], tensor), name
    finally:
        resumed.shutdown()
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters \(rank 4\).*--lora-rank 4"):
        _actor(model_dir, "--load", str(ckpt))
    with pytest.raises(CheckpointError, match="its adapters have --lora-rank 4 .* this run --lora-rank 2"):
        _actor(model_dir, "--lora-rank", "2", "--load", str(ckpt))


def test_hf_export_and_convert_checkpoint_write_merged_model_and_peft_adapter(model_dir, tmp_path):
    from clawrl.cli.convert_checkpoint import convert

    actor = _actor(model_dir, *LORA, "--save", str(tmp_path / "ckpt"), "--target-modules", "q_proj,down_proj")
    try:
        actor.train(_batch(0))
        actor.save(0)
        exported = actor.export_hf(str(tmp_path / "hf"))
        merged = dict(iter_full_tensors(actor.model))
        adapter = dict(iter_adapter_tensors(actor.model))
    finally:
        actor.shutdown()
    assert len(adapter) == 8  # (q_proj, down_proj) x 2 blocks x (A, B)
    on_disk = dict(iter_safetensors(exported))
    assert on_disk.keys() == merged.keys()
    assert all(torch.equal(on_disk[n], merged[n]) for n in merged)  # fp32 source: no cast
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert config["base_model_name_or_path"] == str(Path(model_dir).resolve())
    with safe_open(str(tmp_path / "hf" / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted("base_model.model." + n for n in adapter)
        for name, tensor in adapter.items():
            assert torch.equal(f.get_tensor("base_model.model." + name), tensor)

    args = argparse.Namespace(ckpt_dir=str(tmp_path / "ckpt"), to_hf=str(tmp_path / "converted"), step=None,
                              hf_checkpoint=model_dir, dtype=None, max_shard_size=10**9)  # fmt: skip
    convert(args)
    converted = dict(iter_safetensors(tmp_path / "converted"))
    assert converted.keys() == merged.keys()
    # merged on CPU from the base model's safetensors: the same bytes as the trainer's merge
    assert all(torch.equal(converted[n], merged[n]) for n in merged)
    peft_dir = tmp_path / "converted" / "adapter"
    exported_config = (tmp_path / "hf" / "adapter" / "adapter_config.json").read_text()
    assert (peft_dir / "adapter_config.json").read_text() == exported_config
    with safe_open(str(peft_dir / "adapter_model.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor("base_model.model." + n), t) for n, t in adapter.items())
