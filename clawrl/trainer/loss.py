"""The loss of one micro-batch, from its log-probs and entropy, with the step's global normalisation.

Every term and every metric is reduced with `clawrl.algo.aggregate_loss` against GLOBAL counts of the
optimizer step, so the sum over all micro-batches of all ranks is the step's value (the caller all-reduces
the metric sums). Aggregation mode: `--calculate-per-token-loss` -> per_token; dr_grpo -> seq_sum_const
(Dr. GRPO's constant denominator); otherwise per_sample (slime's default).

    loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss      (--loss-type policy_loss)
    loss = -mean log p(response)                                                (--loss-type sft_loss)
    loss, metrics = fn(args, batch, logits, sum_of_sample_mean)                 (--loss-type custom_loss)

Mismatch correction (--use-tis, --get-mismatch-metrics): the per-token pg loss goes through the TIS
function (clawrl.algo.tis: vanilla TIS by default, or --custom-tis-function-path), which returns it
weighted, with possibly reduced loss masks (rejection sampling) and per-token metrics. As in slime, the
loss terms and their companion metrics (pg_loss, pg_clipfrac, ppo_kl, entropy_loss, kl_loss,
train_rollout_logprob_abs_diff) are then reduced over the reduced masks, the TIS function's metrics and
ois = exp(-ppo_kl) over the original ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from clawrl.algo import (
    aggregate_loss,
    gspo_policy_loss,
    kl_estimate,
    ppo_policy_loss,
    sft_loss,
)
from clawrl.config.algo import AlgoConfig
from clawrl.trainer.micro_batch import MicroBatch


@dataclass(kw_only=True)
class StepCounts:
    """Global denominators of one optimizer step (all micro-batches, all ranks)."""

    num_tokens: float
    """Sum of the loss mask over the step."""
    num_samples: int
    """Samples in the step."""
    max_response_len: int
    """--rollout-max-response-len (Dr. GRPO's constant)."""


def aggregation_mode(algo: AlgoConfig) -> str:
    if algo.calculate_per_token_loss:
        return "per_token"
    if algo.advantage_estimator == "dr_grpo":
        return "seq_sum_const"
    return "per_sample"


class LossFunction:
    """Computes (loss, metric contributions) of a micro-batch; built once per trainer.

    `tis_fn` is the mismatch correction (--custom-tis-function-path, or vanilla TIS for --use-tis), called
    when --use-tis or --get-mismatch-metrics is set; `custom_fn` the --custom-loss-function-path loss."""

    def __init__(self, algo: AlgoConfig, loss_type: str, custom_fn: Callable | None = None, args: Any = None,
                 tis_fn: Callable | None = None):  # fmt: skip
        self.algo, self.loss_type, self.custom_fn, self.args = algo, loss_type, custom_fn, args
        self.tis_fn = tis_fn
        self.mode = aggregation_mode(algo)

    @property
    def wants_logits(self) -> bool:
        """True for --loss-type custom_loss: call `custom` with the response logits instead of `__call__`."""
        return self.loss_type == "custom_loss"

    def reducer(self, mb: MicroBatch, counts: StepCounts, mask_M: torch.Tensor | None = None):
        """x_M -> this micro-batch's share of the step-level aggregate of x, over `mask_M` (default: the
        loss mask). The global token count stays that of the loss masks, as slime's normaliser does."""
        mask_M = mb.loss_mask_M if mask_M is None else mask_M

        def reduce(x_M: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(
                x_M,
                mask_M,
                mb.response_lengths,
                self.mode,
                num_global_tokens=max(counts.num_tokens, 1.0),
                num_global_samples=counts.num_samples,
                max_response_len=counts.max_response_len,
            )

        return reduce

    def __call__(self, mb, log_probs_M, entropy_M, counts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        reduce = self.reducer(mb, counts)
        if self.loss_type == "sft_loss":
            loss = reduce(sft_loss(log_probs_M))
            return loss, {"loss": loss.detach()}
        assert self.loss_type == "policy_loss", self.loss_type
        return self._policy_loss(mb, log_probs_M, entropy_M, counts)

    def custom(self, mb, logits_MV, counts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """--loss-type custom_loss: fn(args, batch, logits, sum_of_sample_mean) -> (loss, {name: value}).

        logits_MV [M, V] fp32 are the response-position logits already divided by --rollout-temperature
        (row m predicts response token m: log_softmax(logits_MV)[m, tokens[m]] is the trainer's log-prob)."""
        out = self.custom_fn(self.args, _batch_view(mb), logits_MV, self.reducer(mb, counts))
        if not (isinstance(out, tuple) and len(out) == 2 and torch.is_tensor(out[0]) and out[0].dim() == 0):
            path = getattr(self.args, "custom_loss_function_path", None)
            raise TypeError(
                f"--custom-loss-function-path {path!r} must return (scalar loss tensor, metrics dict)"
            )
        loss, metrics = out
        if mb.is_dummy:  # its mask is all 0; keep the graph reaching every parameter (FSDP's collectives)
            loss = loss + 0.0 * logits_MV.sum()
        return loss, {"loss": loss.detach(), **{k: torch.as_tensor(v).detach() for k, v in metrics.items()}}

    def _policy_loss(self, mb, log_probs_M, entropy_M, counts):
        algo, tok = self.algo, _per_token(mb, log_probs_M)
        old, adv = tok("old_log_probs"), tok("advantages")
        if algo.advantage_estimator == "gspo":
            pg_M, pg_metrics = gspo_policy_loss(
                log_probs_M, old, adv, response_lengths=mb.response_lengths, loss_mask_N=mb.loss_mask_M,
                eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c,
            )  # fmt: skip
        else:
            pg_M, pg_metrics = ppo_policy_loss(
                log_probs_M, old, adv,
                eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c,
            )  # fmt: skip
        metrics: dict[str, torch.Tensor] = {}
        reduce = self.reducer(mb, counts)
        if self.tis_fn is not None:
            # The loss terms use the correction's masks (rejection sampling); its metrics the original ones.
            pg_M, mask_M, metrics = self._correct_mismatch(mb, tok, pg_M, pg_metrics["ppo_kl"], reduce)
            reduce = self.reducer(mb, counts, mask_M)
        pg_loss = reduce(pg_M)
        # With --entropy-coef 0 the entropy is only logged: detached, the fused LM-head backward skips its
        # gradient terms (two passes over each [chunk, vocab] block).
        entropy_loss = reduce(entropy_M if algo.entropy_coef else entropy_M.detach())
        loss = pg_loss - algo.entropy_coef * entropy_loss
        if algo.use_kl_loss:
            kl_loss = reduce(kl_estimate(log_probs_M, tok("ref_log_probs"), algo.kl_loss_type))
            loss = loss + algo.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if "rollout_log_probs" in mb.per_token:
            metrics["train_rollout_logprob_abs_diff"] = reduce((old - tok("rollout_log_probs")).abs())
        metrics.update(
            loss=loss.detach(),
            pg_loss=pg_loss.detach(),
            entropy_loss=entropy_loss.detach(),
            pg_clipfrac=reduce(pg_metrics["pg_clipfrac"]),
            ppo_kl=reduce(pg_metrics["ppo_kl"]),
        )
        return loss, metrics

    def _correct_mismatch(self, mb, tok, pg_M, ppo_kl_M, reduce):
        """(pg_M with the correction applied, modified loss mask [M], reduced metrics incl. ois)."""
        lengths = mb.response_lengths
        # The recomputed log-probs: the old ones, unless --use-rollout-logprobs replaced those.
        train_M = tok("train_log_probs") if "train_log_probs" in mb.per_token else tok("old_log_probs")
        pg_M, masks, raw = self.tis_fn(
            args=self.args, pg_loss=pg_M, train_log_probs=list(train_M.split(lengths)),
            rollout_log_probs=list(tok("rollout_log_probs").split(lengths)),
            loss_masks=list(mb.loss_mask_M.split(lengths)), total_lengths=mb.attn.cu_seqlens.diff().tolist(),
            response_lengths=list(lengths),
        )  # fmt: skip
        mask_M = torch.cat([torch.as_tensor(m) for m in masks]).to(mb.loss_mask_M)
        path = self.algo.custom_tis_function_path or "vanilla TIS"
        raw = {name: torch.as_tensor(value) for name, value in raw.items()}
        for name, value in {"pg_loss": torch.as_tensor(pg_M), "loss mask": mask_M, **raw}.items():
            if tuple(value.shape) != tuple(mb.loss_mask_M.shape):
                raise ValueError(
                    f"--custom-tis-function-path {path!r} returned {name} of shape {tuple(value.shape)}; "
                    f"expected one value per response token, {tuple(mb.loss_mask_M.shape)}"
                )
        metrics = {"ois": reduce(torch.exp(-ppo_kl_M))}
        metrics.update({name: reduce(value.detach().float()) for name, value in raw.items()})
        return pg_M, mask_M, metrics


def _per_token(mb: MicroBatch, like: torch.Tensor) -> Callable[[str], torch.Tensor]:
    """Named per-token input of the micro-batch; zeros for a dummy micro-batch (its mask is all 0)."""

    def get(name: str) -> torch.Tensor:
        if mb.is_dummy:
            return torch.zeros_like(like).detach()
        return mb.per_token[name].to(like.dtype)

    return get


def _batch_view(mb: MicroBatch) -> dict[str, Any]:
    """What a custom loss function receives as `batch`: flat [M] tensors over the micro-batch's response
    tokens (samples in order) plus the per-sample lengths.

    tokens (the response token ids), loss_masks (float 0/1), response_lengths and total_lengths (lists of
    int), old_log_probs, advantages, and when present ref_log_probs, rollout_log_probs, train_log_probs."""
    return {
        "loss_masks": mb.loss_mask_M,
        "response_lengths": mb.response_lengths,
        "total_lengths": mb.attn.cu_seqlens.diff().tolist(),
        "tokens": mb.targets_M,
        **mb.per_token,
    }
