"""The loss of one micro-batch, from its log-probs and entropy, with the step's global normalisation.

Every term and every metric is reduced with `clawrl.algo.aggregate_loss` against GLOBAL counts of the
optimizer step, so the sum over all micro-batches of all ranks is the step's value (the caller all-reduces
the metric sums). Aggregation mode: `--calculate-per-token-loss` -> per_token; dr_grpo -> seq_sum_const
(Dr. GRPO's constant denominator); otherwise per_sample (slime's default).

    loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss      (--loss-type policy_loss)
    loss = -mean log p(response)                                                (--loss-type sft_loss)
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
    token_tis_weights,
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
    """Computes (loss, metric contributions) of a micro-batch; built once per trainer."""

    def __init__(self, algo: AlgoConfig, loss_type: str, custom_fn: Callable | None = None, args: Any = None):
        self.algo, self.loss_type, self.custom_fn, self.args = algo, loss_type, custom_fn, args
        self.mode = aggregation_mode(algo)

    def reducer(self, mb: MicroBatch, counts: StepCounts) -> Callable[[torch.Tensor], torch.Tensor]:
        """x_M -> this micro-batch's share of the step-level aggregate of x."""

        def reduce(x_M: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(
                x_M,
                mb.loss_mask_M,
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
        if self.loss_type == "custom_loss":
            loss, metrics = self.custom_fn(self.args, _batch_view(mb), log_probs_M, reduce)
            return loss, {
                "loss": loss.detach(),
                **{k: torch.as_tensor(v).detach() for k, v in metrics.items()},
            }
        return self._policy_loss(mb, log_probs_M, entropy_M, reduce)

    def _policy_loss(self, mb, log_probs_M, entropy_M, reduce):
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
        if algo.use_tis:
            weights_M, tis_metrics = token_tis_weights(
                log_probs_M,
                old,
                tok("rollout_log_probs"),
                tis_clip=algo.tis_clip,
                tis_clip_low=algo.tis_clip_low,
            )
            pg_M = pg_M * weights_M.detach()
            metrics.update({k: reduce(v) for k, v in tis_metrics.items()})
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


def _per_token(mb: MicroBatch, like: torch.Tensor) -> Callable[[str], torch.Tensor]:
    """Named per-token input of the micro-batch; zeros for a dummy micro-batch (its mask is all 0)."""

    def get(name: str) -> torch.Tensor:
        if mb.is_dummy:
            return torch.zeros_like(like).detach()
        return mb.per_token[name].to(like.dtype)

    return get


def _batch_view(mb: MicroBatch) -> dict[str, Any]:
    """What a custom loss function receives as `batch`."""
    return {
        "loss_masks": mb.loss_mask_M,
        "response_lengths": mb.response_lengths,
        "tokens": mb.targets_M,
        **mb.per_token,
    }
