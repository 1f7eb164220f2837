"""Trainer checks (1 rank, in-process, CPU fp32): packed gradients equal a plain unpacked reference, log-probs
are bit-reproducible, HF export round-trips into transformers and the engine, bad input is one clear error,
SFT trains through the same path.

The reference (trainer_reference.py) is transformers' own model in fp64, one sample at a time, with the full
log_softmax and the loss written out by hand; the trainer packs several samples per micro-batch under a
24-token budget, runs FSDP2 (1 rank), the chunked fused LM-head log-prob function, and two optimizer steps
per rollout (the second with old log-probs from before the first, so the PPO clip is active).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_reference import (
    TEMPERATURE,
    StepRecorder,
    full_weights,
    load_reference_model,
    make_batch,
    make_job,
    max_relative_error,
    reference_grads,
    reference_step_loss,
    running_actor,
    sample_log_probs,
    set_weights,
    tiny_checkpoint,
)

from clawrl.models.attention import VarlenAttention
from clawrl.trainer.checkpoint import CheckpointError
from clawrl.trainer.packing import PackingError
from clawrl.trainer.rl_step import compute_log_probs, plan_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("policy"), seed=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("reference"), seed=1)


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].double().flatten() for n in sorted(tensors)])


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_packed_gradients_equal_unpacked_reference(policy, reference, per_token):
    batch = make_batch(0)
    job = make_job(policy, ref_load=reference, algo=dict(calculate_per_token_loss=per_token))
    with running_actor(job) as actor:
        steps = plan_steps(batch, global_batch_size=4, dp_size=1, max_tokens_per_gpu=24, micro_batch_size=1,
                           max_response_len=16)  # fmt: skip
        assert all(s.plan.num_micro_batches >= 2 for s in steps)  # really packed into several micro-batches
        recorder = StepRecorder(actor)
        metrics = actor.train(batch)["train"]
    assert metrics[1]["train/pg_clipfrac"] > 0  # the second step's ratios leave [0.8, 1.28]

    model, ref_model = load_reference_model(policy), load_reference_model(reference)
    with torch.no_grad():
        old = {i: sample_log_probs(model, batch.tokens[i], batch.response_lengths[i])[0] for i in range(8)}
        ref = {
            i: sample_log_probs(ref_model, batch.tokens[i], batch.response_lengths[i])[0] for i in range(8)
        }
    for step, ids in enumerate([[0, 1, 2, 3], [4, 5, 6, 7]]):
        if step == 1:
            set_weights(model, recorder.weights[0])  # the trainer's weights after its first step
        loss = reference_step_loss(model, batch, ids, old, ref, per_token=per_token)
        want = reference_grads(model, loss)
        got = recorder.grads[step]
        assert metrics[step]["train/loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-8)
        assert max_relative_error(got, want) <= 1e-6
        assert ((_flat(got) - _flat(want)).norm() / _flat(want).norm()).item() <= 1e-6


def test_log_probs_twice_are_bitwise_identical(policy):
    batch = make_batch(1)
    with running_actor(make_job(policy)) as actor:  # no --ref-load: the reference is the initial policy
        steps = plan_steps(batch, global_batch_size=4, dp_size=1, max_tokens_per_gpu=24, micro_batch_size=1,
                           max_response_len=16)  # fmt: skip

        def log_probs():
            return compute_log_probs(actor.model, batch, steps, 0, actor.device, TEMPERATURE)

        first, second = log_probs(), log_probs()
        with actor.ref_bank.swapped_into(actor.model):
            ref = log_probs()
        actor.offload()
        actor.onload()
        after_offload = log_probs()
        for i in range(len(batch)):
            for other in (second, ref, after_offload):
                assert torch.equal(first[i], other[i]), i
        step = actor.train(batch)["train"][0]
    assert step["train/ppo_kl"] == 0.0 and step["train/kl_loss"] == 0.0 and step["train/pg_clipfrac"] == 0.0
    model = load_reference_model(policy)
    with torch.no_grad():
        for i in range(len(batch)):
            want = sample_log_probs(model, batch.tokens[i], batch.response_lengths[i])[0]
            torch.testing.assert_close(first[i].double(), want, rtol=0, atol=1e-5)


def test_export_hf_loads_in_transformers_and_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine
    from clawrl.engine.core.request import SamplingParams

    source = tiny_checkpoint(tmp_path / "source", seed=3, scale=0.25)  # peaked logits: no near-tie argmax
    out = tmp_path / "export"
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, 500, (n,), generator=gen) for n in (7, 12, 3)]
    ids, pos = torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs])
    with running_actor(make_job(source, train=dict(lr=1e-3))) as actor:
        actor.train(make_batch(2))
        weights = full_weights(actor)
        actor.export_hf(str(out))
        with torch.no_grad():
            hidden = actor.model(ids, pos, VarlenAttention.from_lengths([len(s) for s in seqs]))
            trainer_logits = hidden @ actor.model.lm_head.weight.t()

    saved = load_file(out / "model.safetensors")
    assert saved.keys() == weights.keys()  # tied: no lm_head.weight, as transformers saves it
    assert all(torch.equal(saved[n], w) for n, w in weights.items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    set_weights(direct, weights)
    with torch.no_grad():
        hf_logits = torch.cat([exported(s[None]).logits[0] for s in seqs])
        assert torch.equal(hf_logits, torch.cat([direct(s[None]).logits[0] for s in seqs]))
    scale = hf_logits.abs().max().item()
    assert (hf_logits - trainer_logits).abs().max().item() <= 1e-5 * scale

    engine = Engine(EngineConfig(model_path=str(out), num_kv_blocks=64, block_size=4))
    prompts = [s.tolist() for s in seqs]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            want = exported.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8
            )
        assert result["output_ids"] == want[0, len(prompt) :].tolist()


def test_load_of_another_hidden_size_is_one_error_naming_the_path(policy, tmp_path):
    ckpt = tmp_path / "ckpt"
    with running_actor(make_job(policy, save=str(ckpt))) as actor:
        actor.train(make_batch(0))
        actor.save(0)
    narrow = tiny_checkpoint(tmp_path / "narrow", hidden_size=32)
    with pytest.raises(CheckpointError) as info, running_actor(make_job(narrow, load=str(ckpt))):
        pass
    message = str(info.value)
    assert message.startswith(f"{ckpt / 'iter_0000001' / 'dcp'}: the checkpoint does not fit the model")
    assert "'model.embed_tokens.weight' has shape [512, 64], the model's is [512, 32]" in message
    assert "\n" not in message and len(message) < 600  # one line, not DCP's per-rank report


def test_ref_load_of_another_architecture_is_one_error_naming_the_path(policy, tmp_path):
    qwen3 = tiny_checkpoint(tmp_path / "qwen3", arch="qwen3")
    with pytest.raises(ValueError) as info, running_actor(make_job(policy, ref_load=qwen3)):
        pass
    message = str(info.value)
    assert message.startswith(f"--ref-load {qwen3}: the weights do not fit the policy model: ")
    assert "no tensor 'model.layers.0.self_attn.q_proj.bias'" in message  # Qwen3 has no qkv bias
    assert "another architecture" in message and "\n" not in message


def test_token_budget_smaller_than_a_sample_names_flag_and_length(policy):
    batch = make_batch(0)
    first_too_long = next((i, n) for i, n in enumerate(batch.total_lengths[:4]) if n > 8)
    with (
        running_actor(make_job(policy, train=dict(max_tokens_per_gpu=8))) as actor,
        pytest.raises(PackingError) as info,
    ):
        actor.train(batch)
    i, n = first_too_long
    assert str(info.value).startswith(
        f"--max-tokens-per-gpu 8 is smaller than one sample (sample {i} has {n} tokens)"
    )


def test_sft_loss_trains_through_the_same_path(policy):
    batch = make_batch(3)
    job = make_job(policy, train=dict(loss_type="sft_loss", lr=3e-3, global_batch_size=8),
                   algo=dict(use_kl_loss=False, kl_loss_coef=0.0, entropy_coef=0.0))  # fmt: skip
    with running_actor(job) as actor:
        losses = [actor.train(batch)["train"][0]["train/loss"] for _ in range(5)]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.95 * losses[0]
    model = load_reference_model(policy)  # first loss = per-sample mean of -log p over masked tokens
    with torch.no_grad():
        want = 0.0
        for i in range(len(batch)):
            logp = sample_log_probs(model, batch.tokens[i], batch.response_lengths[i])[0]
            mask = torch.tensor(batch.loss_masks[i], dtype=torch.float64)
            want += (-(logp * mask).sum() / mask.sum().clamp(min=1)).item() / len(batch)
    assert losses[0] == pytest.approx(want, rel=1e-6)


def _grad_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([g.double().flatten() for g in grads.values()]).norm())


def test_clip_grad_scales_gradients_to_the_limit_and_leaves_smaller_ones_alone(policy):
    # The same first optimizer step three times: unclipped, a limit far above the norm, a limit below it.
    runs = {}
    for clip in (0.0, 1e6, 1e-3):
        with running_actor(make_job(policy, train={"clip_grad": clip})) as actor:
            recorder = StepRecorder(actor)
            metrics = actor.train(make_batch())["train"][0]
            runs[clip] = (metrics["train/grad_norm"], recorder.grads[0])
    norm, free = runs[0.0]
    assert norm == pytest.approx(_grad_norm(free), rel=1e-6) and norm > 1e-3
    assert runs[1e6][0] == norm and all(torch.equal(runs[1e6][1][n], free[n]) for n in free)  # untouched
    clipped_norm, clipped = runs[1e-3]
    assert clipped_norm == norm  # the metric is the norm before clipping, as slime logs it
    assert _grad_norm(clipped) == pytest.approx(1e-3, rel=1e-4)
    for name in free:  # one common factor, limit / norm
        torch.testing.assert_close(clipped[name], free[name] * (1e-3 / (norm + 1e-6)), rtol=1e-5, atol=1e-12)
