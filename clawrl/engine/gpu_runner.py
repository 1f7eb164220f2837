"""GpuModelRunner: the engine's GPU step — batched inputs, fused forward, CUDA-graph decode, one-pass sampling.

Shapes: N = new tokens of the step, B = sequences of a decode step, P = B padded to a CUDA-graph size,
M = sequences that sample, V = vocabulary, W = block-table width (blocks of the longest context).

A step is one of two kinds:
- decode (every scheduled sequence computes exactly its last token): the inputs of all sequences go into
  one pinned host array [5, max batch] (token id, position, cache slot, block-table row, context length),
  copied to a static device buffer in one transfer; the batch is padded to the next size of
  `decode_batch_sizes` (padding rows: context 0, K/V to the cache's scratch slot) and the captured CUDA graph
  of that size replays forward + LM head. With CUDA graphs off, the same padded forward runs eagerly, so
  both modes compute the same numbers.
- prefill / mixed (prompt chunks, possibly with decode tokens): runs eagerly with the prefill kernel.

Block tables live on the device, one row per running sequence (`DeviceBlockTables`); a step only sends the
entries that changed (a new block every block_size tokens), never whole tables.

CUDA graphs are captured by `capture_cuda_graphs()` (the engine calls it at start-up: one eager warm-up
forward per size compiles the Triton kernels first, then each size is captured, largest first, into one
shared memory pool) and again lazily after `invalidate_cuda_graphs()` (KV cache or weights re-allocated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from clawrl.engine.kv_cache import KVCache
from clawrl.engine.model_runner import StepHandle
from clawrl.engine.paged_attention import TritonBatch, TritonPagedAttention
from clawrl.engine.sampler import sample
from clawrl.engine.scheduler import ScheduledBatch
from clawrl.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from clawrl.engine.triton_attention import decode_num_splits, plan_prefill_tiles, prefill_block_m

_STAGING_ROWS = 6  # token id, position, cache slot, block-table row, context length, pending-token source


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
    num_synced: int  # leading entries of `table` already on the device


class DeviceBlockTables:
    """Block tables of running sequences as rows of one device tensor [rows, W], updated incrementally.

    A sequence keeps its row while it runs. The scheduler only appends to a block table, or replaces the
    list object (admission, preemption), so comparing the list's identity and length finds what changed.
    Rows of sequences that stopped running are reclaimed when no row is free.
    """

    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.device_table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
        self._entries: dict[int, _TableRow] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def rows_for(self, seqs: list[Sequence]) -> list[int]:
        """Device rows holding each sequence's current block table (sending new entries first)."""
        rows, changed_rows, changed_cols, changed_blocks = [], [], [], []
        for seq in seqs:
            entry = self._entries.get(seq.seq_id)
            if entry is None:
                entry = self._assign(seq)
            table = seq.block_table
            if entry.table is not table or len(table) < entry.num_synced:
                entry.table, entry.num_synced = table, 0
            if len(table) > entry.num_synced:
                assert len(table) <= self.width, "block table wider than context_length allows"
                count = len(table) - entry.num_synced
                changed_rows += [entry.row] * count
                changed_cols += range(entry.num_synced, len(table))
                changed_blocks += table[entry.num_synced :]
                entry.num_synced = len(table)
            rows.append(entry.row)
        if changed_rows:
            update = torch.tensor([changed_rows, changed_cols, changed_blocks], dtype=torch.int64)
            update = update.to(self.device_table.device, non_blocking=True)
            self.device_table.index_put_((update[0], update[1]), update[2].to(torch.int32))
        return rows

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


class GpuModelRunner:
    """Runs one scheduled step of a fused CausalLM on the GPU (module docstring); same interface as ModelRunner."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        max_running_requests: int,
        context_length: int,
        enable_cuda_graph: bool = True,
        fused_kernels: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.attention = TritonPagedAttention(kv_cache)
        self.fused_kernels = fused_kernels
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
        self._results_host = [
            torch.zeros(2 * max_batch, dtype=torch.float64, pin_memory=is_cuda) for _ in range(2)
        ]
        self._flip = 0
        self._staging = torch.zeros(_STAGING_ROWS, max_batch, dtype=torch.int64, device=self.device)
        # Tokens sampled by the last launch, read on the device by the next one (overlap schedule).
        self._last_tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._last_seqs: list[Sequence] = []
        self._last_rows: dict[int, int] | None = None
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
        if _is_decode(batch):
            seqs = batch.seqs
            logits_MV = self._decode(seqs)
        else:
            seqs = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
            logits_MV = self._prefill(batch)
        if not seqs:
            return StepHandle(seqs=[])
        tokens_M, logprobs_M = sample(
            logits_MV, [s.params for s in seqs], [s.sampler_state for s in seqs],
            [len(s.output_token_ids) for s in seqs], fused=True,
        )  # fmt: skip
        num_rows = len(seqs)
        self._last_tokens[:num_rows].copy_(tokens_M)
        self._last_seqs, self._last_rows = seqs, None  # rows by seq_id: built when a pending token needs them
        # One transfer for both: token ids (< 2^53) and fp32 logprobs are exact in float64.
        host = self._results_host[self._flip][: 2 * num_rows]
        host.copy_(torch.cat([tokens_M.to(torch.float64), logprobs_M.to(torch.float64)]), non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepHandle(seqs=seqs, host=host, event=event)

    def collect(self, handle: StepHandle) -> tuple[list[Sequence], list[int], list[float]]:
        """Wait for a launched step's results: (sampling sequences, next tokens, their logprobs)."""
        if not handle.seqs:
            return [], [], []
        if handle.event is not None:
            handle.event.synchronize()
        num_rows = len(handle.seqs)
        return handle.seqs, handle.host[:num_rows].long().tolist(), handle.host[num_rows:].tolist()

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

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        if self.enable_cuda_graph and not self._graphs:
            self.capture_cuda_graphs()  # first decode after invalidate_cuda_graphs()
        num_seqs = len(seqs)
        size = next(s for s in self.batch_sizes if s >= num_seqs)
        block_size = self.kv_cache.block_size
        positions = [s.num_computed_tokens for s in seqs]
        last_ids = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in seqs]
        host = self._staging_host[self._flip].numpy()
        host[0, :num_seqs] = last_ids
        host[1, :num_seqs] = positions
        host[2, :num_seqs] = [
            s.block_table[p // block_size] * block_size + p % block_size
            for s, p in zip(seqs, positions, strict=True)
        ]
        host[3, :num_seqs] = self.tables.rows_for(seqs)
        host[4, :num_seqs] = host[1, :num_seqs] + 1
        host[5, :num_seqs] = self._pending_sources(seqs, last_ids)
        self._write_padding(host, num_seqs)
        self._staging.copy_(self._staging_host[self._flip], non_blocking=True)
        if self.enable_cuda_graph:
            graph, logits = self._graphs[size]
            graph.replay()
        else:
            logits = self._decode_forward(size)
        return logits[:num_seqs]

    def _pending_sources(self, seqs: list[Sequence], last_ids: list[int]) -> list[int]:
        """Row of the previous launch's tokens for each PENDING_TOKEN input, -1 for known inputs."""
        if PENDING_TOKEN not in last_ids:
            return [-1] * len(seqs)
        if self._last_rows is None:
            self._last_rows = {seq.seq_id: i for i, seq in enumerate(self._last_seqs)}
        rows = self._last_rows
        return [rows[s.seq_id] if t == PENDING_TOKEN else -1 for s, t in zip(seqs, last_ids, strict=True)]

    def _write_padding(self, host: np.ndarray, num_seqs: int) -> None:
        """Rows num_seqs.. of a staging array: token 0 at position 0, K/V to the scratch slot, no context."""
        host[:, num_seqs:] = 0
        host[2, num_seqs:] = self.kv_cache.scratch_slot
        host[5, num_seqs:] = -1

    def _decode_forward(self, size: int) -> torch.Tensor:
        """Forward + LM head of the first `size` staging rows (what a CUDA graph of that size captures)."""
        input_ids, positions, slots, rows, ctx_lens, sources = self._staging[:, :size].unbind(0)
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

    def _prefill(self, batch: ScheduledBatch) -> torch.Tensor:
        block_size = self.kv_cache.block_size
        ids, sources, positions, slots, query_lens, ctx_lens, sample_rows = [], [], [], [], [], [], []
        num_tokens = 0
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            chunk = seq.token_ids(start, end)
            ids.extend(chunk)
            sources.extend([-1] * (num_new - 1) + self._pending_sources([seq], chunk[-1:]))
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
        parts = [ids, sources, np.concatenate(positions), np.concatenate(slots), self.tables.rows_for(batch.seqs),
                 ctx_lens, query_start, tile_seq, tile_first, sample_rows]  # fmt: skip
        ids_N, sources_N, positions_N, slots_N, rows, ctx, starts, t_seq, t_first, sample_M = _to_device(
            parts, self.device
        )
        self.attention.begin(
            TritonBatch(
                slot_mapping_N=slots_N, block_tables=self.tables.device_table.index_select(0, rows),
                ctx_lens=ctx, query_start=starts, tile_seq=t_seq, tile_first=t_first,
            )
        )  # fmt: skip
        hidden_ND = self._forward(self._resolve_pending(ids_N, sources_N), positions_N)
        return self.model.compute_logits(hidden_ND[sample_M])

    # -- shared -------------------------------------------------------------------------------------------

    def _forward(self, input_ids_N: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            from clawrl.engine.fused_forward import fused_forward

            return fused_forward(self.model, input_ids_N, positions_N, self.attention, self.kv_cache)
        return self.model(input_ids_N, positions_N, self.attention)


def _is_decode(batch: ScheduledBatch) -> bool:
    """Every scheduled sequence computes one token, its last (so it samples): the CUDA-graph case."""
    return all(n == 1 for n in batch.num_new_tokens) and all(
        seq.num_computed_tokens + 1 == seq.num_tokens for seq in batch.seqs
    )


def _to_device(parts: list, device: torch.device) -> list[torch.Tensor]:
    """Int64 device tensors of several host sequences through one host-to-device copy."""
    arrays = [np.asarray(p, dtype=np.int64) for p in parts]
    # non_blocking: a blocking copy would wait for all queued GPU work (the previous step, when overlapping).
    flat = torch.from_numpy(np.concatenate(arrays)).to(device, non_blocking=True)
    return list(flat.split([a.shape[0] for a in arrays]))
