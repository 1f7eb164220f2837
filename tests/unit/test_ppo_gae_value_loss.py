"""PPO with a critic, the pure parts: GAE with the KL in the reward, the clipped value loss, explained
variance, and the `--advantage-estimator ppo` rules of config/validate.py. Every expected number is worked
out by hand in the comments."""

import re

import pytest
import torch

from clawrl.algo import compute_advantages_and_returns
from clawrl.algo.value_loss import clipped_value_loss, explained_variance
from clawrl.config.errors import ConfigError
from clawrl.config.flags import parse_job_args
from clawrl.data.train_batch import TrainBatch
from clawrl.trainer.rl_step import compute_advantages

# One 3-token response: values V, per-token KL, reward 1 at the end; gamma 0.9, lambda 0.8, kl_coef 0.1.
VALUES = [0.5, 0.2, -0.1]
KL = [0.2, -0.1, 0.3]
# token rewards rho = -0.1 * KL + [0, 0, 1]           = [-0.02, 0.01, 0.97]
# delta_2 = 0.97 + 0.9 * 0    - (-0.1)                =  1.07   (V after the end is 0)
# delta_1 = 0.01 + 0.9 * -0.1 - 0.2                   = -0.28
# delta_0 = -0.02 + 0.9 * 0.2 - 0.5                   = -0.34
# A_2 = 1.07; A_1 = -0.28 + 0.72 * 1.07 = 0.4904; A_0 = -0.34 + 0.72 * 0.4904 = 0.013088   (gamma*lambda 0.72)
ADVANTAGES = [0.013088, 0.4904, 1.07]
RETURNS = [a + v for a, v in zip(ADVANTAGES, VALUES, strict=True)]  # [0.513088, 0.6904, 0.97]


def test_gae_three_tokens_by_hand():
    adv, ret = compute_advantages_and_returns(
        "ppo", rewards_B=torch.tensor([1.0]), response_lengths=[3], loss_mask_N=torch.ones(3),
        kl_N=torch.tensor(KL), values_N=torch.tensor(VALUES), kl_coef=0.1, gamma=0.9, lambd=0.8,
    )  # fmt: skip
    assert adv.tolist() == pytest.approx(ADVANTAGES, abs=1e-6)
    assert ret.tolist() == pytest.approx(RETURNS, abs=1e-6)


def _job(*flags):
    return parse_job_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--advantage-estimator", "ppo",
                           "--gamma", "0.9", "--lambd", "0.8", "--hf-checkpoint", "/models/policy", *flags])  # fmt: skip


def test_trainer_folds_kl_of_log_probs_into_the_reward():
    """rl_step.compute_advantages (what TrainActor calls): KL from the old and reference log-probs (k1 =
    logp - ref), the critic's values per sample, and a second sample next to the first."""
    job = _job("--kl-coef", "0.1")
    batch = TrainBatch(rollout_id=0, tokens=[[5, 6, 7, 8], [5, 9, 9]], response_lengths=[3, 2],
                       loss_masks=[[1, 1, 1], [1, 1]], rewards=[1.0, 0.0], raw_rewards=[1.0, 0.0])  # fmt: skip
    ref = {0: torch.tensor([-1.0, -2.0, -3.0]), 1: torch.tensor([-1.0, -1.0])}
    log_probs = {0: ref[0] + torch.tensor(KL), 1: torch.tensor([-1.0, -1.0])}
    values = {0: torch.tensor(VALUES), 1: torch.tensor([0.25, 0.5])}
    adv, ret = compute_advantages(batch, [0, 1], job.algo, log_probs, ref, "cpu", values=values)
    assert adv[0].tolist() == pytest.approx(ADVANTAGES, abs=1e-6)
    assert ret[0].tolist() == pytest.approx(RETURNS, abs=1e-6)
    # sample 1: no KL, reward 0: delta_1 = 0 - 0.5, delta_0 = 0.9 * 0.5 - 0.25 = 0.2; A_0 = 0.2 + 0.72 * -0.5
    assert adv[1].tolist() == pytest.approx([-0.16, -0.5], abs=1e-6)
    assert ret[1].tolist() == pytest.approx([0.09, 0.0], abs=1e-6)


def test_clipped_value_loss_by_hand():
    # token 0: V - V_old = 0.5 > 0.2 -> V_clip 0.7: max((0.7-0.8)^2, (1.0-0.8)^2) = 0.04, clipped
    # token 1: unchanged value: (0 - 1)^2 = 1
    # token 2: inside the clip range: both terms (0.5 - 0)^2 = 0.25
    # token 3: V_clip 0.7 is the worse one: max((0.7-1)^2, (0.9-1)^2) = 0.09, clipped; no gradient to V
    values = torch.tensor([1.0, 0.0, 0.5, 0.9], requires_grad=True)
    old, returns = torch.tensor([0.5, 0.0, 0.45, 0.5]), torch.tensor([0.8, 1.0, 0.0, 1.0])
    loss, metrics = clipped_value_loss(values, old, returns, value_clip=0.2)
    assert loss.tolist() == pytest.approx([0.04, 1.0, 0.25, 0.09], abs=1e-6)
    assert metrics["value_clipfrac"].tolist() == [1.0, 0.0, 0.0, 1.0]
    loss.sum().backward()
    # d/dV (V - R)^2 = 2 (V - R): 0.4 and -2; token 2's two equal terms share the gradient 2 * 0.5 = 1
    assert values.grad.tolist() == pytest.approx([0.4, -2.0, 1.0, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="--value-clip must be > 0"):
        clipped_value_loss(values, old, returns, value_clip=0.0)


def test_explained_variance_by_hand():
    returns, values = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 2.0, 5.0])
    # R - V = [0, 0, 1, -1]: Var = 0.5; Var(R) = 1.25 -> 1 - 0.5 / 1.25 = 0.6
    assert explained_variance(returns, values, torch.ones(4)) == pytest.approx(0.6)
    # token 3 masked: R = [1, 2, 3] (Var 2/3), R - V = [0, 0, 1] (Var 2/9) -> 1 - 1/3
    assert explained_variance(returns, values, torch.tensor([1.0, 1.0, 1.0, 0.0])) == pytest.approx(2 / 3)
    assert explained_variance(returns, returns, torch.ones(4)) == pytest.approx(1.0)
    # the sums an all-reduce would add up: two identical "ranks" give the same ratio
    doubled = explained_variance(returns, values, torch.ones(4), sum_fn=lambda s: 2 * s)
    assert doubled == pytest.approx(0.6)
    assert explained_variance(torch.zeros(3), torch.ones(3), torch.ones(3)) is None  # nothing to explain
    assert explained_variance(returns, values, torch.zeros(4)) is None


def test_validate_fills_critic_lr_and_accepts_ppo():
    job = _job("--lr", "3e-4")
    assert job.train.critic_lr == 3e-4
    assert job.algo.value_clip == 0.2 and job.algo.num_critic_only_steps == 0
    assert _job("--critic-lr", "1e-2").train.critic_lr == 1e-2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--advantage-estimator", "grpo", "--critic-lr", "1e-5"],
            "--critic-lr 1e-05 needs --advantage-estimator ppo",
        ),
        (
            ["--advantage-estimator", "grpo", "--num-critic-only-steps", "2"],
            "--num-critic-only-steps 2 needs",
        ),
        (
            ["--advantage-estimator", "gspo", "--critic-lr-warmup-iters", "3"],
            "--critic-lr-warmup-iters 3 needs",
        ),
        (
            ["--advantage-estimator", "dr_grpo", "--critic-load", "/x"],
            "--critic-load /x needs --advantage-estimator",
        ),
        (["--loss-type", "sft_loss"], "--loss-type sft_loss uses no advantages"),
        (["--model-impl", "hf"], "--model-impl hf is not supported"),
        (["--critic-load", "/no/such/dir"], "--critic-load '/no/such/dir' does not exist"),
        (
            ["--min-lr", "1e-3", "--lr", "1e-2", "--critic-lr", "1e-4"],
            "--min-lr 0.001 must be <= --critic-lr",
        ),
        (["--value-clip", "0"], "--value-clip must be > 0"),
        (["--num-critic-only-steps", "-1"], "--num-critic-only-steps must be >= 0"),
    ],
)
def test_impossible_ppo_combinations_fail_before_ray(flags, message):
    # a later --advantage-estimator overrides _job's ppo
    with pytest.raises(ConfigError, match=re.escape(message)):
        _job(*flags)
