"""Reward post-processing and advantage estimators against hand-computed numbers (clawrl.algo.advantages)."""

import math

import pytest
import torch

from clawrl.algo import (
    compute_advantages_and_returns,
    discounted_reverse_cumsum,
    leave_one_out_rewards,
    normalize_group_rewards,
    postprocess_rewards,
    whiten_advantages,
)

ATOL = 1e-5


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- group normalisation ---------------------------------------------------------------------------------


def test_grpo_normalisation_hand_computed():
    # Group [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503,
    # 0.5 / (0.5773503 + 1e-6) = 0.8660239 (sqrt(3)/2 = 0.8660254 without eps). Group [2, 2, 2, 2] -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    out = normalize_group_rewards(rewards, 4)
    close(out, [0.8660239, -0.8660239, -0.8660239, 0.8660239, 0, 0, 0, 0])


def test_grpo_two_sample_groups():
    # [3, 1]: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2) -> +-1/sqrt(2) = +-0.7071068 (eps shifts 5e-7).
    close(normalize_group_rewards(torch.tensor([3.0, 1.0]), 2), [0.7071064, -0.7071064])


def test_equal_reward_group_is_exactly_zero_not_noise():
    # In float32 the mean of three copies of 0.4900934100151062 is 1 ulp off that value and the unbiased std is
    # ~1 ulp too, so a plain (r - mean) / (std + 1e-6) gives 0.0288 for every sample (measured). Must be 0.
    rewards = torch.tensor([0.4900934100151062] * 3 + [0.1] * 3)
    out = normalize_group_rewards(rewards, 3)
    assert torch.equal(out, torch.zeros(6))
    assert torch.equal(normalize_group_rewards(rewards, 3, divide_std=False), torch.zeros(6))


def test_mean_only_normalisation():
    out = normalize_group_rewards(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, divide_std=False)
    close(out, [0.5, -0.5, -0.5, 0.5])


def test_n_equals_one_leaves_rewards_unchanged():
    rewards = torch.tensor([0.3, -1.0, 5.0])
    out = normalize_group_rewards(rewards, 1)
    assert torch.equal(out, rewards)
    assert not torch.isnan(out).any()


def test_integer_rewards_become_float():
    close(normalize_group_rewards(torch.tensor([1, 0]), 2, divide_std=False), [0.5, -0.5])


def test_partial_group_is_an_error_not_a_batch_wide_group():
    with pytest.raises(ValueError, match=r"not whole groups of --n-samples-per-prompt 2"):
        normalize_group_rewards(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), 2)


def test_rloo_leave_one_out_baseline():
    # Group [1, 0, 0, 1], sum 2: 1 - (2-1)/3 = 0.6666667; 0 - 2/3 = -0.6666667.
    # Group [3, 0, 0, 1], sum 4: 3 - 1/3 = 2.6666667; 0 - 4/3 = -1.3333333; 1 - 3/3 = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 1.0])
    out = leave_one_out_rewards(rewards, 4)
    close(out, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 8 / 3, -4 / 3, -4 / 3, 0.0])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="rloo needs --n-samples-per-prompt >= 2"):
        leave_one_out_rewards(torch.tensor([1.0, 2.0]), 1)


@pytest.mark.parametrize(
    ("estimator", "kwargs", "expected"),
    [
        ("grpo", {}, [0.8660239, -0.8660239, -0.8660239, 0.8660239]),
        ("gspo", {}, [0.8660239, -0.8660239, -0.8660239, 0.8660239]),
        ("grpo", {"grpo_std_normalization": False}, [0.5, -0.5, -0.5, 0.5]),
        ("dr_grpo", {}, [0.5, -0.5, -0.5, 0.5]),
        ("reinforce_plus_plus_baseline", {}, [0.5, -0.5, -0.5, 0.5]),
        ("rloo", {}, [2 / 3, -2 / 3, -2 / 3, 2 / 3]),
        ("ppo", {}, [1.0, 0.0, 0.0, 1.0]),
        ("reinforce_plus_plus", {}, [1.0, 0.0, 0.0, 1.0]),
        ("grpo", {"rewards_normalization": False}, [1.0, 0.0, 0.0, 1.0]),
    ],
)
def test_postprocess_rewards_per_estimator(estimator, kwargs, expected):
    close(postprocess_rewards(estimator, torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, **kwargs), expected)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "reinforce_plus_plus_baseline"])
def test_postprocess_rewards_one_sample_per_prompt_is_unchanged(estimator):
    rewards = torch.tensor([0.3, -1.0])
    assert torch.equal(postprocess_rewards(estimator, rewards, 1), rewards)


def test_postprocess_rewards_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="--advantage-estimator 'grpoo' is not one of"):
        postprocess_rewards("grpoo", torch.tensor([1.0]), 1)


# --- advantage estimators --------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "dr_grpo", "rloo"])
def test_outcome_estimators_broadcast_reward(estimator):
    adv, ret = compute_advantages_and_returns(
        estimator,
        rewards_B=torch.tensor([0.5, -1.0]),
        response_lengths=[2, 3],
        loss_mask_N=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),
    )
    close(adv, [0.5, 0.5, -1.0, -1.0, -1.0])
    close(ret, [0.5, 0.5, -1.0, -1.0, -1.0])


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "dr_grpo", "rloo"])
def test_kl_coef_with_outcome_estimator_is_an_error(estimator):
    with pytest.raises(ValueError, match="--kl-coef 0.1 has no effect .* use --use-kl-loss"):
        compute_advantages_and_returns(
            estimator,
            rewards_B=torch.tensor([1.0]),
            response_lengths=[1],
            loss_mask_N=torch.ones(1),
            kl_N=torch.zeros(1),
            kl_coef=0.1,
        )


def test_length_one_responses_and_tensor_lengths():
    adv, _ = compute_advantages_and_returns(
        "grpo",
        rewards_B=torch.tensor([1.0, -2.0, 0.0]),
        response_lengths=torch.tensor([1, 1, 1]),
        loss_mask_N=torch.ones(3),
    )
    close(adv, [1.0, -2.0, 0.0])


def test_response_lengths_must_match_tokens():
    with pytest.raises(ValueError, match="response_lengths sum to 4 but the per-token tensor has 5"):
        compute_advantages_and_returns(
            "grpo", rewards_B=torch.tensor([1.0, 2.0]), response_lengths=[2, 2], loss_mask_N=torch.ones(5)
        )


def test_reinforce_plus_plus_hand_computed():
    # kl_coef 0.5, gamma 0.5. Sample 1 (len 3, mask [1, 1, 0], kl [0.1, 0.2, 0.3], reward 1):
    #   rho = [-0.05, -0.1, 0] (masked kl dropped); reward at the last mask-1 token (index 1): [-0.05, 0.9, 0]
    #   G_2 = 0, G_1 = 0.9, G_0 = -0.05 + 0.5 * 0.9 = 0.4
    # Sample 2 (len 2, mask [1, 0], kl [0.4, 0.5], reward 2): rho = [-0.2 + 2, 0] -> G = [1.8, 0]
    adv, ret = compute_advantages_and_returns(
        "reinforce_plus_plus",
        rewards_B=torch.tensor([1.0, 2.0]),
        response_lengths=[3, 2],
        loss_mask_N=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]),
        kl_N=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
        kl_coef=0.5,
        gamma=0.5,
    )
    close(adv, [0.4, 0.9, 0.0, 1.8, 0.0])
    close(ret, [0.4, 0.9, 0.0, 1.8, 0.0])


def test_reinforce_plus_plus_gamma_one():
    # Same data, gamma 1: sample 1 G = [-0.05 + 0.9, 0.9, 0] = [0.85, 0.9, 0]; sample 2 [1.8, 0].
    adv, _ = compute_advantages_and_returns(
        "reinforce_plus_plus",
        rewards_B=torch.tensor([1.0, 2.0]),
        response_lengths=[3, 2],
        loss_mask_N=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]),
        kl_N=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
        kl_coef=0.5,
    )
    close(adv, [0.85, 0.9, 0.0, 1.8, 0.0])


def test_reinforce_plus_plus_all_masked_sample_and_no_kl():
    # Sample 1 is all masked: its reward has no token to land on -> zeros (and no NaN); sample 2 length 1.
    adv, _ = compute_advantages_and_returns(
        "reinforce_plus_plus",
        rewards_B=torch.tensor([5.0, 3.0]),
        response_lengths=[2, 1],
        loss_mask_N=torch.tensor([0.0, 0.0, 1.0]),
    )
    close(adv, [0.0, 0.0, 3.0])


def test_advantages_carry_no_gradient_and_masked_inf_kl_is_ignored():
    # kl of inf under mask 0 (e.g. a tool-output token) must not turn into NaN; the live kl_N must not leak
    # gradients into the advantages. Sample: mask [1, 0], kl [0.2, inf], kl_coef 1, reward 1, gamma 1:
    # rho = [-0.2 + 1, 0] -> G = [0.8, 0].
    kl = torch.tensor([0.2, math.inf], requires_grad=True)
    adv, _ = compute_advantages_and_returns(
        "reinforce_plus_plus",
        rewards_B=torch.tensor([1.0]),
        response_lengths=[2],
        loss_mask_N=torch.tensor([1.0, 0.0]),
        kl_N=kl,
        kl_coef=1.0,
    )
    assert not adv.requires_grad
    close(adv, [0.8, 0.0])


def test_kl_coef_without_kl_values_is_an_error():
    with pytest.raises(ValueError, match="--kl-coef 0.1 needs per-token KL values"):
        compute_advantages_and_returns(
            "reinforce_plus_plus",
            rewards_B=torch.tensor([1.0]),
            response_lengths=[1],
            loss_mask_N=torch.ones(1),
            kl_coef=0.1,
        )


def test_reinforce_plus_plus_baseline_hand_computed():
    # A_t = r - kl_coef * kl_t with r already mean-subtracted: 0.5 - 0.1*[0.2, 0.4] = [0.48, 0.46]; -0.5 - 0.1.
    adv, ret = compute_advantages_and_returns(
        "reinforce_plus_plus_baseline",
        rewards_B=torch.tensor([0.5, -0.5]),
        response_lengths=[2, 1],
        loss_mask_N=torch.ones(3),
        kl_N=torch.tensor([0.2, 0.4, 1.0]),
        kl_coef=0.1,
    )
    close(adv, [0.48, 0.46, -0.6])
    close(ret, [0.48, 0.46, -0.6])


def test_ppo_gae_hand_computed():
    # gamma 0.9, lambd 0.8 (gamma*lambd = 0.72), kl_coef 0.1.
    # Sample 1: values [0.5, 0.4, 0.2], kl [0.1, 0.2, 0.1], reward 1 at the LAST POSITION (index 2) even though
    # its loss mask is 0 (slime pitfall 3): rho = [-0.01, -0.02, 0.99]
    #   delta_2 = 0.99 + 0 - 0.2 = 0.79; delta_1 = -0.02 + 0.9*0.2 - 0.4 = -0.24; delta_0 = -0.01 + 0.36 - 0.5 = -0.15
    #   A_2 = 0.79; A_1 = -0.24 + 0.72*0.79 = 0.3288; A_0 = -0.15 + 0.72*0.3288 = 0.086736
    #   R = A + V = [0.586736, 0.7288, 0.99]
    # Sample 2 (length 1): value 0.3, kl 0.4, reward -1: delta = -0.04 - 1 - 0.3 = -1.34; R = -1.04.
    adv, ret = compute_advantages_and_returns(
        "ppo",
        rewards_B=torch.tensor([1.0, -1.0]),
        response_lengths=[3, 1],
        loss_mask_N=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        kl_N=torch.tensor([0.1, 0.2, 0.1, 0.4]),
        values_N=torch.tensor([0.5, 0.4, 0.2, 0.3]),
        kl_coef=0.1,
        gamma=0.9,
        lambd=0.8,
    )
    close(adv, [0.086736, 0.3288, 0.79, -1.34])
    close(ret, [0.586736, 0.7288, 0.99, -1.04])


def test_ppo_default_gamma_lambd_one_zero_values():
    # gamma = lambd = 1, V = 0: A_t = sum of future rewards = [1, 1]; R = A.
    adv, ret = compute_advantages_and_returns(
        "ppo",
        rewards_B=torch.tensor([1.0]),
        response_lengths=[2],
        loss_mask_N=torch.ones(2),
        values_N=torch.zeros(2),
    )
    close(adv, [1.0, 1.0])
    close(ret, [1.0, 1.0])


def test_ppo_needs_values():
    with pytest.raises(ValueError, match="ppo needs critic values for all 2 tokens, got none"):
        compute_advantages_and_returns(
            "ppo", rewards_B=torch.tensor([1.0]), response_lengths=[2], loss_mask_N=torch.ones(2)
        )


def test_gamma_out_of_range():
    with pytest.raises(ValueError, match=r"--gamma must be in \[0, 1\], got 1.5"):
        compute_advantages_and_returns(
            "reinforce_plus_plus",
            rewards_B=torch.tensor([1.0]),
            response_lengths=[1],
            loss_mask_N=torch.ones(1),
            gamma=1.5,
        )


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 128])
def test_discounted_reverse_cumsum_chunks(chunk_size):
    # discount 0.5 over [1, 2, 3, 4, 5]: y4 = 5, y3 = 4 + 2.5 = 6.5, y2 = 3 + 3.25 = 6.25,
    # y1 = 2 + 3.125 = 5.125, y0 = 1 + 2.5625 = 3.5625. Row 2: discount 0.5 over [1, 0, 0, 0, 0] (padded) -> itself.
    x = torch.tensor([[1.0, 2, 3, 4, 5], [1.0, 0, 0, 0, 0]])
    close(
        discounted_reverse_cumsum(x, 0.5, chunk_size=chunk_size),
        [[3.5625, 5.125, 6.25, 6.5, 5], [1, 0, 0, 0, 0]],
    )
    close(discounted_reverse_cumsum(x, 1.0, chunk_size=chunk_size), [[15.0, 14, 12, 9, 5], [1, 0, 0, 0, 0]])
    close(discounted_reverse_cumsum(x, 0.0, chunk_size=chunk_size), x.tolist())


def test_discounted_reverse_cumsum_long_sequence_geometric_series():
    # All ones, length L = 1000, discount d = 0.99: y_t = (1 - d^(L-t)) / (1 - d), a closed form.
    length, d = 1000, 0.99
    y = discounted_reverse_cumsum(torch.ones(1, length, dtype=torch.float64), d)
    expected = [(1 - d ** (length - t)) / (1 - d) for t in range(length)]
    torch.testing.assert_close(y[0], torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)


# --- whitening -------------------------------------------------------------------------------------------


def test_whiten_hand_computed():
    # Masked [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]; masked 100 -> (100 - 2) / 1 = 98.
    out = whiten_advantages(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    close(out, [-1.0, 0.0, 1.0, 98.0])


def test_whiten_across_ranks_with_sum_fn():
    # Rank A holds [1, 2] (mask 1, 1), rank B [3, 5] (mask 1, 0): global masked stats are those of [1, 2, 3].
    adv_a, mask_a = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])
    adv_b, mask_b = torch.tensor([3.0, 5.0]), torch.tensor([1.0, 0.0])

    def local_sums(adv, mask):
        adv, mask = adv.double(), mask.double()
        return torch.stack([(adv * mask).sum(), (adv * adv * mask).sum(), mask.sum()])

    out_a = whiten_advantages(adv_a, mask_a, sum_fn=lambda s: s + local_sums(adv_b, mask_b))
    out_b = whiten_advantages(adv_b, mask_b, sum_fn=lambda s: s + local_sums(adv_a, mask_a))
    close(out_a, [-1.0, 0.0])
    close(out_b, [1.0, 3.0])


def test_whiten_empty_mask_is_an_error():
    with pytest.raises(ValueError, match="--normalize-advantages: the loss mask selects no token"):
        whiten_advantages(torch.tensor([1.0, 2.0]), torch.zeros(2))


def test_whiten_single_token_gives_zero_not_nan():
    out = whiten_advantages(torch.tensor([3.0, 7.0]), torch.tensor([1.0, 0.0]))
    # mean 3, var 0 (no Bessel with one token): 0 / sqrt(1e-8) = 0; masked 7 -> 4 / 1e-4 = 40000.
    close(out, [0.0, 40000.0], atol=1e-2)
    assert math.isfinite(out.sum().item())
