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

Two layers:
- pure tensor functions over flat [N] tensors (mismatch_log_ratio, rejection_sampling_mask);
- `--custom-tis-function-path` plugins with slime's keyword signature, which the trainer calls once per
  micro-batch (vanilla_tis_function is the default of --use-tis; icepop_function; mis_function):
      fn(args=, pg_loss=[N], train_log_probs=[R_b] per sample, rollout_log_probs=[R_b] per sample,
         loss_masks=[R_b] per sample, total_lengths=[B] ints, response_lengths=[B] ints)
        -> (pg_loss [N] with the weights applied, modified loss masks [R_b] per sample, {name: [N]})
  The trainer reduces the pg loss (and the other loss terms) with the modified masks and the returned
  metrics with the original ones, logged as train/<name>.

All metrics are per-token tensors [N] for the caller to reduce over the loss mask.
Shapes: B = samples, N = sum(response_lengths) flat response tokens (samples concatenated in order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clawrl.algo.segments import as_lengths, broadcast_to_tokens, segment_sum

TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "clip", "mask")


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


# ------------------------------------------------------------------------ --custom-tis-function-path plugins
# exp() of a sequence-level log ratio overflows float32 past ~88; slime bounds the log ratio at +-20 first.
_LOG_RATIO_BOUND = 20.0


def vanilla_tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_):
    """--use-tis default: weight w_t = clamp(exp(train_t - rollout_t), --tis-clip-low, --tis-clip).

    Metrics: tis (the ratio before the clamp), tis_clipfrac (1 where the clamp changed it), tis_abs
    |ratio - 1|. The loss masks come back unchanged."""
    ratio_N = torch.exp(torch.cat(train_log_probs).detach().float() - torch.cat(rollout_log_probs).float())
    weights_N = ratio_N.clamp(args.tis_clip_low, args.tis_clip)
    metrics = {"tis": ratio_N, "tis_clipfrac": (weights_N != ratio_N).float(), "tis_abs": (ratio_N - 1).abs()}
    return pg_loss * weights_N.to(pg_loss.dtype), loss_masks, metrics


def icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_):
    """IcePop: weight = the ratio where it lies in [--tis-clip-low, --tis-clip], else 0 (the token's policy
    gradient is dropped, its mask kept). Metrics as vanilla_tis_function."""
    ratio_N = torch.exp(torch.cat(train_log_probs).detach().float() - torch.cat(rollout_log_probs).float())
    inside_N = (ratio_N >= args.tis_clip_low) & (ratio_N <= args.tis_clip)
    weights_N = torch.where(inside_N, ratio_N, torch.zeros_like(ratio_N))
    metrics = {"tis": ratio_N, "tis_clipfrac": (~inside_N).float(), "tis_abs": (ratio_N - 1).abs()}
    return pg_loss * weights_N.to(pg_loss.dtype), loss_masks, metrics


def mis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, response_lengths, **_):
    """Masked importance sampling and rejection sampling, configured by the MIS flags (slime's MIS example).

    Always: perplexity / KL mismatch metrics. With --use-tis: weights at --tis-level, bounded by --tis-mode
    (truncate: min(w, upper); clip: clamp(w, lower, upper); mask: w kept, tokens outside [lower, upper]
    leave the loss mask), zeroed on masked tokens, optionally rescaled to mean 1 over this call's
    (micro-batch's) masked tokens or samples (--tis-batch-normalize). With --use-rs: tokens / samples whose
    --rs-level ratio is outside [--rs-lower-bound, --rs-upper-bound] leave the mask, and with
    --rs-veto-threshold a sample with any token ratio below it leaves entirely. Metrics are named mis_*."""
    lengths = list(response_lengths)
    train_N = torch.cat(train_log_probs).detach().float()
    rollout_N = torch.cat(rollout_log_probs).float()
    mask_N = torch.cat(loss_masks).float()
    metrics = _perplexity_metrics(train_N, rollout_N, mask_N, lengths)
    keep_N = mask_N.clone()
    if args.use_tis:
        weights_N, keep_N = _mis_is_weights(args, train_N, rollout_N, mask_N, lengths, metrics)
        pg_loss = pg_loss * weights_N.to(pg_loss.dtype)
    if args.use_rs:
        keep_N = keep_N * _mis_rejection(args, train_N, rollout_N, mask_N, lengths, metrics)
    return pg_loss, list(keep_N.split(lengths)), {f"mis_{k}": v for k, v in metrics.items()}


def _tis_bounds(args) -> tuple[float, float]:
    upper = args.tis_upper_bound
    return (1.0 / upper if args.tis_lower_bound is None else args.tis_lower_bound), upper


def _mis_is_weights(args, train_N, rollout_N, mask_N, lengths, metrics) -> tuple[Tensor, Tensor]:
    """(weights_N, keep_N) of the IS part of mis_function; fills the IS metrics."""
    log_ratio_N = mismatch_log_ratio(train_N, rollout_N, response_lengths=lengths, loss_mask_N=mask_N,
                                     level=args.tis_level)  # fmt: skip
    before_N = log_ratio_N.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    lower, upper = _tis_bounds(args)
    low_N, high_N = (before_N < lower).float(), (before_N > upper).float()
    metrics["tis_weight_before_bound"] = before_N
    keep_N = mask_N.clone()
    if args.tis_mode == "truncate":
        weights_N = before_N.clamp(max=upper)
        metrics["truncate_fraction"] = high_N
    elif args.tis_mode == "clip":
        weights_N = before_N.clamp(lower, upper)
        metrics.update(clip_fraction_low=low_N, clip_fraction_high=high_N)
    elif args.tis_mode == "mask":
        weights_N, keep_N = before_N, mask_N * (1 - low_N) * (1 - high_N)
        metrics.update(mask_fraction_low=low_N, mask_fraction_high=high_N)
    else:
        raise ValueError(f"--tis-mode {args.tis_mode!r} is not one of {', '.join(TIS_MODES)}")
    weights_N = weights_N * mask_N
    metrics["tis_weight_after_bound"] = weights_N
    if args.tis_batch_normalize:
        weights_N = _batch_normalize(args.tis_level, weights_N, mask_N, lengths, metrics)
    metrics["ratio_mean_after_tis"] = weights_N
    return weights_N, keep_N


def _batch_normalize(level, weights_N, mask_N, lengths, metrics) -> Tensor:
    """Weights / their mean over this call's masked tokens (token level) or samples (sequence level)."""
    lengths_B = as_lengths(lengths, weights_N.numel(), weights_N.device)
    if level == "token":
        mean = (weights_N * mask_N).sum() / mask_N.sum().clamp(min=1.0)
    elif level == "sequence":
        mean = (
            segment_sum(weights_N * mask_N, lengths_B) / segment_sum(mask_N, lengths_B).clamp(min=1.0)
        ).mean()
    else:
        raise ValueError(f"--tis-batch-normalize works at --tis-level token or sequence, got {level!r}")
    if not mean > 1e-8:  # nothing to normalise (an all-masked micro-batch)
        metrics["batch_norm_factor"] = torch.ones_like(weights_N)
        return weights_N
    metrics["batch_norm_factor"] = mean.expand_as(weights_N)
    return weights_N / mean


def _mis_rejection(args, train_N, rollout_N, mask_N, lengths, metrics) -> Tensor:
    """keep_N (float 0/1) of the rejection-sampling part of mis_function; fills the RS metrics."""
    tis_lower, tis_upper = _tis_bounds(args)
    lower = tis_lower if args.rs_lower_bound is None else args.rs_lower_bound
    upper = tis_upper if args.rs_upper_bound is None else args.rs_upper_bound
    keep_N, rs = rejection_sampling_mask(
        train_N, rollout_N, response_lengths=lengths, loss_mask_N=mask_N, level=args.rs_level,
        lower_bound=lower, upper_bound=upper, veto_threshold=args.rs_veto_threshold,
    )  # fmt: skip
    log_ratio_N = mismatch_log_ratio(train_N, rollout_N, response_lengths=lengths, loss_mask_N=mask_N,
                                     level=args.rs_level)  # fmt: skip
    log_low = math.log(lower) if lower > 0 else -math.inf
    metrics["rs_mask_fraction_low"] = (log_ratio_N < log_low).float()
    metrics["rs_mask_fraction_high"] = (log_ratio_N > math.log(upper)).float()
    if args.rs_veto_threshold is not None:
        bad_N = (train_N - rollout_N < math.log(args.rs_veto_threshold)) & (mask_N > 0)
        metrics["catastrophic_token_fraction"] = bad_N.float()
        metrics["catastrophic_seq_fraction"] = rs["rs_veto"]
    return keep_N


def _perplexity_metrics(train_N, rollout_N, mask_N, lengths) -> dict[str, Tensor]:
    """Per-sample perplexities and per-token KL estimates between the train and rollout log-probs."""
    lengths_B = as_lengths(lengths, train_N.numel(), train_N.device)
    count_B = segment_sum(mask_N, lengths_B).clamp(min=1.0)

    def sample_mean(x_N: Tensor) -> Tensor:
        mean_B = segment_sum(torch.where(mask_N > 0, x_N * mask_N, 0.0), lengths_B) / count_B
        return broadcast_to_tokens(mean_B, lengths_B, x_N.numel())

    train_mean_N, rollout_mean_N = sample_mean(train_N), sample_mean(rollout_N)
    log_ratio_N = train_N - rollout_N
    log_ppl_diff_N = rollout_mean_N - train_mean_N
    return {
        "training_log_ppl": -train_mean_N,
        "training_ppl": torch.exp(-train_mean_N),
        "rollout_log_ppl": -rollout_mean_N,
        "rollout_ppl": torch.exp(-rollout_mean_N),
        "kl": -log_ratio_N,
        "k3_kl": torch.expm1(log_ratio_N) - log_ratio_N,
        "log_ppl_diff": log_ppl_diff_N,
        "log_ppl_abs_diff": log_ppl_diff_N.abs(),
        "ppl_ratio": torch.exp(log_ppl_diff_N),
    }
