"""ModelRunner: turns a ScheduledBatch into flat model inputs, runs the model, samples next tokens.

Shapes: N = new tokens of the step over all sequences (flat, no batch dim), M = sequences that sample.
Only the last position of a sequence that reaches its end this step goes through the LM head: a chunk in
the middle of a long prompt, or prefix recomputation after preemption, produces no logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clawrl.engine.kv_cache import KVCache
from clawrl.engine.paged_attention import PagedAttention, PagedBatch, causal_offset_mask
from clawrl.engine.sampler import sample
from clawrl.engine.scheduler import ScheduledBatch
from clawrl.engine.sequence import Sequence


@dataclass(kw_only=True)
class StepInputs:
    """Flat model inputs of one step."""

    input_ids_N: torch.Tensor
    """Token ids of every new token, LongTensor [N]."""
    positions_N: torch.Tensor
    """Position of every new token in its sequence, LongTensor [N]."""
    paged: PagedBatch
    """Attention layout (cache slots, per-sequence bounds and masks)."""
    sample_rows_M: torch.Tensor
    """Row of N holding the last token of each sampling sequence, LongTensor [M]."""
    sampling_seqs: list[Sequence]
    """The M sequences that sample, in row order."""


class ModelRunner:
    """Runs one scheduled step of a CausalLM over the paged KV cache."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = PagedAttention(kv_cache)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward the batch; returns (sampling sequences, their next tokens, those tokens' logprobs)."""
        inputs = self.prepare(batch)
        self.attention.begin(inputs.paged)
        hidden_ND = self.model(inputs.input_ids_N, inputs.positions_N, self.attention)
        self.attention.batch = None
        if not inputs.sampling_seqs:
            return [], [], []
        logits_MV = self.model.compute_logits(hidden_ND[inputs.sample_rows_M])
        seqs = inputs.sampling_seqs
        tokens, logprobs = sample(logits_MV, [s.params for s in seqs], [s.sampler_state for s in seqs])
        return seqs, tokens, logprobs

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Build ids, positions, cache slots and masks for every scheduled chunk."""
        device = self.kv_cache.device
        block_size = self.kv_cache.block_size
        offsets = torch.arange(block_size)
        ids: list[int] = []
        positions: list[int] = []
        new_slots, context_slots, masks, bounds, sample_rows = [], [], [], [0], []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            ids.extend(seq.token_ids(start, end))
            positions.extend(range(start, end))
            table = torch.tensor(seq.block_table[: -(-end // block_size)], dtype=torch.long)
            slots = (table.unsqueeze(1) * block_size + offsets).flatten()[:end]
            new_slots.append(slots[start:])
            context_slots.append(slots.to(device))
            masks.append(causal_offset_mask(num_new, end, device))
            bounds.append(bounds[-1] + num_new)
            if batch.samples(i):
                sample_rows.append(bounds[-1] - 1)
        paged = PagedBatch(
            slot_mapping_N=torch.cat(new_slots).to(device),
            query_bounds=bounds,
            context_slots=context_slots,
            masks=masks,
        )
        return StepInputs(
            input_ids_N=torch.tensor(ids, dtype=torch.long, device=device),
            positions_N=torch.tensor(positions, dtype=torch.long, device=device),
            paged=paged,
            sample_rows_M=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sampling_seqs=[s for i, s in enumerate(batch.seqs) if batch.samples(i)],
        )
