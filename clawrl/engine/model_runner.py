"""ModelRunner: turns a ScheduledBatch into flat model inputs, runs the model, samples next tokens.

This is the reference path (CPU, any dtype): one attention call per sequence, no kernels of our own. On
CUDA the engine uses gpu_runner.GpuModelRunner instead (`make_model_runner`), which computes the same steps
with batched Triton kernels and CUDA graphs.

Shapes: N = new tokens of the step over all sequences (flat, no batch dim), M = sequences that sample.
Only the last position of a sequence that reaches its end this step goes through the LM head: a chunk in
the middle of a long prompt, or prefix recomputation after preemption, produces no logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.kv_cache import KVCache
from clawrl.engine.paged_attention import PagedAttention, PagedBatch, causal_offset_mask
from clawrl.engine.sampler import sample
from clawrl.engine.scheduler import ScheduledBatch
from clawrl.engine.sequence import PENDING_TOKEN, Sequence


@dataclass(kw_only=True, eq=False)
class StepHandle:
    """A launched step: its sampling sequences and (once collected) their tokens and logprobs."""

    seqs: list[Sequence]
    """Sequences that sample in this step, in row order."""
    tokens: list[int] | None = None
    """Sampled token ids (reference runner: known at launch)."""
    logprobs: list[float] | None = None
    """Their logprobs (reference runner: known at launch)."""
    host_tokens: torch.Tensor | None = None
    """GPU runner: pinned int64 host buffer receiving the sampled token ids."""
    host_logprobs: torch.Tensor | None = None
    """GPU runner: pinned fp32 host buffer receiving their logprobs."""
    event: torch.cuda.Event | None = None
    """GPU runner: recorded after the device-to-host copies into the host buffers."""


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


def make_model_runner(
    config: EngineConfig, model: torch.nn.Module, kv_cache: KVCache, *, context_length: int
):
    """The GPU runner (gpu_runner.py) on CUDA, this reference runner elsewhere or with attention_backend
    "torch" (the plain-torch path, for debugging crashes in the kernels)."""
    if kv_cache.device.type != "cuda" or config.attention_backend == "torch":
        return ModelRunner(model, kv_cache)
    from clawrl.engine.gpu_runner import GpuModelRunner  # imports Triton: only on the GPU path

    return GpuModelRunner(
        model, kv_cache, max_running_requests=config.max_running_requests, context_length=context_length,
        enable_cuda_graph=config.enable_cuda_graph, fused_kernels=config.fused_kernels,
    )  # fmt: skip


class ModelRunner:
    """Runs one scheduled step of a CausalLM over the paged KV cache (the CPU / reference path)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = PagedAttention(kv_cache)
        self._last_tokens: dict[int, int] = {}  # seq_id -> token sampled by the last launch

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward the batch; returns (sampling sequences, their next tokens, those tokens' logprobs)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Start the step (here: compute it); `collect` returns its results. Sequences whose last token is
        PENDING_TOKEN get the token this runner sampled for them in the previous launch."""
        inputs = self.prepare(batch)
        self.attention.begin(inputs.paged)
        hidden_ND = self.model(inputs.input_ids_N, inputs.positions_N, self.attention)
        self.attention.batch = None
        seqs = inputs.sampling_seqs
        if not seqs:
            return StepHandle(seqs=[], tokens=[], logprobs=[])
        logits_MV = self.model.compute_logits(hidden_ND[inputs.sample_rows_M])
        tokens_M, logprobs_M = sample(
            logits_MV, [s.params for s in seqs], [s.sampler_state for s in seqs],
            [len(s.output_token_ids) for s in seqs],
        )  # fmt: skip
        tokens = tokens_M.tolist()
        self._last_tokens = {seq.seq_id: token for seq, token in zip(seqs, tokens, strict=True)}
        return StepHandle(seqs=seqs, tokens=tokens, logprobs=logprobs_M.tolist())

    def collect(self, handle: StepHandle) -> tuple[list[Sequence], list[int], list[float]]:
        """(sampling sequences, their next tokens, those tokens' logprobs) of a launched step."""
        return handle.seqs, handle.tokens, handle.logprobs

    def capture_cuda_graphs(self) -> None:
        """No CUDA graphs on this path (same interface as GpuModelRunner)."""

    def invalidate_cuda_graphs(self) -> None:
        """No CUDA graphs on this path (same interface as GpuModelRunner)."""

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
            if (
                ids[-1] == PENDING_TOKEN
            ):  # overlap schedule: sampled by the previous launch, not yet collected
                ids[-1] = self._last_tokens[seq.seq_id]
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
