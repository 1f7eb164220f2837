"""PPO clip / clip-higher / dual-clip, GSPO and critic losses against hand-computed numbers."""

import math

import pytest
import torch

from clawrl.algo import gspo_policy_loss, ppo_policy_loss
from clawrl.algo.value_loss import clipped_value_loss

ATOL = 1e-5
LN = math.log


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def ratios_to_log_probs(ratios, old):
    """New log-probs such that exp(new - old) equals the given ratios."""
    return torch.tensor([o + LN(r) for r, o in zip(ratios, old, strict=True)], requires_grad=True)


OLD = [-1.0, -2.0, -0.5, -1.5, -3.0]


def test_ppo_clip_values_metrics_and_gradient():
    # eps 0.2 -> clip range [0.8, 1.2]. Per token (ratio r, advantage A):
    # t0 r=1.5 A=1 : max(-1.5, -1.2) = -1.2  clipped   grad 0
    # t1 r=0.9 A=2 : max(-1.8, -1.8) = -1.8  unclipped grad d(-A r)/dlogp = -A r = -1.8
    # t2 r=0.5 A=-1: max(0.5, 0.8)   = 0.8   clipped   grad 0
    # t3 r=1.5 A=-1: max(1.5, 1.2)   = 1.5   unclipped grad -A r = 1.5
    # t4 r=0.5 A=1 : max(-0.5, -0.8) = -0.5  unclipped grad -0.5 (pessimistic side is never clipped)
    # ppo_kl = old - new = -ln r: [-0.4054651, 0.1053605, 0.6931472, -0.4054651, 0.6931472]
    ratios = [1.5, 0.9, 0.5, 1.5, 0.5]
    log_probs = ratios_to_log_probs(ratios, OLD)
    adv = torch.tensor([1.0, 2.0, -1.0, -1.0, 1.0])
    loss, metrics = ppo_policy_loss(log_probs, torch.tensor(OLD), adv, eps_clip=0.2, eps_clip_high=0.2)
    close(loss, [-1.2, -1.8, 0.8, 1.5, -0.5])
    close(metrics["pg_clipfrac"], [1.0, 0.0, 1.0, 0.0, 0.0])
    close(metrics["ppo_kl"], [-0.4054651, 0.1053605, 0.6931472, -0.4054651, 0.6931472])
    loss.sum().backward()
    close(log_probs.grad, [0.0, -1.8, 0.0, 1.5, -0.5])


def test_ppo_clip_higher():
    # eps 0.2, eps_high 0.28 -> [0.8, 1.28]. A=1: r=1.25 inside -> -1.25 (symmetric eps would give -1.2);
    # r=1.5 -> -1.28 clipped; r=0.7 (A=-1) -> max(0.7, 0.8) = 0.8 clipped at the unchanged lower bound.
    old = [0.0, 0.0, 0.0]
    log_probs = ratios_to_log_probs([1.25, 1.5, 0.7], old)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, metrics = ppo_policy_loss(log_probs, torch.tensor(old), adv, eps_clip=0.2, eps_clip_high=0.28)
    close(loss, [-1.25, -1.28, 0.8])
    close(metrics["pg_clipfrac"], [0.0, 1.0, 1.0])
    symmetric, _ = ppo_policy_loss(log_probs, torch.tensor(old), adv, eps_clip=0.2)
    close(symmetric, [-1.2, -1.2, 0.8])


def test_ppo_dual_clip():
    # c = 3. A=-1 r=4: standard max(4, 1.2) = 4, dual min(4, 3) = 3 (grad 0).
    # A=-1 r=2: min(max(2, 1.2), 3) = 2 (grad -A r = 2). A=1 r=4: -1.2, dual clip only applies to A < 0.
    # A=-2 r=0.5: max(1.0, 1.6) = 1.6, min(1.6, 6) = 1.6.
    old = [0.0, 0.0, 0.0, 0.0]
    log_probs = ratios_to_log_probs([4.0, 2.0, 4.0, 0.5], old)
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    loss, _ = ppo_policy_loss(log_probs, torch.tensor(old), adv, eps_clip=0.2, eps_clip_c=3.0)
    close(loss, [3.0, 2.0, -1.2, 1.6])
    loss.sum().backward()
    close(log_probs.grad, [0.0, 2.0, 0.0, 0.0])


@pytest.mark.parametrize("bad_c", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(bad_c):
    with pytest.raises(ValueError, match=f"--eps-clip-c must be > 1.*got {bad_c}"):
        ppo_policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), eps_clip=0.2, eps_clip_c=bad_c)


def test_ppo_on_policy_ratio_one():
    # old == new: ratio 1, loss = -A, no clipping, ppo_kl 0.
    loss, metrics = ppo_policy_loss(torch.zeros(2), torch.zeros(2), torch.tensor([0.7, -0.3]), eps_clip=0.2)
    close(loss, [-0.7, 0.3])
    close(metrics["pg_clipfrac"], [0.0, 0.0])
    close(metrics["ppo_kl"], [0.0, 0.0])


def test_gspo_sequence_ratio():
    # Sample 1 (len 3, mask [1, 1, 0]): token log-ratios (new - old) [0.3, 0.1, 5.0]; masked mean 0.2 ->
    #   ratio e^0.2 = 1.2214028, A = 1 -> clipped to 1.2: loss -1.2 on all 3 tokens, clipfrac 1, ppo_kl -0.2.
    # Sample 2 (len 1): log-ratio -0.1 -> ratio e^-0.1 = 0.9048374, A = -1 -> max(0.9048374, 0.9048374).
    old = torch.tensor([-1.0, -1.0, -1.0, -2.0])
    log_probs = old + torch.tensor([0.3, 0.1, 5.0, -0.1])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    loss, metrics = gspo_policy_loss(
        log_probs,
        old,
        adv,
        response_lengths=[3, 1],
        loss_mask_N=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        eps_clip=0.2,
    )
    close(loss, [-1.2, -1.2, -1.2, 0.9048374])
    close(metrics["pg_clipfrac"], [1.0, 1.0, 1.0, 0.0])
    close(metrics["ppo_kl"], [-0.2, -0.2, -0.2, 0.1])


def test_gspo_gradient_flows_through_sequence_mean():
    # One sample, mask [1, 1, 0], log-ratios [0.1, -0.1, 2.0]: masked mean 0 -> ratio 1, A = 1, loss -1 per token.
    # L = sum over the 3 tokens of -A * exp(mean) -> dL/dlogp_t = 3 * (-1) * 1 * (1/2) for masked t, 0 otherwise.
    old = torch.zeros(3)
    log_probs = torch.tensor([0.1, -0.1, 2.0], requires_grad=True)
    loss, _ = gspo_policy_loss(
        log_probs,
        old,
        torch.ones(3),
        response_lengths=[3],
        loss_mask_N=torch.tensor([1.0, 1.0, 0.0]),
        eps_clip=0.2,
    )
    close(loss, [-1.0, -1.0, -1.0])
    loss.sum().backward()
    close(log_probs.grad, [-1.5, -1.5, 0.0])


def test_gspo_all_masked_sample_has_ratio_one():
    loss, metrics = gspo_policy_loss(
        torch.tensor([3.0, 0.0]),
        torch.zeros(2),
        torch.tensor([2.0, 1.0]),
        response_lengths=[1, 1],
        loss_mask_N=torch.tensor([0.0, 1.0]),
        eps_clip=0.2,
    )
    close(loss, [-2.0, -1.0])
    close(metrics["ppo_kl"], [0.0, 0.0])


def test_value_loss_clip():
    # value_clip 0.2. t0: V=1, V_old=0.5, R=2: V_clip = 0.7, max((0.7-2)^2, (1-2)^2) = max(1.69, 1) = 1.69, clipped.
    # t1: V=0, V_old=0, R=0.3: both 0.09, not clipped.
    values = torch.tensor([1.0, 0.0], requires_grad=True)
    loss, metrics = clipped_value_loss(
        values, torch.tensor([0.5, 0.0]), torch.tensor([2.0, 0.3]), value_clip=0.2
    )
    close(loss, [1.69, 0.09])
    close(metrics["value_clipfrac"], [1.0, 0.0])
    loss.sum().backward()
    # t0 clipped: V_clip is constant in V beyond the clip -> grad 0; t1: 2 (V - R) = -0.6.
    close(values.grad, [0.0, -0.6])
