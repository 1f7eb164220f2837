"""PPO with a critic through the real trainer: TrainActor (FSDP2, gloo, CPU) with --advantage-estimator ppo
on a tiny model, then `clawrl train` end to end (Ray, engine, 3 rollouts).

- on a fixed batch the critic's value loss falls rollout after rollout, and --num-critic-only-steps leaves
  the policy untouched until its rollouts are over;
- the critic's checkpoint (<save>/critic) restores identical values, optimizer and schedule with --load,
  and serves as --critic-load; offload/onload moves the critic too, bit for bit;
- `clawrl train --advantage-estimator ppo` logs the critic's metrics, finite, and saves its checkpoint.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
from loop_assets import REWARD, build_loop_assets

from clawrl.config.flags import parse_job_args
from clawrl.data.train_batch import TrainBatch
from clawrl.models.tiny import build_tiny_model
from clawrl.trainer.actor import TrainActor
from clawrl.trainer.checkpoint import CheckpointError
from clawrl.trainer.weights import iter_full_tensors, local_tensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py

RESPONSE_LENGTHS = [4, 3, 5, 2]
REWARDS = [1.0, 0.0, 0.5, -1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    return str(build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2))


def _batch(rollout_id: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, 500, (3 + r,), generator=gen).tolist() for r in RESPONSE_LENGTHS]
    masks = [[1] * r for r in RESPONSE_LENGTHS]
    masks[2][1] = 0  # a tool-output token: no loss, no explained-variance weight
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=RESPONSE_LENGTHS, loss_masks=masks,
                      rewards=REWARDS, raw_rewards=REWARDS)  # fmt: skip


def _actor(model_dir, *flags) -> TrainActor:
    job = parse_job_args([
        "--hf-checkpoint", model_dir, "--rollout-batch-size", "4", "--num-rollout", "8",
        "--advantage-estimator", "ppo", "--global-batch-size", "2", "--lr", "1e-3", "--critic-lr", "1e-2",
        *flags,
    ])  # fmt: skip
    actor = TrainActor(job, device="cpu")
    try:
        actor.init(total_optimizer_steps=16)
    except Exception:
        actor.shutdown()  # leave the process group for the next test
        raise
    return actor


def _weights(model) -> dict[str, torch.Tensor]:
    return dict(iter_full_tensors(model))


def _values(actor: TrainActor, batch: TrainBatch) -> dict[int, torch.Tensor]:
    return actor.critic.values(batch, actor._plan(batch), actor.rank)


def test_value_loss_falls_and_critic_only_rollouts_leave_the_policy(model_dir):
    # gamma = lambda = 1: the returns are the rewards, whatever the values, so the critic regresses on a
    # fixed target and its loss must fall.
    actor = _actor(model_dir, "--num-critic-only-steps", "4", "--critic-lr", "2e-3")
    try:
        policy_before = _weights(actor.model)
        losses = []
        for rollout_id in range(4):
            metrics = actor.train(_batch(rollout_id))
            assert all("train/loss" not in step for step in metrics["train"])  # the policy did not train
            losses.append(sum(s["train/value_loss"] for s in metrics["train"]) / len(metrics["train"]))
        assert all(torch.equal(policy_before[k], v) for k, v in _weights(actor.model).items())
        assert (
            all(a > b for a, b in zip(losses[:-1], losses[1:], strict=True)) and losses[-1] < 0.5 * losses[0]
        ), losses
        assert len(metrics["train"]) == 2 and metrics["train/values"] != 0.0  # the head left zero
        values, batch = _values(actor, _batch(4)), _batch(4)
        metrics = actor.train(batch)  # the critic-only rollouts are over: the policy trains too
        # gamma = lambda = 1, no KL: A_t = reward - V_t; the logged mean is over samples of masked means
        masks = [torch.tensor(m, dtype=torch.float32) for m in batch.loss_masks]
        expected = [((REWARDS[i] - values[i]) * masks[i]).sum() / masks[i].sum() for i in range(4)]
        assert metrics["rollout/advantages"] == pytest.approx(float(sum(expected)) / 4, rel=1e-5)
        assert all(math.isfinite(s["train/loss"]) and s["train/value_loss"] > 0 for s in metrics["train"])
        assert any(not torch.equal(policy_before[k], v) for k, v in _weights(actor.model).items())
    finally:
        actor.shutdown()


def test_first_rollout_values_are_zero_and_explained_variance_zero(model_dir):
    actor = _actor(model_dir)
    try:
        metrics = actor.train(_batch(0))
        assert metrics["train/values"] == 0.0 and metrics["train/explained_variance"] == pytest.approx(0.0)
        # lambda = gamma = 1 and V = 0: every advantage is the sample's reward; returns too
        assert metrics["rollout/advantages"] == pytest.approx(sum(REWARDS) / 4)
        step = metrics["train"][0]
        assert {"train/value_loss", "train/value_clipfrac", "train/critic_lr", "train/loss"} <= set(step)
        # step 0 (samples 0 and 1, per-sample mean): ((0 - 1)^2 + (0 - 0)^2) / 2 = 0.5, nothing clipped
        assert step["train/value_loss"] == pytest.approx(0.5) and step["train/value_clipfrac"] == 0.0
    finally:
        actor.shutdown()


def test_checkpoint_round_trip_and_offload(model_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    actor = _actor(model_dir, "--save", save, "--gamma", "0.9", "--lambd", "0.8")
    try:
        for rollout_id in range(2):
            actor.train(_batch(rollout_id))
        saved_values = _values(actor, _batch(2))
        saved_steps = actor.critic.schedule.step_count
        actor.save(1)
        moved = actor.offload()
        critic_bytes = sum(p.numel() * 4 for p in actor.critic.model.parameters())
        assert (
            moved > critic_bytes
            and local_tensor(actor.critic.model.value_head.weight).untyped_storage().nbytes() == 0
        )
        actor.onload()
        assert all(torch.equal(saved_values[i], v) for i, v in _values(actor, _batch(2)).items())
        after_save = actor.train(_batch(2))
    finally:
        actor.shutdown()
    assert (tmp_path / "ckpt" / "critic" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    resumed = _actor(model_dir, "--save", save, "--load", save, "--gamma", "0.9", "--lambd", "0.8")
    try:
        assert resumed.rollout_id_next == 2 and resumed.critic.schedule.step_count == saved_steps
        assert all(torch.equal(saved_values[i], v) for i, v in _values(resumed, _batch(2)).items())
        again = resumed.train(_batch(2))  # same weights, optimizer state and RNG: the same update
        for a, b in zip(after_save["train"], again["train"], strict=True):
            assert b["train/value_loss"] == pytest.approx(a["train/value_loss"], rel=1e-6)
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-6)
    finally:
        resumed.shutdown()

    initialised = _actor(model_dir, "--critic-load", str(tmp_path / "ckpt" / "critic"))
    try:  # --critic-load of a critic checkpoint: its trunk and head, not a fresh zero head
        assert all(torch.equal(saved_values[i], v) for i, v in _values(initialised, _batch(2)).items())
    finally:
        initialised.shutdown()


def test_load_without_critic_checkpoint_is_one_clear_error(model_dir, tmp_path):
    save = str(tmp_path / "grpo")
    job = parse_job_args(["--hf-checkpoint", model_dir, "--rollout-batch-size", "4", "--num-rollout", "2",
                          "--save", save])  # fmt: skip
    actor = TrainActor(job, device="cpu")
    try:
        actor.init(total_optimizer_steps=2)
        actor.save(0)
    finally:
        actor.shutdown()
    with pytest.raises(CheckpointError, match="policy checkpoint is iteration 1 but .*critic has no critic"):
        _actor(model_dir, "--load", save).shutdown()


@pytest.mark.slow
def test_clawrl_train_ppo_three_rollouts(tmp_path):
    assets = build_loop_assets(tmp_path / "assets", num_train=32, num_eval=4)
    out, save = tmp_path / "run", tmp_path / "ckpt"
    argv = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
        "--rollout-temperature", "0.9", "--global-batch-size", "8", "--lr", "1e-3", "--critic-lr", "1e-2",
        "--advantage-estimator", "ppo", "--gamma", "0.95", "--lambd", "0.9", "--kl-coef", "0.05",
        "--num-critic-only-steps", "1", "--num-rollout", "3", "--save", str(save),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--check-weight-update-equal",
        "--output-dir", str(out), "--run-name", "ppo",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train", *argv], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for name in ("train/value_loss", "train/value_clipfrac", "train/explained_variance", "train/values"):
            assert math.isfinite(row[name]), (row["step"], name)
        assert row["train/value_loss"] > 0
    assert "train/loss" not in rows[0] and "train/loss" in rows[1]  # --num-critic-only-steps 1
    assert rows[0]["train/values"] == 0.0 and rows[2]["train/values"] != 0.0  # the critic learned
    assert rows[2]["rollout/ref_log_probs"] != rows[2]["rollout/log_probs"]  # the policy moved: KL > 0
    assert (save / "critic" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (save / "critic" / "iter_0000003" / "meta.json").is_file()
