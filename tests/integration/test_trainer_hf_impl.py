"""`--model-impl hf` (transformers' model behind the trainer interface) against the native model (1 rank, CPU).

Same checkpoint, same packed micro-batches: the log-probs agree to 1e-5 and the gradients of the same RL loss
to 1e-5 of the gradient scale; parameter names are the checkpoint's; activation checkpointing (transformers'
layers take keyword arguments) and HF export work through the adapter too.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from trainer_reference import (
    TEMPERATURE,
    StepRecorder,
    full_weights,
    make_batch,
    make_job,
    max_relative_error,
    running_actor,
    tiny_checkpoint,
)

from clawrl.models.attention import VarlenAttention
from clawrl.trainer.hf_model import HFCausalLM, load_hf_model
from clawrl.trainer.rl_step import compute_log_probs, plan_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("policy"), seed=0, scale=0.1)


def _log_probs_and_grads(policy, impl):
    batch = make_batch(0)
    job = make_job(policy, model_impl=impl, train=dict(global_batch_size=8))  # one step: same weights
    with running_actor(job) as actor:
        names = [n for n, _ in actor.model.named_parameters()]
        steps = plan_steps(batch, global_batch_size=8, dp_size=1, max_tokens_per_gpu=24, micro_batch_size=1,
                           max_response_len=16)  # fmt: skip
        log_probs = compute_log_probs(actor.model, batch, steps, 0, actor.device, TEMPERATURE)
        recorder = StepRecorder(actor)
        actor.train(batch)
    return names, log_probs, recorder.grads[0]


def test_hf_impl_matches_native_log_probs_and_gradients(policy):
    native_names, native_lp, native_grads = _log_probs_and_grads(policy, "native")
    hf_names, hf_lp, hf_grads = _log_probs_and_grads(policy, "hf")
    assert sorted(hf_names) == sorted(native_names)  # HF names, unchanged
    for i, lp in native_lp.items():
        torch.testing.assert_close(hf_lp[i], lp, rtol=0, atol=1e-5)
    assert max_relative_error(hf_grads, native_grads) <= 1e-5


def test_adapter_packs_sequences_into_a_padded_batch(policy):
    model = load_hf_model(policy)
    assert isinstance(model, HFCausalLM) and model.lm_head.weight is model.model.embed_tokens.weight
    lengths = [6, 1, 9]
    ids = torch.randint(1, 500, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model(ids, positions, VarlenAttention.from_lengths(lengths))
        alone = [model.model(input_ids=s[None]).last_hidden_state[0] for s in ids.split(lengths)]
    assert packed.shape == (sum(lengths), model.config.hidden_size)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="packed batch has 16 tokens but cu_seqlens ends at 15"):
        model(ids, positions, VarlenAttention.from_lengths([6, 9]))


def test_hf_impl_checkpointing_and_export(policy, tmp_path):
    batch = make_batch(1)
    results = []
    for checkpointing in (False, True):
        job = make_job(policy, model_impl="hf", gradient_checkpointing=checkpointing)
        with running_actor(job) as actor:
            actor.train(batch)
            results.append(full_weights(actor))
            if checkpointing:
                actor.export_hf(str(tmp_path / "export"))
    plain, recomputed = results
    assert all(torch.equal(recomputed[n], w) for n, w in plain.items())
    saved = load_file(tmp_path / "export" / "model.safetensors")
    assert saved.keys() == plain.keys() and all(torch.equal(saved[n], w) for n, w in plain.items())
    assert (tmp_path / "export" / "tokenizer.json").is_file()
