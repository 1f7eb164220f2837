"""An independent reference of one RL optimizer step's loss, written from the formulas with plain loops.

Used by test_flag_to_loss.py, which runs the real TrainActor and compares its loss, metrics and gradients
with `reference_step` computed here from the same weights. Nothing here imports clawrl: rewards, advantages,
the clipped surrogate, KL, entropy, TIS and the aggregation are per-sample, per-token Python loops over
torch scalars, and the log-probs come from a plain transformers forward of one unpadded sample at a time.

Per sample i (response tokens t, loss mask m_t, rewards r grouped by prompt, n per group, g = its group):
  rewards     grpo/gspo   (r - mean_g) / (std_g + 1e-6), unbiased std; mean only with std normalisation
                          disabled; raw with reward normalisation disabled
              dr_grpo, reinforce_plus_plus_baseline: r - mean_g (raw when normalisation is disabled)
              rloo        r - mean of the other n - 1 rewards of the group (always)
              reinforce_plus_plus: raw
  advantages  grpo/gspo/dr_grpo/rloo: A_t = r;  reinforce_plus_plus_baseline: A_t = r - kl_coef * kl_t
              reinforce_plus_plus: rho_t = -kl_coef * kl_t * m_t, plus r at the last t with m_t = 1,
              A_t = sum_{s >= t} gamma^(s - t) rho_s
              kl_t is the --kl-loss-type estimate between the old and the reference log-probs
  whitening   (--normalize-advantages) A <- (A - mu) / sqrt(var + 1e-8) over every masked token of the
              rollout, var with Bessel's correction
  policy loss ratio = exp(logp - old) (gspo: exp of the sample's masked mean of logp - old, for every t)
              pg_t = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps_high)); clipfrac_t = [clipped > unclipped]
              dual clip c: for A < 0, pg_t = min(pg_t, -c A)
  old         the log-probs before the rollout's first step (recomputed), or with --use-rollout-logprobs
              the engine's rollout log-probs (also in the KL penalty of the advantages)
  mismatch    (--use-tis or --get-mismatch-metrics) per sample, r_t = exp(train_t - rollout_t) with train the
              recomputed log-probs: vanilla w = clamp(r, lo, hi); icepop w = r inside [lo, hi] else 0;
              mis (levels token / sequence sum / geometric mean of train - rollout, bounded at +-20):
              truncate min(r, hi), clip clamp(r, lo, hi), mask r with out-of-bound tokens leaving the
              mask; w zero on masked tokens; batch normalisation w / mean w over the step's masked tokens
              (token) or samples' masked means (sequence); rejection sampling drops tokens / samples with
              r outside the RS bounds, veto drops a sample with any masked token r < threshold.
              pg_t *= w; every loss term is then aggregated over the kept tokens (per-token denominator:
              the original token count), the mismatch metrics and ois = exp(-ppo_kl) over the original mask
  KL          d = logp - ref: k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d, low_var_kl = clamp(k3, -10, 10)
  loss        pg - entropy_coef * entropy + kl_loss_coef * kl (--use-kl-loss); sft_loss: -logp
  aggregation over the optimizer step's samples S (every term and metric alike):
              per sample (default)  sum_i [sum_t x m / max(sum_t m, 1)] / |S|
              per token             sum_i sum_t x m / sum_i sum_t m          (--calculate-per-token-loss)
              dr_grpo               sum_i sum_t x m / (|S| * max_response_len)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

_OUTCOME_ESTIMATORS = ("grpo", "gspo", "dr_grpo", "rloo")


@dataclass(kw_only=True)
class LossFlags:
    """The algorithm and loss flags the reference follows; the defaults are slime's."""

    advantage_estimator: str = "grpo"
    """grpo, gspo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline."""
    rewards_normalization: bool = True
    """False is --disable-rewards-normalization."""
    grpo_std_normalization: bool = True
    """False is --disable-grpo-std-normalization."""
    normalize_advantages: bool = False
    """Whiten advantages over the rollout's masked tokens."""
    gamma: float = 1.0
    """Discount of reinforce_plus_plus returns."""
    kl_coef: float = 0.0
    """KL penalty in the per-token reward (reinforce_plus_plus[_baseline])."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL to the loss."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss."""
    kl_loss_type: str = "k1"
    """KL estimator of the KL loss and of the KL reward penalty."""
    eps_clip: float = 0.2
    """Lower clip of the ratio: 1 - eps_clip."""
    eps_clip_high: float | None = None
    """Upper clip of the ratio: 1 + eps_clip_high (None: eps_clip)."""
    eps_clip_c: float | None = None
    """Dual-clip bound (None: off)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    use_tis: bool = False
    """Weight the policy loss by the clamped train/rollout probability ratio."""
    tis_clip: float = 2.0
    """Upper clamp of the TIS weight."""
    tis_clip_low: float = 0.0
    """Lower clamp of the TIS weight."""
    use_rollout_logprobs: bool = False
    """Old log-probs = the rollout's."""
    get_mismatch_metrics: bool = False
    """Run the correction function for its metrics even without --use-tis."""
    custom_tis_function_path: str | None = None
    """A path ending in vanilla_tis_function, icepop_function or mis_function (None: vanilla)."""
    tis_level: str = "token"
    """mis: token, sequence or geometric."""
    tis_mode: str = "truncate"
    """mis: truncate, clip or mask."""
    tis_upper_bound: float = 2.0
    """mis: upper IS bound."""
    tis_lower_bound: float | None = None
    """mis: lower IS bound (None: 1 / upper)."""
    tis_batch_normalize: bool = False
    """mis: weights / their mean over the call (here: the step, one micro-batch)."""
    use_rs: bool = False
    """mis: rejection sampling."""
    rs_level: str = "token"
    """mis: level of the rejection ratio."""
    rs_lower_bound: float | None = None
    """mis: lower rejection bound (None: the IS lower bound)."""
    rs_upper_bound: float | None = None
    """mis: upper rejection bound (None: the IS upper bound)."""
    rs_veto_threshold: float | None = None
    """mis: reject a sample with any masked token ratio below this."""
    calculate_per_token_loss: bool = False
    """Aggregate per token instead of per sample."""
    loss_type: str = "policy_loss"
    """policy_loss or sft_loss (custom losses are computed by the caller)."""

    def argv(self) -> list[str]:
        """The command-line flags that set every field differing from its default (slime's spelling)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name in ("rewards_normalization", "grpo_std_normalization"):
                out.append("--disable-" + f.name.replace("_", "-"))
            elif isinstance(value, bool):
                out.append("--" + f.name.replace("_", "-"))
            else:
                out += ["--" + f.name.replace("_", "-"), str(value)]
        return out


# ------------------------------------------------------------------------------------------ log-probs
def response_log_probs(model, tokens: list[int], response_length: int, temperature: float):
    """(log p of each response token, entropy of each response position) of one sample, unpacked, from
    the full log_softmax of logits / temperature; differentiable in the model's parameters."""
    logits = model(torch.tensor([tokens])).logits[0]
    first = len(tokens) - response_length - 1  # the position that predicts the first response token
    log_probs_all = torch.log_softmax(logits[first : len(tokens) - 1] / temperature, dim=-1)
    log_probs, entropy = [], []
    for t in range(response_length):
        row = log_probs_all[t]
        log_probs.append(row[tokens[first + 1 + t]])
        entropy.append(-(row.exp() * row).sum())
    return torch.stack(log_probs), torch.stack(entropy)


# ------------------------------------------------------------------------------------ rewards, advantages
def process_rewards(flags: LossFlags, raw: list[float], n: int) -> list[float]:
    """Per-sample rewards after the estimator's group processing (groups: consecutive blocks of n)."""
    est, out = flags.advantage_estimator, []
    for start in range(0, len(raw), n):
        group = raw[start : start + n]
        mean = sum(group) / n
        for r in group:
            if est == "rloo":
                out.append(r - (sum(group) - r) / (n - 1))
            elif est == "reinforce_plus_plus" or not flags.rewards_normalization:
                out.append(r)
            elif est in ("grpo", "gspo") and flags.grpo_std_normalization:
                std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
                out.append((r - mean) / (std + 1e-6))
            else:
                out.append(r - mean)
    return out


def kl_value(kind: str, log_prob, ref_log_prob):
    """One token's KL estimate (torch scalars or floats)."""
    d = log_prob - ref_log_prob
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2
    k3 = (torch.exp(-d) if torch.is_tensor(d) else math.exp(-d)) - 1 + d
    if kind == "k3":
        return k3
    assert kind == "low_var_kl", kind
    return k3.clamp(-10.0, 10.0) if torch.is_tensor(k3) else min(max(k3, -10.0), 10.0)


def advantages(flags: LossFlags, rewards: list[float], masks: list[list[int]], kl: list[list[float]]):
    """Per-sample lists of per-token advantages (before whitening)."""
    est, out = flags.advantage_estimator, []
    for r, mask, kl_i in zip(rewards, masks, kl, strict=True):
        if est in _OUTCOME_ESTIMATORS:
            out.append([r] * len(mask))
        elif est == "reinforce_plus_plus_baseline":
            out.append([r - flags.kl_coef * k for k in kl_i])
        elif est == "reinforce_plus_plus":
            rho = [-flags.kl_coef * k * m for k, m in zip(kl_i, mask, strict=True)]
            last = max((t for t, m in enumerate(mask) if m), default=None)
            if last is not None:
                rho[last] += r
            returns, running = [0.0] * len(rho), 0.0
            for t in reversed(range(len(rho))):
                running = rho[t] + flags.gamma * running
                returns[t] = running
            out.append(returns)
        else:
            raise ValueError(f"the reference has no estimator {est!r}")
    return out


def whiten(values: list[list[float]], masks: list[list[int]]) -> list[list[float]]:
    """(A - mean) / sqrt(var + 1e-8) with the mean and Bessel-corrected variance of the masked entries."""
    kept = [a for vs, ms in zip(values, masks, strict=True) for a, m in zip(vs, ms, strict=True) if m]
    mean = sum(kept) / len(kept)
    var = sum((a - mean) ** 2 for a in kept) / (len(kept) - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in vs] for vs in values]


# ------------------------------------------------------------------------------------------ mismatch
@dataclass(kw_only=True)
class Correction:
    """One sample's mismatch correction: per-token weight and kept-mask, and per-token metrics."""

    weights: list[float]
    keep: list[int]
    metrics: dict[str, list[float]]


def _clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def _level_log_ratio(level: str, diff: list[float], mask: list[int]) -> list[float]:
    """Per-token log ratio at `level` (the sample's masked sum / mean broadcast for sequence / geometric)."""
    if level == "token":
        return list(diff)
    total = sum(d * m for d, m in zip(diff, mask, strict=True))
    value = total if level == "sequence" else total / max(sum(mask), 1)
    return [value] * len(diff)


def _masked_mean(values: list[float], mask: list[int]) -> float:
    return sum(v * m for v, m in zip(values, mask, strict=True)) / max(sum(mask), 1)


def _clip_correction(flags: LossFlags, train, rollout, mask, icepop: bool) -> Correction:
    """vanilla TIS (clamp) or IcePop (zero outside) with --tis-clip-low / --tis-clip."""
    lo, hi = flags.tis_clip_low, flags.tis_clip
    ratios = [math.exp(t - r) for t, r in zip(train, rollout, strict=True)]
    if icepop:
        weights = [x if lo <= x <= hi else 0.0 for x in ratios]
    else:
        weights = [_clamp(x, lo, hi) for x in ratios]
    changed = [float(w != x) for w, x in zip(weights, ratios, strict=True)]
    metrics = {"tis": ratios, "tis_clipfrac": changed, "tis_abs": [abs(x - 1) for x in ratios]}
    return Correction(weights=weights, keep=list(mask), metrics=metrics)


def _perplexities(train, rollout, mask) -> dict[str, list[float]]:
    n, mean_train, mean_rollout = len(mask), _masked_mean(train, mask), _masked_mean(rollout, mask)
    diffs = [t - r for t, r in zip(train, rollout, strict=True)]
    gap = mean_rollout - mean_train
    return {
        "mis_training_log_ppl": [-mean_train] * n, "mis_training_ppl": [math.exp(-mean_train)] * n,
        "mis_rollout_log_ppl": [-mean_rollout] * n, "mis_rollout_ppl": [math.exp(-mean_rollout)] * n,
        "mis_kl": [-d for d in diffs], "mis_k3_kl": [math.exp(d) - d - 1 for d in diffs],
        "mis_log_ppl_diff": [gap] * n, "mis_log_ppl_abs_diff": [abs(gap)] * n, "mis_ppl_ratio": [math.exp(gap)] * n,
    }  # fmt: skip


def _mis_correction(flags: LossFlags, train, rollout, mask) -> Correction:
    """The MIS function on one sample (batch normalisation is applied over the step by the caller)."""
    diffs = [t - r for t, r in zip(train, rollout, strict=True)]
    metrics, keep, weights = _perplexities(train, rollout, mask), list(mask), [1.0] * len(mask)
    lower = 1 / flags.tis_upper_bound if flags.tis_lower_bound is None else flags.tis_lower_bound
    upper = flags.tis_upper_bound
    if flags.use_tis:
        ratios = [math.exp(_clamp(x, -20, 20)) for x in _level_log_ratio(flags.tis_level, diffs, mask)]
        low, high = [float(x < lower) for x in ratios], [float(x > upper) for x in ratios]
        if flags.tis_mode == "truncate":
            weights, bound_metrics = [min(x, upper) for x in ratios], {"truncate_fraction": high}
        elif flags.tis_mode == "clip":
            weights = [_clamp(x, lower, upper) for x in ratios]
            bound_metrics = {"clip_fraction_low": low, "clip_fraction_high": high}
        else:
            weights, bound_metrics = list(ratios), {"mask_fraction_low": low, "mask_fraction_high": high}
            keep = [int(m and lower <= x <= upper) for m, x in zip(mask, ratios, strict=True)]
        weights = [w * m for w, m in zip(weights, mask, strict=True)]
        metrics.update({f"mis_{k}": v for k, v in bound_metrics.items()})
        metrics.update(mis_tis_weight_before_bound=ratios, mis_tis_weight_after_bound=list(weights))
    if flags.use_rs:
        rs_low = lower if flags.rs_lower_bound is None else flags.rs_lower_bound
        rs_high = upper if flags.rs_upper_bound is None else flags.rs_upper_bound
        ratios = [math.exp(_clamp(x, -20, 20)) for x in _level_log_ratio(flags.rs_level, diffs, mask)]
        keep = [int(k and rs_low <= x <= rs_high) for k, x in zip(keep, ratios, strict=True)]
        metrics["mis_rs_mask_fraction_low"] = [float(x < rs_low) for x in ratios]
        metrics["mis_rs_mask_fraction_high"] = [float(x > rs_high) for x in ratios]
        if flags.rs_veto_threshold is not None:
            bad = [
                float(m and math.exp(d) < flags.rs_veto_threshold) for d, m in zip(diffs, mask, strict=True)
            ]
            if any(bad):
                keep = [0] * len(keep)
            metrics["mis_catastrophic_token_fraction"] = bad
            metrics["mis_catastrophic_seq_fraction"] = [float(any(bad))] * len(bad)
    return Correction(weights=weights, keep=keep, metrics=metrics)


def _batch_normalize(flags: LossFlags, corrections: list[Correction], masks: list[list[int]]) -> None:
    """--tis-batch-normalize over the given samples (one call of the function), in place."""
    if flags.tis_level == "token":
        total = sum(
            w * m
            for c, ms in zip(corrections, masks, strict=True)
            for w, m in zip(c.weights, ms, strict=True)
        )
        mean = total / max(sum(sum(ms) for ms in masks), 1)
    else:
        mean = sum(_masked_mean(c.weights, ms) for c, ms in zip(corrections, masks, strict=True)) / len(masks)
    for c in corrections:
        if mean > 1e-8:
            c.weights = [w / mean for w in c.weights]
        c.metrics["mis_batch_norm_factor"] = [mean if mean > 1e-8 else 1.0] * len(c.weights)


def mismatch_corrections(flags: LossFlags, data: RolloutData, ids: list[int]) -> dict[int, Correction]:
    """The correction of each sample of one call (the step's samples), or {} when it is off."""
    if not (flags.use_tis or flags.get_mismatch_metrics):
        return {}
    kind = (flags.custom_tis_function_path or "vanilla_tis_function").rpartition(":")[2].rpartition(".")[2]
    out = {}
    for i in ids:
        args = (flags, data.train[i], data.rollout[i], data.masks[i])
        out[i] = (
            _mis_correction(*args)
            if kind == "mis_function"
            else _clip_correction(*args, kind == "icepop_function")
        )
    if kind == "mis_function" and flags.use_tis:
        for c in out.values():
            c.metrics["mis_ratio_mean_after_tis"] = list(c.weights)
        if flags.tis_batch_normalize:
            _batch_normalize(flags, [out[i] for i in ids], [data.masks[i] for i in ids])
            for c in out.values():
                c.metrics["mis_ratio_mean_after_tis"] = list(c.weights)
    return out


# ------------------------------------------------------------------------------------------ per-token loss
def policy_terms(flags: LossFlags, log_probs, entropy, *, old, adv, mask, ref=None, rollout=None,
                 correction: Correction | None = None):  # fmt: skip
    """Per-token terms of one sample: ({name: [torch scalar per token]} aggregated over the kept mask,
    {name: [...]} of mismatch metrics aggregated over the original mask)."""
    eps_high = flags.eps_clip if flags.eps_clip_high is None else flags.eps_clip_high
    num_masked = max(sum(mask), 1)
    seq_kl = sum((old[t] - log_probs[t]) * mask[t] for t in range(len(mask))) / num_masked
    terms: dict[str, list] = {}
    mismatch: dict[str, list] = {}
    for t in range(len(mask)):
        row: dict[str, torch.Tensor] = {}
        ppo_kl = seq_kl if flags.advantage_estimator == "gspo" else old[t] - log_probs[t]
        ratio = torch.exp(-ppo_kl)
        unclipped = -adv[t] * ratio
        clipped = -adv[t] * ratio.clamp(1 - flags.eps_clip, 1 + eps_high)
        pg = torch.maximum(unclipped, clipped)
        if flags.eps_clip_c is not None and adv[t] < 0:
            pg = torch.minimum(pg, torch.tensor(-flags.eps_clip_c * adv[t], dtype=pg.dtype))
        row["pg_clipfrac"] = (clipped > unclipped).double()
        row["ppo_kl"] = ppo_kl.detach()
        if correction is not None:
            pg = pg * correction.weights[t]
            mismatch.setdefault("ois", []).append(torch.exp(-ppo_kl).detach())
            for name, values in correction.metrics.items():
                mismatch.setdefault(name, []).append(torch.tensor(values[t], dtype=torch.float64))
        row["pg_loss"] = pg
        row["entropy_loss"] = entropy[t]
        loss = pg - flags.entropy_coef * entropy[t]
        if flags.use_kl_loss:
            row["kl_loss"] = kl_value(flags.kl_loss_type, log_probs[t], ref[t])
            loss = loss + flags.kl_loss_coef * row["kl_loss"]
        if rollout is not None:
            row["train_rollout_logprob_abs_diff"] = torch.tensor(
                abs(old[t] - rollout[t]), dtype=torch.float64
            )
        row["loss"] = loss
        for name, value in row.items():
            terms.setdefault(name, []).append(value)
    return terms, mismatch


# ------------------------------------------------------------------------------------------ aggregation
def _masked_sum(values: list, mask: list[int]):
    return sum(v * m for v, m in zip(values, mask, strict=True))


def aggregate(flags: LossFlags, values: list[list], masks: list[list[int]], max_response_len: int,
              num_tokens: int | None = None):  # fmt: skip
    """The step-level aggregate of per-token values of the step's samples (see the module docstring);
    `num_tokens` is the per-token denominator (default: the masks' total)."""
    sums = [_masked_sum(vs, ms) for vs, ms in zip(values, masks, strict=True)]
    if flags.calculate_per_token_loss:
        return sum(sums) / max(sum(sum(m) for m in masks) if num_tokens is None else num_tokens, 1)
    if flags.advantage_estimator == "dr_grpo":
        return sum(sums) / (len(masks) * max_response_len)
    return sum(total / max(sum(ms), 1) for total, ms in zip(sums, masks, strict=True)) / len(masks)


def per_sample_mean(values: list[list[float]], masks: list[list[int]]) -> float:
    """Mean over samples of each sample's masked mean (a sample with no masked token counts as 0)."""
    means = [_masked_sum(vs, ms) / max(sum(ms), 1) for vs, ms in zip(values, masks, strict=True)]
    return sum(means) / len(means)


# ------------------------------------------------------------------------------------------ one step
@dataclass(kw_only=True)
class RolloutData:
    """Everything of a rollout the loss needs besides the current weights (per-sample lists, rollout order)."""

    tokens: list[list[int]]
    """Prompt + response ids."""
    response_lengths: list[int]
    masks: list[list[int]]
    """Loss masks (a removed sample's is all 0)."""
    old: list[list[float]]
    """Old log-probs of the loss: the rollout's with --use-rollout-logprobs, else `train`."""
    train: list[list[float]]
    """Log-probs of the weights before the rollout's first optimizer step."""
    ref: list[list[float]]
    """Reference-model log-probs."""
    rollout: list[list[float]] | None
    """The engine's log-probs (None if absent)."""
    advantages: list[list[float]]
    """Per-token advantages (whitened if asked)."""


def rollout_data(flags, *, tokens, response_lengths, masks, raw_rewards, n, old, ref, rollout) -> RolloutData:
    """Rewards -> advantages (-> whitening) for the whole rollout, from the old and reference log-probs."""
    rewards = process_rewards(flags, raw_rewards, n)
    train, old = old, (rollout if flags.use_rollout_logprobs else old)
    kl = [
        [float(kl_value(flags.kl_loss_type, o, r)) for o, r in zip(old_i, ref_i, strict=True)]
        for old_i, ref_i in zip(old, ref, strict=True)
    ]
    adv = advantages(flags, rewards, masks, kl)
    if flags.normalize_advantages:
        adv = whiten(adv, masks)
    return RolloutData(tokens=tokens, response_lengths=response_lengths, masks=masks, old=old, train=train,
                       ref=ref, rollout=rollout, advantages=adv)  # fmt: skip


def reference_step(flags: LossFlags, model, data: RolloutData, ids: list[int], *, temperature: float,
                   max_response_len: int, custom_terms=None):  # fmt: skip
    """(loss, {metric: float}) of one optimizer step over samples `ids` with the model's current weights;
    the loss is differentiable in the model's parameters. `custom_terms(log_probs, old, adv)` -> {name:
    per-token values}, with the loss under "loss", replaces the policy loss (--loss-type custom_loss)."""
    masks = [data.masks[i] for i in ids]
    corrections = (
        {} if custom_terms or flags.loss_type != "policy_loss" else mismatch_corrections(flags, data, ids)
    )
    kept = [corrections[i].keep if i in corrections else data.masks[i] for i in ids]
    columns: dict[str, list[list]] = {}
    mismatch_columns: dict[str, list[list]] = {}
    for i in ids:
        log_probs, entropy = response_log_probs(model, data.tokens[i], data.response_lengths[i], temperature)
        mismatch: dict[str, list] = {}
        if flags.loss_type == "sft_loss":
            terms = {"loss": [-lp for lp in log_probs]}
        elif custom_terms is not None:
            terms = custom_terms(log_probs, data.old[i], data.advantages[i])
        else:
            terms, mismatch = policy_terms(
                flags, log_probs, entropy, old=data.old[i], adv=data.advantages[i], mask=data.masks[i],
                ref=data.ref[i], rollout=None if data.rollout is None else data.rollout[i],
                correction=corrections.get(i),
            )  # fmt: skip
        for name, per_token in terms.items():
            columns.setdefault(name, []).append(per_token)
        for name, per_token in mismatch.items():
            mismatch_columns.setdefault(name, []).append(per_token)
    num_tokens = sum(sum(m) for m in masks)
    reduced = {
        name: aggregate(flags, values, kept, max_response_len, num_tokens) for name, values in columns.items()
    }
    reduced.update(
        {name: aggregate(flags, values, masks, max_response_len) for name, values in mismatch_columns.items()}
    )
    metrics = {name: float(torch.as_tensor(value).detach()) for name, value in reduced.items()}
    return reduced["loss"], metrics
