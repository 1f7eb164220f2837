"""Train-inference mismatch correction: TIS / MIS importance weights, rejection sampling, mismatch metrics.

The engine samples with log-probs `rollout_log_probs`; the trainer recomputes `old_log_probs` with the same
weights. They differ (kernels, precision, batching), so the policy loss is off-policy by
  delta_t = old_log_probs_t - rollout_log_probs_t,   ratio_t = exp(delta_t).
How the trainer uses the outputs (slime 4.3 TIS bullet and its MIS example):
  loss_N = pg_loss_N * weights_N                      (weights are detached)
  pg loss mask = loss_mask_N * keep_N                 (rejection sampling; metrics keep the original mask)
Levels: "token" uses delta_t; "sequence" the per-sample sum of delta over masked tokens (the log of the
product of ratios); "geometric" the per-sample masked mean (log of the geometric-mean ratio). Sequence values
are broadcast to every token of the sample. Ratios are formed in log space, so a long sequence cannot
overflow exp().

All metrics are per-token tensors [N] for the caller to reduce over the loss mask.
Shapes: B = samples, N = sum(response_lengths) flat response tokens (samples concatenated in order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clawrl.algo.kl import kl_estimate
from clawrl.algo.segments import as_lengths, broadcast_to_tokens, segment_sum

TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "clip", "mask")


def token_tis_weights(
    log_probs_N: Tensor,
    old_log_probs_N: Tensor,
    rollout_log_probs_N: Tensor,
    *,
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`--use-tis`: w_t = clamp(exp(old_t - rollout_t), tis_clip_low, tis_clip) -> (weights_N, metrics).

    Metrics: tis (the weight), tis_clipfrac (1 where the clamp changed the ratio), tis_abs |ratio - 1|,
    ois exp(log_probs - old_log_probs) (the on-policy PPO ratio, for comparison).
    """
    if not 0.0 <= tis_clip_low < tis_clip:
        raise ValueError(f"--tis-clip-low {tis_clip_low} / --tis-clip {tis_clip}: need 0 <= low < high")
    ratio_N = torch.exp(old_log_probs_N.detach().float() - rollout_log_probs_N.float())
    weights_N = ratio_N.clamp(tis_clip_low, tis_clip)
    metrics = {
        "tis": weights_N,
        "tis_clipfrac": ((ratio_N < tis_clip_low) | (ratio_N > tis_clip)).float(),
        "tis_abs": (ratio_N - 1.0).abs(),
        "ois": torch.exp(log_probs_N.detach().float() - old_log_probs_N.detach().float()),
    }
    return weights_N, metrics


def mismatch_log_ratio(
    old_log_probs_N: Tensor,
    rollout_log_probs_N: Tensor,
    *,
    response_lengths: Sequence[int] | Tensor,
    loss_mask_N: Tensor,
    level: str,
) -> Tensor:
    """log ratio [N] at `level` (token / sequence sum / geometric mean over masked tokens, broadcast)."""
    if level not in TIS_LEVELS:
        raise ValueError(f"TIS/RS level {level!r} is not one of {', '.join(TIS_LEVELS)}")
    delta_N = old_log_probs_N.detach().float() - rollout_log_probs_N.float()
    if level == "token":
        return delta_N
    num_tokens = delta_N.numel()
    lengths_B = as_lengths(response_lengths, num_tokens, delta_N.device)
    mask_N = loss_mask_N.float()
    seq_B = segment_sum(torch.where(mask_N > 0, delta_N * mask_N, 0.0), lengths_B)
    if level == "geometric":
        seq_B = seq_B / segment_sum(mask_N, lengths_B).clamp(min=1.0)
    return broadcast_to_tokens(seq_B, lengths_B, num_tokens)


def _log_bounds(lower_bound: float | None, upper_bound: float | None) -> tuple[float, float]:
    """(log lower, log upper) with None meaning unbounded on that side."""
    if lower_bound is not None and upper_bound is not None and not lower_bound < upper_bound:
        raise ValueError(f"lower bound {lower_bound} must be < upper bound {upper_bound}")
    if (lower_bound is not None and lower_bound < 0) or (upper_bound is not None and upper_bound <= 0):
        raise ValueError(f"need lower bound >= 0 and upper bound > 0, got {lower_bound} / {upper_bound}")
    log_low = -math.inf if not lower_bound else math.log(lower_bound)
    log_high = math.inf if upper_bound is None else math.log(upper_bound)
    return log_low, log_high


def mis_weights(
    old_log_probs_N: Tensor,
    rollout_log_probs_N: Tensor,
    *,
    response_lengths: Sequence[int] | Tensor,
    loss_mask_N: Tensor,
    level: str = "token",
    mode: str = "truncate",
    upper_bound: float = 2.0,
    lower_bound: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """MIS importance weights -> (weights_N, {"tis": weights, "tis_clipfrac": 1 where changed}).

    mode "truncate": min(ratio, upper); "clip": clamp(ratio, lower, upper); "mask": ratio inside
    [lower, upper], else 0. lower_bound None means 1 / upper_bound (unused by truncate).
    """
    if mode not in TIS_MODES:
        raise ValueError(f"TIS mode {mode!r} is not one of {', '.join(TIS_MODES)}")
    if lower_bound is None:
        lower_bound = 1.0 / upper_bound if upper_bound > 0 else 0.0
    log_low, log_high = _log_bounds(lower_bound, upper_bound)
    log_ratio_N = mismatch_log_ratio(
        old_log_probs_N,
        rollout_log_probs_N,
        response_lengths=response_lengths,
        loss_mask_N=loss_mask_N,
        level=level,
    )
    above_N, below_N = log_ratio_N > log_high, log_ratio_N < log_low
    if mode == "truncate":
        weights_N, changed_N = log_ratio_N.clamp(max=log_high).exp(), above_N
    elif mode == "clip":
        weights_N, changed_N = log_ratio_N.clamp(log_low, log_high).exp(), above_N | below_N
    else:
        changed_N = above_N | below_N
        weights_N = torch.where(changed_N, 0.0, log_ratio_N.clamp(max=log_high).exp())
    return weights_N, {"tis": weights_N, "tis_clipfrac": changed_N.float()}


def rejection_sampling_mask(
    old_log_probs_N: Tensor,
    rollout_log_probs_N: Tensor,
    *,
    response_lengths: Sequence[int] | Tensor,
    loss_mask_N: Tensor,
    level: str = "token",
    lower_bound: float | None = None,
    upper_bound: float | None = None,
    veto_threshold: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Rejection sampling -> (keep_N float 0/1, {"rs_rejectfrac": 1 - keep, "rs_veto": 1 where vetoed}).

    A token (level token) or a whole sample (sequence / geometric) is rejected when its ratio lies outside
    [lower_bound, upper_bound] (None: no bound on that side). Veto: if any masked token of a sample has a token
    ratio below veto_threshold, the whole sample is rejected (catches one catastrophic token that a sequence
    average would hide).
    """
    log_low, log_high = _log_bounds(lower_bound, upper_bound)
    log_ratio_N = mismatch_log_ratio(
        old_log_probs_N,
        rollout_log_probs_N,
        response_lengths=response_lengths,
        loss_mask_N=loss_mask_N,
        level=level,
    )
    keep_N = (log_ratio_N >= log_low) & (log_ratio_N <= log_high)
    vetoed_N = torch.zeros_like(keep_N)
    if veto_threshold is not None:
        if not veto_threshold > 0:
            raise ValueError(f"rejection-sampling veto threshold must be > 0, got {veto_threshold}")
        num_tokens = log_ratio_N.numel()
        lengths_B = as_lengths(response_lengths, num_tokens, log_ratio_N.device)
        token_delta_N = old_log_probs_N.detach().float() - rollout_log_probs_N.float()
        bad_N = (token_delta_N < math.log(veto_threshold)) & (loss_mask_N > 0)
        vetoed_B = segment_sum(bad_N.float(), lengths_B) > 0
        vetoed_N = broadcast_to_tokens(vetoed_B, lengths_B, num_tokens)
        keep_N = keep_N & ~vetoed_N
    return keep_N.float(), {"rs_rejectfrac": (~keep_N).float(), "rs_veto": vetoed_N.float()}


def mismatch_metrics(old_log_probs_N: Tensor, rollout_log_probs_N: Tensor) -> dict[str, Tensor]:
    """Per-token train-vs-rollout mismatch, to be reduced with the loss mask.

    tis_abs |exp(old - rollout) - 1|; train_rollout_logprob_abs_diff |old - rollout|; mismatch_k3_kl the k3
    estimate of KL(rollout || train) for tokens sampled by the rollout: exp(old - rollout) - 1 - (old - rollout).
    """
    old_N = old_log_probs_N.detach().float()
    rollout_N = rollout_log_probs_N.float()
    return {
        "tis_abs": torch.expm1(old_N - rollout_N).abs(),
        "train_rollout_logprob_abs_diff": (old_N - rollout_N).abs(),
        "mismatch_k3_kl": kl_estimate(rollout_N, old_N, "k3"),
    }
