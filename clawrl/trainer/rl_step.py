"""One rollout's training on one rank: log-prob passes, advantages, then the optimizer steps.

Every rank holds the whole TrainBatch and computes the same micro-batch plan per optimizer step
(`plan_micro_batches`), then works only on its own samples. The log-prob passes use the SAME micro-batches
as the training pass, so with unchanged weights the recomputed log-probs are bit-identical to the ones
the loss sees (step 1: ppo_kl == 0 and, with the reference equal to the policy, kl_loss == 0 exactly).

Legend: M = response tokens of a micro-batch; per-sample tensors live in dicts keyed by sample index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clawrl.algo import compute_advantages_and_returns, kl_estimate, whiten_advantages
from clawrl.data.train_batch import TrainBatch
from clawrl.trainer.distributed import all_reduce_sum
from clawrl.trainer.logprobs import _chunk_logits, linear_log_probs
from clawrl.trainer.loss import StepCounts
from clawrl.trainer.micro_batch import MicroBatch, build_micro_batch
from clawrl.trainer.packing import MicroBatchPlan, plan_micro_batches


@dataclass(kw_only=True)
class StepPlan:
    """The samples of one optimizer step and how this rank packs its share."""

    sample_ids: list[int]
    """Indices into the TrainBatch, the step's samples in order."""
    plan: MicroBatchPlan
    counts: StepCounts


def plan_steps(batch: TrainBatch, *, global_batch_size, dp_size, max_tokens_per_gpu, micro_batch_size,
               max_response_len) -> list[StepPlan]:  # fmt: skip
    """Split the rollout into optimizer steps of `global_batch_size` samples and plan each."""
    if len(batch) % global_batch_size:
        raise ValueError(
            f"the rollout has {len(batch)} samples, not a multiple of --global-batch-size {global_batch_size}"
        )
    lengths = batch.total_lengths
    steps = []
    for start in range(0, len(batch), global_batch_size):
        ids = list(range(start, start + global_batch_size))
        plan = plan_micro_batches(
            [lengths[i] for i in ids],
            dp_size,
            max_tokens_per_gpu=max_tokens_per_gpu,
            micro_batch_size=micro_batch_size,
        )
        counts = StepCounts(
            num_tokens=float(sum(sum(batch.loss_masks[i]) for i in ids)),
            num_samples=len(ids),
            max_response_len=max_response_len or max(batch.response_lengths[i] for i in ids),
        )
        steps.append(StepPlan(sample_ids=ids, plan=plan, counts=counts))
    return steps


def micro_batches(batch, step: StepPlan, rank: int, device, per_token=None) -> list[MicroBatch]:
    """This rank's micro-batches of one step (plan indices mapped back to TrainBatch indices)."""
    return [
        build_micro_batch(batch, [step.sample_ids[j] for j in mb], device, per_token)
        for mb in step.plan.per_rank[rank]
    ]


def forward_log_probs(model, mb: MicroBatch, temperature: float, with_entropy: bool):
    """Response-token log-probs (and entropy) of one micro-batch: [M] fp32 each."""
    hidden = model(mb.input_ids_N, mb.positions_N, mb.attn)
    if getattr(model, "batch_invariant", False):  # --true-on-policy-mode: the engine's LM-head and log-prob
        from clawrl.models import batch_invariant  # kernels (imports Triton: only in this mode)

        logits = batch_invariant.layer_linear(model.lm_head, hidden[mb.logit_rows_M])
        return batch_invariant.log_probs_of(logits, mb.targets_M, temperature, with_entropy=with_entropy)
    return linear_log_probs(
        hidden[mb.logit_rows_M], model.lm_head.weight, mb.targets_M, temperature=temperature,
        with_entropy=with_entropy,
    )  # fmt: skip


def forward_logits(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Response-position logits of one micro-batch divided by the temperature: [M, V] fp32 (what the
    log-probs are computed from: log_softmax(logits)[m, targets[m]] is forward_log_probs' value at m).
    For a custom loss only: the whole [M, V] block exists at once, unlike in the chunked log-prob pass."""
    hidden = model(mb.input_ids_N, mb.positions_N, mb.attn)
    return _chunk_logits(hidden[mb.logit_rows_M], model.lm_head.weight, 1.0 / temperature)


@torch.no_grad()
def compute_log_probs(model, batch, steps, rank, device, temperature) -> dict[int, torch.Tensor]:
    """{sample index: [R] log-probs} for this rank's samples, with the model's current weights."""
    out: dict[int, torch.Tensor] = {}
    for step in steps:
        for mb in micro_batches(batch, step, rank, device):
            if mb.is_dummy:
                forward_log_probs(model, mb, temperature, with_entropy=False)
                continue
            log_probs, _ = forward_log_probs(model, mb, temperature, with_entropy=False)
            for sid, part in zip(mb.sample_ids, log_probs.split(mb.response_lengths), strict=True):
                out[sid] = part.detach()
    return out


def compute_advantages(batch, my_ids, algo, log_probs, ref_log_probs, device, values=None):
    """({sample index: [R] advantages}, {sample index: [R] returns}) for this rank's samples; advantages are
    whitened over all ranks if asked, returns never are. `values` ({sample index: [R]}) are the critic's
    (ppo's GAE)."""
    if not my_ids:
        return {}, {}
    lengths = [batch.response_lengths[i] for i in my_ids]
    mask = torch.tensor([m for i in my_ids for m in batch.loss_masks[i]], dtype=torch.float32, device=device)
    kl = None
    if algo.kl_coef != 0:
        kl = kl_estimate(
            torch.cat([log_probs[i] for i in my_ids]), torch.cat([ref_log_probs[i] for i in my_ids]),
            algo.kl_loss_type,
        )  # fmt: skip
    advantages, returns = compute_advantages_and_returns(
        algo.advantage_estimator,
        rewards_B=torch.tensor([batch.rewards[i] for i in my_ids], dtype=torch.float32, device=device),
        response_lengths=lengths, loss_mask_N=mask, kl_N=kl, kl_coef=algo.kl_coef, gamma=algo.gamma,
        lambd=algo.lambd, values_N=None if values is None else torch.cat([values[i] for i in my_ids]),
    )  # fmt: skip
    if algo.normalize_advantages:
        advantages = whiten_advantages(advantages, mask, sum_fn=all_reduce_sum)
    per_sample = dict(zip(my_ids, advantages.float().split(lengths), strict=True))
    return per_sample, dict(zip(my_ids, returns.float().split(lengths), strict=True))


def per_sample_mean(values: dict[int, torch.Tensor], batch: TrainBatch, device) -> float:
    """Mean over ALL samples (all ranks) of each sample's masked mean: slime's per-rollout-mean metric.

    A fixed number of operations whatever the sample count (a rollout has hundreds; one small kernel and an
    upload per sample took tens of ms per metric on a GPU), and deterministic: each sample's terms are summed
    as one row of a zero-padded [samples, longest] matrix, not by atomics or a scan."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    ids = list(values)
    if ids:
        lengths = torch.tensor([values[i].numel() for i in ids])
        longest = int(lengths.max())
        rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        place = rows * longest + torch.arange(int(lengths.sum())) - starts[rows]
        flat = torch.cat([values[i] for i in ids]).to(device=device, dtype=torch.float64)
        masks = [batch.loss_masks[i] for i in ids]
        mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.float64, device=device)
        padded = torch.zeros(len(ids) * longest, dtype=torch.float64, device=device)
        padded[place.to(device)] = flat * mask
        counts = torch.tensor([max(sum(ms), 1) for ms in masks], dtype=torch.float64, device=device)
        total[0] = (padded.view(len(ids), -1).sum(dim=1) / counts).sum()
        total[1] = len(ids)
    all_reduce_sum(total)
    return float(total[0] / total[1].clamp(min=1.0))
