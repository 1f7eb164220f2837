"""Reward post-processing and advantage estimators (slime reference section 4.1-4.2).

Two steps, in this order:
  1. `postprocess_rewards` turns raw scalar rewards of a rollout into per-sample rewards for the estimator
     (group mean/std normalisation for grpo/gspo, mean only for dr_grpo and reinforce_plus_plus_baseline,
     leave-one-out baseline for rloo, raw for ppo and reinforce_plus_plus). Groups are consecutive blocks of
     `n_samples_per_prompt` samples.
  2. `compute_advantages_and_returns` turns those per-sample rewards (plus per-token KL and critic values where
     the estimator uses them) into per-token advantages and returns over one micro-batch.
`whiten_advantages` is `--normalize-advantages`: masked whitening, optionally reduced across ranks.

Shapes: B = samples, N = sum(response_lengths) flat response tokens (samples concatenated in order),
T = max response length, G = prompt groups, n = samples per prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from clawrl.algo.segments import as_lengths, broadcast_to_tokens, pad_by_lengths, unpad

ADVANTAGE_ESTIMATORS = (
    "grpo",
    "gspo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)
# Estimators whose advantage is the (normalised) scalar reward alone; KL can only enter them as a loss term.
_OUTCOME_ONLY = ("grpo", "gspo", "dr_grpo", "rloo")


def _grouped(rewards_B: Tensor, n_samples_per_prompt: int) -> Tensor:
    """View rewards as [G, n]; refuses counts that are not whole groups."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"--n-samples-per-prompt must be >= 1, got {n_samples_per_prompt}")
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per sample), got shape {tuple(rewards_B.shape)}")
    if rewards_B.numel() % n_samples_per_prompt != 0:
        # slime silently falls back to one batch-wide group here, which mixes prompts; we refuse instead.
        raise ValueError(
            f"{rewards_B.numel()} rewards are not whole groups of --n-samples-per-prompt "
            f"{n_samples_per_prompt}; group normalisation needs every prompt's samples together "
            "(did a filter drop single samples instead of whole groups?)"
        )
    return rewards_B.view(-1, n_samples_per_prompt)


def _as_float(rewards_B: Tensor) -> Tensor:
    return rewards_B if rewards_B.is_floating_point() else rewards_B.float()


def normalize_group_rewards(
    rewards_B: Tensor,
    n_samples_per_prompt: int,
    *,
    subtract_mean: bool = True,
    divide_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO group normalisation: r <- (r - mean_group) / (std_group + eps), unbiased std.

    n_samples_per_prompt == 1 returns the rewards unchanged (a one-sample group has no baseline and no std).
    A group whose rewards are all equal gives exactly 0 (not NaN, not round-off noise / eps).
    """
    rewards_B = _as_float(rewards_B)
    rewards_GN = _grouped(rewards_B, n_samples_per_prompt)
    if n_samples_per_prompt == 1:
        return rewards_B.clone()
    out_GN = rewards_GN
    if subtract_mean:
        out_GN = out_GN - out_GN.mean(dim=1, keepdim=True)
    if divide_std:
        out_GN = out_GN / (rewards_GN.std(dim=1, unbiased=True, keepdim=True) + eps)
    # The float mean of equal values can be off by one ulp; with std ~ 1 ulp that would leave ~1e-2 noise.
    constant_G1 = (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True)
    if subtract_mean:
        out_GN = torch.where(constant_G1, torch.zeros_like(out_GN), out_GN)
    return out_GN.reshape(-1)


def leave_one_out_rewards(rewards_B: Tensor, n_samples_per_prompt: int) -> Tensor:
    """RLOO: r_i - mean of the other n-1 rewards of its group."""
    if n_samples_per_prompt < 2:
        raise ValueError(
            f"--advantage-estimator rloo needs --n-samples-per-prompt >= 2 (got {n_samples_per_prompt}): "
            "the baseline is the mean of the other samples of the prompt"
        )
    rewards_GN = _grouped(_as_float(rewards_B), n_samples_per_prompt)
    others_mean_GN = (rewards_GN.sum(dim=1, keepdim=True) - rewards_GN) / (n_samples_per_prompt - 1)
    return (rewards_GN - others_mean_GN).reshape(-1)


def postprocess_rewards(
    estimator: str,
    rewards_B: Tensor,
    n_samples_per_prompt: int,
    *,
    rewards_normalization: bool = True,
    grpo_std_normalization: bool = True,
) -> Tensor:
    """Per-sample rewards as `compute_advantages_and_returns` expects them for `estimator`.

    rewards_normalization=False is `--disable-rewards-normalization` (no group mean/std; rloo's leave-one-out
    baseline is the estimator itself and always applies); grpo_std_normalization=False is
    `--disable-grpo-std-normalization` (grpo/gspo subtract the mean only).
    """
    _check_estimator(estimator)
    if estimator == "rloo":
        return leave_one_out_rewards(rewards_B, n_samples_per_prompt)
    if not rewards_normalization or estimator in ("ppo", "reinforce_plus_plus"):
        return _as_float(rewards_B).clone()  # no grouping involved, so any sample count is fine
    divide_std = estimator in ("grpo", "gspo") and grpo_std_normalization
    return normalize_group_rewards(rewards_B, n_samples_per_prompt, divide_std=divide_std)


def _check_estimator(estimator: str) -> None:
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"--advantage-estimator {estimator!r} is not one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )


def discounted_reverse_cumsum(x_BT: Tensor, discount: float, chunk_size: int = 128) -> Tensor:
    """y_t = sum_{s>=t} discount^(s-t) x_s along dim 1, as chunked matmuls (no per-token Python loop).

    Within a chunk of K positions y = x @ W with W[s, t] = discount^(s-t) for s >= t; chunks are then joined
    right to left by adding discount^(K-t) * y(first position of the next chunk). Powers never exceed K, so
    this is stable for any discount in [0, 1]. Zero padding after a row's end contributes nothing.
    Computed in fp64 (cheap at these sizes; immune to TF32 matmuls) and returned in x_BT's dtype.
    """
    num_rows, num_cols = x_BT.shape
    if num_cols == 0:
        return x_BT.clone()
    k = min(chunk_size, num_cols)
    num_chunks = -(-num_cols // k)
    padded_BT = torch.nn.functional.pad(x_BT.to(torch.float64), (0, num_chunks * k - num_cols))
    x_BCK = padded_BT.view(num_rows, num_chunks, k)
    idx_K = torch.arange(k, device=x_BT.device, dtype=torch.float64)
    offset_KK = idx_K[:, None] - idx_K[None, :]  # [s, t] = s - t
    discount_t = torch.tensor(discount, device=x_BT.device, dtype=torch.float64)
    weight_KK = torch.where(offset_KK >= 0, discount_t ** offset_KK.clamp(min=0), torch.zeros_like(offset_KK))
    y_BCK = x_BCK @ weight_KK
    carry_decay_K = discount_t ** (k - idx_K)
    chunks = list(y_BCK.unbind(dim=1))
    for c in range(num_chunks - 2, -1, -1):
        chunks[c] = chunks[c] + carry_decay_K[None, :] * chunks[c + 1][:, :1]
    return torch.stack(chunks, dim=1).reshape(num_rows, -1)[:, :num_cols].to(x_BT.dtype)


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--{name} must be in [0, 1], got {value}")


def _reinforce_plus_plus(rewards_B, lengths_B, loss_mask_N, kl_N, kl_coef, gamma) -> Tensor:
    """Token reward -kl_coef*kl_t*mask_t, scalar reward at the last mask-1 token, discounted return."""
    # where(), not a product: a KL of inf under mask 0 must not become 0 * inf = NaN.
    token_reward_N = torch.where(loss_mask_N > 0, -kl_coef * kl_N * loss_mask_N, torch.zeros_like(kl_N))
    reward_BT = pad_by_lengths(token_reward_N, lengths_B)
    mask_BT = pad_by_lengths(loss_mask_N, lengths_B)
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT > 0, positions_BT, -1).max(dim=1).values
    # A sample with no loss-mask token has nowhere to put its reward; it trains on nothing anyway.
    has_target_B = last_B >= 0
    scalar_B = torch.where(has_target_B, rewards_B.to(reward_BT.dtype), torch.zeros_like(reward_BT[:, 0]))
    reward_BT = reward_BT.scatter_add(1, last_B.clamp(min=0)[:, None], scalar_B[:, None])
    return unpad(discounted_reverse_cumsum(reward_BT, gamma), lengths_B)


def _gae(rewards_B, lengths_B, kl_N, values_N, kl_coef, gamma, lambd) -> tuple[Tensor, Tensor]:
    """PPO: token reward -kl_coef*kl_t, scalar reward at the last response position, GAE over values."""
    reward_BT = pad_by_lengths(-kl_coef * kl_N, lengths_B)
    values_BT = pad_by_lengths(values_N.to(reward_BT.dtype), lengths_B)
    last_B = (lengths_B - 1).clamp(min=0)
    scalar_B = torch.where(
        lengths_B > 0, rewards_B.to(reward_BT.dtype), torch.zeros_like(rewards_B, dtype=reward_BT.dtype)
    )
    reward_BT = reward_BT.scatter_add(1, last_B[:, None], scalar_B[:, None])
    # V after the response end is 0: the zero padding provides it (pad one extra column for the last token).
    next_values_BT = torch.nn.functional.pad(values_BT[:, 1:], (0, 1))
    delta_BT = reward_BT + gamma * next_values_BT - values_BT
    advantages_BT = discounted_reverse_cumsum(delta_BT, gamma * lambd)
    advantages_N = unpad(advantages_BT, lengths_B)
    return advantages_N, advantages_N + values_N.to(advantages_N.dtype)


@torch.no_grad()
def compute_advantages_and_returns(
    estimator: str,
    *,
    rewards_B: Tensor,
    response_lengths: Sequence[int] | Tensor,
    loss_mask_N: Tensor,
    kl_N: Tensor | None = None,
    values_N: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Per-token (advantages_N, returns_N) for one micro-batch.

    rewards_B must already be post-processed (`postprocess_rewards`). kl_N is the per-token KL estimate between
    the policy and the reference (needed when kl_coef != 0); values_N are critic values (ppo only).
    grpo/gspo/dr_grpo/rloo broadcast the sample reward; returns equal advantages except for ppo.
    Runs without autograd: advantages are constants of the loss.
    """
    _check_estimator(estimator)
    num_tokens = loss_mask_N.numel()
    lengths_B = as_lengths(response_lengths, num_tokens, loss_mask_N.device)
    if rewards_B.numel() != lengths_B.numel():
        raise ValueError(f"got {rewards_B.numel()} rewards for {lengths_B.numel()} response_lengths")
    rewards_B = _as_float(rewards_B).to(loss_mask_N.device)
    if estimator in _OUTCOME_ONLY and kl_coef != 0:
        raise ValueError(
            f"--kl-coef {kl_coef} has no effect with --advantage-estimator {estimator} (the KL penalty is "
            "not part of its advantage); use --use-kl-loss --kl-loss-coef instead"
        )
    if num_tokens == 0:
        empty_N = rewards_B.new_zeros(0)
        return empty_N, empty_N.clone()
    if estimator in _OUTCOME_ONLY:
        advantages_N = broadcast_to_tokens(rewards_B, lengths_B, num_tokens)
        return advantages_N, advantages_N.clone()
    mask_N = loss_mask_N.to(rewards_B.dtype)
    kl_N = _kl_or_zeros(kl_N, kl_coef, mask_N)
    if estimator == "reinforce_plus_plus_baseline":
        advantages_N = broadcast_to_tokens(rewards_B, lengths_B, num_tokens) - kl_coef * kl_N
        return advantages_N, advantages_N.clone()
    _check_discount("gamma", gamma)
    if estimator == "reinforce_plus_plus":
        returns_N = _reinforce_plus_plus(rewards_B, lengths_B, mask_N, kl_N, kl_coef, gamma)
        return returns_N, returns_N.clone()
    _check_discount("lambd", lambd)
    if values_N is None or values_N.numel() != num_tokens:
        got = "none" if values_N is None else f"{values_N.numel()} values"
        raise ValueError(
            f"--advantage-estimator ppo needs critic values for all {num_tokens} tokens, got {got}"
        )
    return _gae(rewards_B, lengths_B, kl_N, values_N, kl_coef, gamma, lambd)


def _kl_or_zeros(kl_N: Tensor | None, kl_coef: float, mask_N: Tensor) -> Tensor:
    if kl_N is None:
        if kl_coef != 0:
            raise ValueError(f"--kl-coef {kl_coef} needs per-token KL values (kl_N), got none")
        return torch.zeros_like(mask_N)
    if kl_N.numel() != mask_N.numel():
        raise ValueError(f"kl_N has {kl_N.numel()} entries, the micro-batch has {mask_N.numel()} tokens")
    return kl_N.to(mask_N.dtype)


@torch.no_grad()
def whiten_advantages(
    adv_N: Tensor,
    mask_N: Tensor,
    *,
    sum_fn: Callable[[Tensor], Tensor] | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """`--normalize-advantages`: (A - mean) / sqrt(var + eps) with masked, Bessel-corrected statistics.

    sum_fn receives the float64 tensor [sum(A*m), sum(A^2*m), sum(m)] and must return it summed over every
    rank that shares the statistics (e.g. an all-reduce over the data-parallel group); None = this tensor only.
    Every entry is transformed; entries with mask 0 are meaningless afterwards (the loss ignores them).
    """
    mask64_N = mask_N.to(torch.float64)
    adv64_N = adv_N.to(torch.float64)
    sums_3 = torch.stack([(adv64_N * mask64_N).sum(), (adv64_N.square() * mask64_N).sum(), mask64_N.sum()])
    if sum_fn is not None:
        sums_3 = sum_fn(sums_3)
    total_x, total_x2, count = (float(v) for v in sums_3.tolist())
    if count <= 0:
        raise ValueError("--normalize-advantages: the loss mask selects no token, cannot whiten advantages")
    mean = total_x / count
    var = max(total_x2 / count - mean * mean, 0.0)
    if count > 1:
        var *= count / (count - 1)  # Bessel correction
    return ((adv64_N - mean) / (var + eps) ** 0.5).to(adv_N.dtype)
