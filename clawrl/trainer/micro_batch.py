"""MicroBatch: the tensors of one packed forward/backward pass, built from a TrainBatch and a plan.

Legend: N = tokens of the packed micro-batch (no padding), M = response tokens in it (the tokens whose
log-prob is computed), B = samples in it.

Sample b occupies rows [o_b, o_b + L_b) of the packed sequence; its R_b response tokens are the last R_b
tokens, predicted by the hidden states one position earlier: rows o_b + L_b - R_b - 1 ... o_b + L_b - 2.
Per-token training inputs (old log-probs, advantages, ...) are concatenated over samples in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clawrl.data.train_batch import TrainBatch
from clawrl.models.attention import VarlenAttention


@dataclass(kw_only=True)
class MicroBatch:
    """One packed micro-batch; `is_dummy` ones exist only to keep FSDP collectives in step across ranks."""

    sample_ids: list[int]
    """Indices into the TrainBatch of the samples packed here, in order."""
    input_ids_N: torch.Tensor
    positions_N: torch.Tensor
    attn: VarlenAttention
    logit_rows_M: torch.Tensor
    """Rows of the packed hidden states that predict the response tokens."""
    targets_M: torch.Tensor
    """The response tokens themselves."""
    response_lengths: list[int]
    loss_mask_M: torch.Tensor
    """float 0/1 per response token."""
    is_dummy: bool = False
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named per-response-token inputs, e.g. "old_log_probs", "advantages" ([M] each)."""


def build_micro_batch(
    batch: TrainBatch,
    sample_ids: list[int],
    device: torch.device,
    per_token: dict[str, list[torch.Tensor]] | None = None,
) -> MicroBatch:
    """Pack `sample_ids` of `batch`; `per_token[name][i]` is sample i's [R_i] tensor for that input."""
    if not sample_ids:
        return _dummy(batch, device)
    tokens, positions, rows, targets, masks = [], [], [], [], []
    offset = 0
    for i in sample_ids:
        seq, resp = batch.tokens[i], batch.response_lengths[i]
        tokens.extend(seq)
        positions.extend(range(len(seq)))
        first_pred = offset + len(seq) - resp - 1
        rows.extend(range(first_pred, first_pred + resp))
        targets.extend(seq[len(seq) - resp :])
        masks.extend(batch.loss_masks[i])
        offset += len(seq)
    lengths = [len(batch.tokens[i]) for i in sample_ids]
    extra = {
        name: torch.cat([values[i] for i in sample_ids]).to(device)
        for name, values in (per_token or {}).items()
    }
    return MicroBatch(
        sample_ids=list(sample_ids),
        input_ids_N=torch.tensor(tokens, dtype=torch.long, device=device),
        positions_N=torch.tensor(positions, dtype=torch.long, device=device),
        attn=VarlenAttention.from_lengths(lengths, device=device),
        logit_rows_M=torch.tensor(rows, dtype=torch.long, device=device),
        targets_M=torch.tensor(targets, dtype=torch.long, device=device),
        response_lengths=[batch.response_lengths[i] for i in sample_ids],
        loss_mask_M=torch.tensor(masks, dtype=torch.float32, device=device),
        per_token=extra,
    )


def _dummy(batch: TrainBatch, device: torch.device) -> MicroBatch:
    """A 2-token pass with an all-zero loss mask: runs every collective, contributes nothing."""
    seq = batch.tokens[0][:2]
    return MicroBatch(
        sample_ids=[],
        input_ids_N=torch.tensor(seq, dtype=torch.long, device=device),
        positions_N=torch.arange(len(seq), device=device),
        attn=VarlenAttention.from_lengths([len(seq)], device=device),
        logit_rows_M=torch.tensor([0], dtype=torch.long, device=device),
        targets_M=torch.tensor(seq[1:2], dtype=torch.long, device=device),
        response_lengths=[1],
        loss_mask_M=torch.zeros(1, device=device),
        is_dummy=True,
    )
