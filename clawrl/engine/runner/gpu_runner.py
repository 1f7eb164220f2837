"""GpuModelRunner: the engine's GPU step — batched inputs, fused forward, CUDA-graph decode, Triton sampling.

Shapes: N = new tokens of the step, B = sequences of a decode step, P = B padded to a CUDA-graph size,
M = sequences that sample, V = vocabulary, W = block-table width (blocks of the longest context).

A step is one of two kinds:
- decode (every scheduled sequence computes exactly its last token): the inputs of all sequences go into
  one pinned host array [7, max batch] (token id, position, cache slot, block-table row, context length,
  pending-token source, sampling key), copied to a static device buffer in one transfer; the batch is padded
  to the next size of
  `decode_batch_sizes` (padding rows: context 0, K/V to the cache's scratch slot) and the captured CUDA graph
  of that size replays forward + LM head. With CUDA graphs off, the same padded forward runs eagerly, so
  both modes compute the same numbers.
- prefill / mixed (prompt chunks, possibly with decode tokens): runs eagerly with the prefill kernel.

Block tables live on the device, one row per running sequence (`DeviceBlockTables`); a step only sends the
entries that changed (a new block every block_size tokens), never whole tables.

The host work of a decode step is kept small, because with the overlap schedule it is what the GPU waits for
once it exceeds the GPU step: whatever depends only on which sequences are in the batch (their block-table
rows, prompt lengths, seed hashes, the sampler's row groups and temperatures on the device) is built once per
batch composition (`_DecodeRows`, reused while the scheduler's epoch and the sequence list are unchanged);
per step only positions and last tokens are read from the sequences and the rest is numpy over the batch.

CUDA graphs are captured by `capture_cuda_graphs()` (the engine calls it at start-up: one eager warm-up
forward per size compiles the Triton kernels first, then each size is captured, largest first, into one
shared memory pool) and again lazily after `invalidate_cuda_graphs()` (KV cache or weights re-allocated).

One decode step: `launch` -> `_decode` (inputs into the staging buffer) -> `_decode_forward` (replays the
CUDA graph of `_forward` + LM head) -> `sample_planned` (sampler.py) -> copies of tokens and logprobs to the
host, which `collect` waits for.

The forward itself (`fused_forward`, at the end of this module) is the decoder's math on the model's own
parameters with fused Triton kernels: the same math as `CausalLM.forward` (clawrl/models/decoder.py) — the kernels in triton_ops.py reproduce the eager
ops' rounding — but ~10 kernels per layer instead of ~40, which is what a decode step at batch 256 is made
of once CUDA graphs remove the launch cost:

    norm(x + residual) | qkv GEMM | RoPE + KV-cache write | paged attention | o GEMM | norm(x + residual)
    | gate_up GEMM | silu * up | down GEMM

The residual stream is carried separately and added inside the next norm (`add_rmsnorm`), so `x + attn(...)`
and `x + mlp(...)` cost no kernel of their own. Qwen3's q/k norms run as the model's RMSNorm modules before
RoPE. Needs a model built with `fused=True` (packed qkv_proj and gate_up_proj).

Its shapes: H = hidden size, Hq / Hkv = query / KV heads, D = head_dim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from clawrl.engine.core.scheduler import ScheduledBatch
from clawrl.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from clawrl.engine.runner.base import DeviceTiming, StepHandle, record_prompt_logprobs, record_top_logprobs
from clawrl.engine.runner.kv_cache import KVCache, TritonBatch, TritonPagedAttention
from clawrl.engine.runner.sampler import (
    SamplingPlan,
    host_to_device,
    plan_sampling,
    sample_planned,
    sampling_keys,
    seed_keys,
    shape_logits,
    step_keys,
)
from clawrl.engine.runner.triton_attention import decode_num_splits, plan_prefill_tiles, prefill_block_m
from clawrl.engine.runner.triton_ops import add_rmsnorm, rotary_cache_write, silu_and_mul
from clawrl.models.decoder import Attention, CausalLM

_STAGING_ROWS = (
    7  # token id, position, cache slot, block-table row, context length, pending source, sampling key
)
_FORWARD_ROWS = 6  # the staging rows the decode forward (and its CUDA graphs) reads


def decode_batch_sizes(max_running_requests: int) -> list[int]:
    """CUDA-graph batch sizes: powers of two below the maximum, then the maximum itself."""
    sizes = []
    size = 1
    while size < max_running_requests:
        sizes.append(size)
        size *= 2
    return [*sizes, max_running_requests]


@dataclass(kw_only=True, eq=False)
class _TableRow:
    seq: Sequence
    row: int
    table: list[int]  # the sequence's block_table list object when last synced
    num_synced: int  # leading entries of `table` already on the device (and in the host mirror)


class DeviceBlockTables:
    """Block tables of running sequences as rows of one device tensor [rows, W], updated incrementally, with a
    host mirror (`host_table`) from which the decode step looks up cache slots.

    A sequence keeps its row while it runs. The scheduler only appends to a block table, or replaces the
    list object (admission, preemption), so comparing the list's identity and length finds what changed.
    Rows of sequences that stopped running are reclaimed when no row is free.
    """

    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.device_table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
        self.host_table = np.zeros((num_rows, width), dtype=np.int64)
        self.num_synced = np.zeros(num_rows, dtype=np.int64)  # per row: leading entries on the device
        self._entries: dict[int, _TableRow] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def rows_for(self, seqs: list[Sequence]) -> list[int]:
        """Device rows holding each sequence's current block table (sending new entries first)."""
        rows, stale = [], []
        for seq in seqs:
            entry = self._entries.get(seq.seq_id)
            if entry is None:
                entry = self._assign(seq)
            table = seq.block_table
            if entry.table is not table or len(table) < entry.num_synced:
                entry.table, entry.num_synced = table, 0
                self.num_synced[entry.row] = 0
            if len(table) > entry.num_synced:
                stale.append(entry)
            rows.append(entry.row)
        self._send(stale)
        return rows

    def sync_grown(self, seqs: list[Sequence], rows_B: np.ndarray, num_needed_B: np.ndarray) -> None:
        """Send the new entries of tables that grew, for sequences whose rows `rows_B` were given by rows_for
        within the same scheduler epoch (so each table is still the synced list, only longer): a row is sent
        when the device holds fewer than `num_needed_B` of its entries."""
        stale = np.flatnonzero(self.num_synced[rows_B] < num_needed_B)
        if stale.size:
            self._send([self._entries[seqs[i].seq_id] for i in stale.tolist()])

    def _send(self, entries: list[_TableRow]) -> None:
        """Copy the unsynced tail of each entry's table to the device and the host mirror."""
        if not entries:
            return
        rows, cols, blocks = [], [], []
        for entry in entries:  # all running sequences at once when they cross a block boundary together
            table, start, end = entry.table, entry.num_synced, len(entry.table)
            assert end <= self.width, "block table wider than context_length allows"
            if end - start == 1:  # a decoding sequence's one new block
                rows.append(entry.row)
                cols.append(start)
                blocks.append(table[start])
            else:
                rows += [entry.row] * (end - start)
                cols += range(start, end)
                blocks += table[start:]
            entry.num_synced = end
        self.num_synced[[e.row for e in entries]] = [e.num_synced for e in entries]
        update = np.array([rows, cols, blocks], dtype=np.int64)
        self.host_table[update[0], update[1]] = update[2]
        update_device = host_to_device(torch.from_numpy(update), self.device_table.device)
        self.device_table.index_put_((update_device[0], update_device[1]), update_device[2].to(torch.int32))

    def _assign(self, seq: Sequence) -> _TableRow:
        if not self._free_rows:
            for seq_id, entry in list(self._entries.items()):
                if entry.seq.status is not SequenceStatus.RUNNING:
                    del self._entries[seq_id]
                    self._free_rows.append(entry.row)
        assert self._free_rows, "more running sequences than block-table rows"
        entry = _TableRow(seq=seq, row=self._free_rows.pop(), table=[], num_synced=0)
        self._entries[seq.seq_id] = entry
        return entry


@dataclass(kw_only=True, eq=False)
class _DecodeRows:
    """What a decode step needs about its sequences that stays fixed while the same sequences decode."""

    seqs: list[Sequence]
    """The batch's sequences, in row order (compared by identity to reuse this record)."""
    epoch: int
    """ScheduledBatch.epoch of the batch this was built for."""
    table_rows_B: np.ndarray
    """Each sequence's row in DeviceBlockTables, int64 [B]."""
    prompt_lens_B: np.ndarray
    """Prompt lengths, int64 [B] (a decode step's sampling step is position + 1 - prompt length)."""
    seed_keys_B: np.ndarray
    """sampler.seed_keys of the sequences' seeds [B]."""
    plan: SamplingPlan
    """The sampler's row groups and device temperatures."""


class GpuModelRunner:
    """Runs one scheduled step of a fused CausalLM on the GPU (module docstring); implements base.ModelRunner."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        max_running_requests: int,
        context_length: int,
        enable_cuda_graph: bool = True,
        fused_kernels: bool = True,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.timing = DeviceTiming()
        """Collected steps' device span and the host's wait for them (engine stats: /get_server_info)."""
        self.attention = TritonPagedAttention(kv_cache)
        self.fused_kernels = fused_kernels
        self.batch_invariant = batch_invariant
        if batch_invariant:  # --true-on-policy-mode: the trainer's kernels, the model's own forward
            from clawrl.models.batch_invariant import PagedBatchInvariantAttention, enable_batch_invariant

            enable_batch_invariant(model)
            self.attention = PagedBatchInvariantAttention(kv_cache)
            self.fused_kernels = False
        is_cuda = self.device.type == "cuda"
        self.enable_cuda_graph = enable_cuda_graph and is_cuda
        self.batch_sizes = decode_batch_sizes(max_running_requests)
        width = -(-context_length // kv_cache.block_size)
        self.tables = DeviceBlockTables(max_running_requests + 1, width, self.device)
        max_batch = self.batch_sizes[-1]
        # Host-side buffers come in pairs, alternating per launch: with the overlap schedule the copy out of
        # one may still be queued while the next step fills the other (the engine collects step t before it
        # launches step t + 2, which completes every copy of step t).
        self._staging_host = [
            torch.zeros(_STAGING_ROWS, max_batch, dtype=torch.int64, pin_memory=is_cuda) for _ in range(2)
        ]
        self._tokens_host = [torch.zeros(max_batch, dtype=torch.int64, pin_memory=is_cuda) for _ in range(2)]
        self._logprobs_host = [
            torch.zeros(max_batch, dtype=torch.float32, pin_memory=is_cuda) for _ in range(2)
        ]
        self._flip = 0
        self._staging = torch.zeros(_STAGING_ROWS, max_batch, dtype=torch.int64, device=self.device)
        # Tokens sampled by the last launch (the sampler writes them here), read on the device by the next one
        # (overlap schedule): in stream order that read comes first, in the next launch's forward.
        self._last_tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._logprobs = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self._last_seqs: list[Sequence] = []
        self._last_rows: dict[int, int] | None = None
        self._decode_rows: _DecodeRows | None = None
        self.vocab_size = model.args.vocab_size
        # CPU (interpreter tests): pretend 2 multiprocessors, which keeps decode mostly unsplit.
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if is_cuda else 2
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None

    # -- public -------------------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward the batch; returns (sampling sequences, their next tokens, those tokens' logprobs)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Queue the step's forward, sampling and the copy of its results to the host; no synchronisation.

        A sequence whose last token is PENDING_TOKEN gets the token the previous launch sampled for it,
        read on the device (the overlap schedule launches step t + 1 before step t's tokens are back)."""
        self._flip ^= 1
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        if batch.is_decode:
            seqs = batch.seqs
            logits_MV, keys_M, plan = self._decode(batch)
        else:
            seqs = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
            logits_MV, keys_M = self._prefill(batch, seqs)
            if not seqs:  # a prefill chunk that samples nothing: its device time is not counted
                return StepHandle(seqs=[])
            plan = plan_sampling([s.params for s in seqs], self.vocab_size, self.device)
        if plan.host_rules:  # requests with penalties / top logprobs (the engine then skips the overlap)
            logits_MV = shape_logits(logits_MV, seqs)
            record_top_logprobs(seqs, logits_MV)
        num_rows = len(seqs)
        tokens_M, logprobs_M = self._last_tokens[:num_rows], self._logprobs[:num_rows]
        sample_planned(logits_MV, plan, keys_M, tokens_M=tokens_M, logprobs_M=logprobs_M)
        if self.batch_invariant:  # the logprob by the op the trainer recomputes it with, bit for bit
            from clawrl.models.batch_invariant import sampled_log_probs

            sampled_log_probs(logits_MV, tokens_M, plan.temperatures_M, out=logprobs_M)
        self._last_seqs, self._last_rows = seqs, None  # rows by seq_id: built when a pending token needs them
        host_tokens = self._tokens_host[self._flip][:num_rows]
        host_logprobs = self._logprobs_host[self._flip][:num_rows]
        host_tokens.copy_(tokens_M, non_blocking=True)
        host_logprobs.copy_(logprobs_M, non_blocking=True)
        event = None
        if started is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return StepHandle(
            seqs=seqs, host_tokens=host_tokens, host_logprobs=host_logprobs, event=event, started=started
        )

    def collect(self, handle: StepHandle) -> tuple[list[Sequence], list[int], list[float]]:
        """Wait for a launched step's results: (sampling sequences, next tokens, their logprobs)."""
        if not handle.seqs:
            return [], [], []
        if handle.event is not None:
            waited = time.perf_counter()
            handle.event.synchronize()
            timing = self.timing
            timing.wait_s += time.perf_counter() - waited
            timing.gpu_s += handle.started.elapsed_time(handle.event) / 1e3
        return handle.seqs, handle.host_tokens.tolist(), handle.host_logprobs.tolist()

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Warm up (compile) and capture the decode forward for every batch size (no-op when disabled)."""
        if not self.enable_cuda_graph:
            return
        self._graphs.clear()
        self._write_padding(self._staging_host[self._flip].numpy(), 0)
        self._staging.copy_(self._staging_host[self._flip])
        for size in reversed(self.batch_sizes):
            self._decode_forward(size)  # compiles the Triton kernels outside of any capture
        torch.cuda.synchronize(self.device)
        for size in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                logits = self._decode_forward(size)
            if self._graph_pool is None:
                self._graph_pool = graph.pool()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def invalidate_cuda_graphs(self) -> None:
        """Forget the graphs (they hold addresses of the KV cache and weights); recaptured when next needed."""
        self._graphs.clear()
        self._graph_pool = None

    # -- decode -------------------------------------------------------------------------------------------

    def _decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, SamplingPlan]:
        """Stage the inputs, replay (or run) the forward: (logits [B, V], sampling keys [B] on the device, plan)."""
        if self.enable_cuda_graph and not self._graphs:
            self.capture_cuda_graphs()  # first decode after invalidate_cuda_graphs()
        seqs = batch.seqs
        num_seqs = len(seqs)
        size = next(s for s in self.batch_sizes if s >= num_seqs)
        rows = self._rows_of(batch)
        block_size = self.kv_cache.block_size
        positions_B = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        blocks_B = positions_B // block_size
        self.tables.sync_grown(seqs, rows.table_rows_B, blocks_B + 1)
        host = self._staging_host[self._flip].numpy()
        host[0, :num_seqs] = [
            s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in seqs
        ]
        host[1, :num_seqs] = positions_B
        host[2, :num_seqs] = (
            self.tables.host_table[rows.table_rows_B, blocks_B] * block_size + positions_B % block_size
        )
        host[3, :num_seqs] = rows.table_rows_B
        host[4, :num_seqs] = positions_B + 1
        host[5, :num_seqs] = self._pending_sources(seqs, host[0, :num_seqs])
        # The step of a decoding sequence (tokens generated so far) is its context length minus its prompt.
        host[6, :num_seqs] = step_keys(rows.seed_keys_B, positions_B + 1 - rows.prompt_lens_B)
        self._write_padding(host, num_seqs)
        self._staging.copy_(self._staging_host[self._flip], non_blocking=True)
        if self.enable_cuda_graph:
            graph, logits = self._graphs[size]
            graph.replay()
        else:
            logits = self._decode_forward(size)
        return logits[:num_seqs], self._staging[6, :num_seqs], rows.plan

    def _rows_of(self, batch: ScheduledBatch) -> _DecodeRows:
        """The batch's _DecodeRows: the last one when the same sequences decode in the same epoch, else new."""
        cached = self._decode_rows
        if cached is not None and cached.epoch == batch.epoch and cached.seqs == batch.seqs:
            return cached
        seqs = batch.seqs
        self._decode_rows = _DecodeRows(
            seqs=seqs, epoch=batch.epoch, table_rows_B=np.array(self.tables.rows_for(seqs), dtype=np.int64),
            prompt_lens_B=np.array([len(s.prompt_token_ids) for s in seqs], dtype=np.int64),
            seed_keys_B=seed_keys([s.sampler_state for s in seqs]),
            plan=plan_sampling([s.params for s in seqs], self.vocab_size, self.device),
        )  # fmt: skip
        return self._decode_rows

    def _pending_sources(self, seqs: list[Sequence], last_ids_B: np.ndarray) -> np.ndarray | int:
        """Row of the previous launch's tokens for each PENDING_TOKEN input, -1 for known inputs."""
        pending_B = last_ids_B == PENDING_TOKEN
        if not pending_B.any():
            return -1
        if seqs == self._last_seqs:  # the same sequences in the same rows as the previous launch
            return np.where(pending_B, np.arange(len(seqs)), -1)
        return [self._pending_source(s, t) for s, t in zip(seqs, last_ids_B.tolist(), strict=True)]

    def _pending_source(self, seq: Sequence, last_id: int) -> int:
        """Row of `seq` in the previous launch if its input `last_id` is PENDING_TOKEN, else -1."""
        if last_id != PENDING_TOKEN:
            return -1
        if self._last_rows is None:
            self._last_rows = {s.seq_id: i for i, s in enumerate(self._last_seqs)}
        return self._last_rows[seq.seq_id]

    def _write_padding(self, host: np.ndarray, num_seqs: int) -> None:
        """Rows num_seqs.. of a staging array: token 0 at position 0, K/V to the scratch slot, no context."""
        host[:, num_seqs:] = 0
        host[2, num_seqs:] = self.kv_cache.scratch_slot
        host[5, num_seqs:] = -1

    def _decode_forward(self, size: int) -> torch.Tensor:
        """Forward + LM head of the first `size` staging rows (what a CUDA graph of that size captures)."""
        input_ids, positions, slots, rows, ctx_lens, sources = self._staging[:_FORWARD_ROWS, :size].unbind(0)
        self.attention.begin(
            TritonBatch(
                slot_mapping_N=slots, block_tables=self.tables.device_table.index_select(0, rows),
                ctx_lens=ctx_lens, num_splits=decode_num_splits(size, self.kv_cache.block_shape[2], self._num_sms),
            )
        )  # fmt: skip
        hidden = self._forward(self._resolve_pending(input_ids, sources), positions)
        return self.model.compute_logits(hidden)

    def _resolve_pending(self, input_ids: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """input_ids with entries whose source row is >= 0 taken from the previous launch's tokens."""
        return torch.where(sources >= 0, self._last_tokens[sources.clamp(min=0)], input_ids)

    # -- prefill ------------------------------------------------------------------------------------------

    def _prefill(self, batch: ScheduledBatch, sampling: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt chunks (and decode tokens) eagerly: (logits of `sampling` [M, V], their keys [M])."""
        block_size = self.kv_cache.block_size
        ids, sources, positions, slots, query_lens, ctx_lens, sample_rows = [], [], [], [], [], [], []
        num_tokens = 0
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            chunk = seq.token_ids(start, end)
            ids.extend(chunk)
            sources.extend([-1] * (num_new - 1) + [self._pending_source(seq, chunk[-1])])
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(seq.block_table[: (end - 1) // block_size + 1], dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            query_lens.append(num_new)
            ctx_lens.append(end)
            num_tokens += num_new
            if batch.samples(i):
                sample_rows.append(num_tokens - 1)
        num_heads, num_kv_heads = self.model.args.num_heads, self.model.args.num_kv_heads
        tile_seq, tile_first = plan_prefill_tiles(query_lens, prefill_block_m(num_heads, num_kv_heads))
        query_start = np.concatenate([[0], np.cumsum(query_lens)])
        keys = sampling_keys([s.sampler_state for s in sampling], [len(s.output_token_ids) for s in sampling])
        parts = [ids, sources, np.concatenate(positions), np.concatenate(slots), self.tables.rows_for(batch.seqs),
                 ctx_lens, query_start, tile_seq, tile_first, sample_rows, keys]  # fmt: skip
        ids_N, sources_N, positions_N, slots_N, rows, ctx, starts, t_seq, t_first, sample_M, keys_M = (
            _to_device(parts, self.device)
        )
        self.attention.begin(
            TritonBatch(
                slot_mapping_N=slots_N, block_tables=self.tables.device_table.index_select(0, rows),
                ctx_lens=ctx, query_start=starts, tile_seq=t_seq, tile_first=t_first,
            )
        )  # fmt: skip
        hidden_ND = self._forward(self._resolve_pending(ids_N, sources_N), positions_N)
        record_prompt_logprobs(self.model, batch, hidden_ND)  # only rows of requests that ask
        return self.model.compute_logits(hidden_ND[sample_M]), keys_M

    # -- shared -------------------------------------------------------------------------------------------

    def _forward(self, input_ids_N: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            return fused_forward(self.model, input_ids_N, positions_N, self.attention, self.kv_cache)
        return self.model(input_ids_N, positions_N, self.attention)


_ALIGN_INT64 = 2
"""int64 elements in 16 bytes: where each of _to_device's tensors starts in the shared buffer."""


def _to_device(parts: list, device: torch.device) -> list[torch.Tensor]:
    """Int64 device tensors of several host sequences through one host-to-device copy.

    Each tensor starts 16-byte aligned in the shared buffer (each part is padded to an even length).
    Triton specializes a kernel on whether each pointer argument is 16-byte aligned, so views at offsets
    that follow the batch's lengths would compile a new variant of the prefill kernels (~0.1 s each, in the
    engine's step) for every new pattern of odd lengths: rollouts with other prompts kept compiling."""
    arrays = [np.asarray(p, dtype=np.int64) for p in parts]
    sizes = [-(-a.shape[0] // _ALIGN_INT64) * _ALIGN_INT64 for a in arrays]
    flat = np.zeros(sum(sizes), dtype=np.int64)
    offsets = np.cumsum([0, *sizes])[:-1]
    for array, offset in zip(arrays, offsets, strict=True):
        flat[offset : offset + array.shape[0]] = array
    # Through pinned memory: a copy from pageable memory would wait for all queued GPU work (the previous
    # step, when overlapping).
    device_flat = host_to_device(torch.from_numpy(flat), device)
    return [device_flat[offset : offset + a.shape[0]] for a, offset in zip(arrays, offsets, strict=True)]


# ---------------------------------------------------------------------------------------------------
# the fused forward


def fused_forward(
    model: CausalLM,
    input_ids_N: torch.Tensor,
    positions_N: torch.Tensor,
    attention: TritonPagedAttention,
    kv_cache: KVCache,
) -> torch.Tensor:
    """input_ids, positions [N] -> final-normed hidden states [N, H]; writes the step's K/V into kv_cache.

    `attention.begin(...)` must have been called with this step's layout (its slot mapping is used here).
    """
    assert model.fused, "fused_forward needs CausalLM(args, fused=True)"
    batch = attention.batch
    assert batch is not None, "attention.begin() must be called before the forward"
    rotary = model.model.rotary_emb
    x = model.model.embed_tokens(input_ids_N)
    residual = None
    for layer in model.model.layers:
        norm = layer.input_layernorm
        hidden, residual = add_rmsnorm(x, residual, norm.weight, norm.eps)
        attn = layer.self_attn
        q = _qkv_rope_cache(attn, hidden, positions_N, rotary, batch.slot_mapping_N, kv_cache)
        out = attention.attend(attn.layer_idx, q, attn.scale)
        x = F.linear(out.view(out.shape[0], attn.q_size), attn.o_proj.weight, attn.o_proj.bias)
        norm = layer.post_attention_layernorm
        hidden, residual = add_rmsnorm(x, residual, norm.weight, norm.eps)
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            gate_up = F.linear(hidden, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
            x = F.linear(silu_and_mul(gate_up), mlp.down_proj.weight, mlp.down_proj.bias)
        else:  # an MoE layer (clawrl/models/moe.py): router + experts in eager ops, graph-safe
            x = mlp(hidden)
    norm = model.model.norm
    hidden, _ = add_rmsnorm(x, residual, norm.weight, norm.eps)
    return hidden


def _qkv_rope_cache(attn: Attention, hidden, positions_N, rotary, slot_mapping_N, kv_cache: KVCache):
    """Project to q/k/v, rotate q (returned, [N, Hq, D]) and write rotated k and v into the layer's cache."""
    num_tokens = hidden.shape[0]
    qkv = F.linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(num_tokens, attn.num_heads, attn.head_dim)
    k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    rotary_cache_write(
        q, k, v, positions_N, rotary.cos_cache, rotary.sin_cache, slot_mapping_N,
        kv_cache.k[attn.layer_idx], kv_cache.v[attn.layer_idx],
    )  # fmt: skip
    return q
