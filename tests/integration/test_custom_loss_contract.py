"""Contract of `--loss-type custom_loss --custom-loss-function-path MODULE:FN`, through the real TrainActor.

The function is called once per micro-batch as fn(args, batch, logits, sum_of_sample_mean) -> (loss,
metrics). This test's own `capture_loss` (loaded by path, as a user's plugin is) records what it receives and
the test checks: the logits' shape and dtype, that log_softmax(logits) at the response tokens equals the
trainer's log-probs (old log-probs of the same weights, and an independent transformers forward at the
rollout temperature), the batch's keys and shapes, what sum_of_sample_mean computes, that the metrics are
logged as train/<name>, and that the loss's gradient reaches every parameter.

    .venv/bin/pytest tests/integration/test_custom_loss_contract.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from flag_to_loss_worker import TEMPERATURE, job_argv, sample, train_rollout
from loss_reference import response_log_probs
from trainer_reference import VOCAB, load_reference_model, tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py

PLUGIN = f"{Path(__file__)}:capture_loss"
PROMPT_LENGTHS = [3, 5, 2, 4, 3, 6, 4, 2]
RESPONSE_LENGTHS = [4, 3, 6, 2, 5, 4, 3, 5]
REMOVED = 5  # all-zero loss mask: counted as a sample, contributes nothing
CAPTURED: list[dict] = []
"""Filled by capture_loss in the plugin's module (a separate copy of this file, loaded by path)."""


def capture_loss(args, batch, logits, sum_of_sample_mean):
    """The plugin: records its inputs, returns a REINFORCE-style loss computed from the logits."""
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
    CAPTURED.append({
        "args": (args.custom_loss_function_path, args.rollout_temperature),
        "batch": {k: v.detach().clone() if torch.is_tensor(v) else list(v) for k, v in batch.items()},
        "logits": logits.detach().clone(), "requires_grad": logits.requires_grad,
        "ones": float(sum_of_sample_mean(torch.ones_like(log_probs))),
    })  # fmt: skip
    loss = sum_of_sample_mean(-batch["advantages"] * log_probs)
    return loss, {"mask_mean": sum_of_sample_mean(batch["loss_masks"])}


def returns_a_float(args, batch, logits, sum_of_sample_mean):
    return 0.5, {}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One rollout of 8 samples (2 optimizer steps of 4, micro-batches of up to 3 samples)."""
    policy = tiny_checkpoint(tmp_path_factory.mktemp("contract") / "policy", seed=0)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(1, VOCAB, (p + r,), generator=gen).tolist() for p, r in zip(PROMPT_LENGTHS,
              RESPONSE_LENGTHS, strict=True)]  # fmt: skip
    samples = [
        sample(
            index=i,
            group=i // 4,
            tokens=t,
            response_length=r,
            reward=float(i % 3),
            removed=i == REMOVED,
            rollout_log_probs=[-1.0] * r,
        )  # fmt: skip
        for i, (t, r) in enumerate(zip(tokens, RESPONSE_LENGTHS, strict=True))
    ]
    argv = job_argv(
        policy, policy, "mbs3", ["--loss-type", "custom_loss", "--custom-loss-function-path", PLUGIN]
    )
    result = train_rollout(argv, samples)
    calls = sys.modules["clawrl_plugin_test_custom_loss_contract"].CAPTURED
    return {"policy": policy, "tokens": tokens, "result": result, "calls": list(calls)}


def _sample_of(run, total_length: int, response: list[int]) -> int:
    """The rollout index of the sample with this length and these response tokens."""
    hits = [
        i for i, t in enumerate(run["tokens"]) if len(t) == total_length and t[-len(response) :] == response
    ]
    assert len(hits) == 1, (total_length, response)
    return hits[0]


def test_logits_are_the_response_positions_at_the_rollout_temperature(run):
    calls = run["calls"]
    assert len(calls) == 4  # 2 steps x (3 + 1 samples)
    model = load_reference_model(run["policy"])
    for call in calls[:2]:  # first optimizer step: the weights are still the checkpoint's
        logits, batch = call["logits"], call["batch"]
        num_tokens = sum(batch["response_lengths"])
        assert logits.shape == (num_tokens, VOCAB) and logits.dtype == torch.float32 and call["requires_grad"]
        log_probs = torch.log_softmax(logits, -1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(log_probs, batch["old_log_probs"], atol=1e-5)
        offset = 0
        for total, resp in zip(batch["total_lengths"], batch["response_lengths"], strict=True):
            i = _sample_of(run, total, batch["tokens"][offset : offset + resp].tolist())
            with torch.no_grad():
                want, _ = response_log_probs(model, run["tokens"][i], resp, TEMPERATURE)
            assert torch.allclose(log_probs[offset : offset + resp].double(), want, atol=1e-5), i
            offset += resp


def test_batch_args_and_sum_of_sample_mean(run):
    keys = {"tokens", "loss_masks", "response_lengths", "total_lengths", "old_log_probs", "advantages",
            "rollout_log_probs"}  # fmt: skip
    for call in run["calls"]:
        batch = call["batch"]
        assert set(batch) == keys
        num_tokens = sum(batch["response_lengths"])
        for name in keys - {"response_lengths", "total_lengths"}:
            assert batch[name].shape == (num_tokens,), name
        assert call["args"] == (PLUGIN, TEMPERATURE)
    # per-sample mean over the step's 4 samples: sum_of_sample_mean(ones) sums to (samples with a mask) / 4
    ones = [sum(c["ones"] for c in run["calls"][:2]), sum(c["ones"] for c in run["calls"][2:])]
    assert ones == pytest.approx([1.0, 0.75])
    steps = run["result"]["metrics"]["train"]
    assert [s["train/mask_mean"] for s in steps] == pytest.approx([1.0, 0.75])


def test_the_loss_gradient_reaches_every_parameter(run):
    for step, grads in enumerate(run["result"]["grads"]):
        silent = [name for name, g in grads.items() if not g.abs().sum() > 0]
        assert not silent, (step, silent)
    before, after = run["result"]["weights"]
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_a_bad_return_value_names_the_flag(tmp_path):
    policy = tiny_checkpoint(tmp_path / "policy", seed=0)
    samples = [sample(index=i, group=i // 4, tokens=[5, 6, 7, 8], response_length=2, reward=float(i),
                      rollout_log_probs=[-1.0, -1.0]) for i in range(8)]  # fmt: skip
    path = f"{Path(__file__)}:returns_a_float"
    argv = job_argv(
        policy, policy, "mbs4", ["--loss-type", "custom_loss", "--custom-loss-function-path", path]
    )
    with pytest.raises(TypeError, match=r"--custom-loss-function-path .*returns_a_float.* must return"):
        train_rollout(argv, samples)
