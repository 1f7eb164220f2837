"""The paged KV cache and the attention over it.

KVCache: the paged K/V tensors, one pair per layer, each [num_blocks, block_size, Hkv, D].

Sizing: an explicit `num_kv_blocks`, or on CUDA what `mem_fraction_static` of the device's total memory
leaves after everything already in use (SGLang's meaning: weights + KV cache take that fraction; activations
and CUDA graphs live in the rest), or on CPU `cpu_kv_cache_gib`. `release()` gives the memory back (colocated
training needs it) and `resume()` takes it again with the same shape; the contents are lost (resume zeroes
them), so the prefix cache must be flushed by the caller. On CUDA with `stable=True` every layer's K and V
are views of one clawrl.cuda_memory.StableBuffer: release unmaps its physical memory and resume maps new
memory at the same addresses, so the tensors (and CUDA graphs that captured them) stay valid; otherwise
release drops the tensors and resume allocates new ones.

Each tensor holds one block more than `num_blocks`: a scratch block the block manager never hands out. The
GPU path pads a batch to a CUDA-graph size with dummy tokens whose K/V go to `scratch_slot`.

PagedAttention: the model's AttentionBackend over this cache (the reference path, cpu_runner.py).

Shapes: N = new tokens of the step (all sequences, flat), S = sequences, Hq / Hkv = query / key-value heads,
D = head_dim, C = a sequence's context (cached + new tokens).

Per layer: the step's new k/v are written into the cache at `slot_mapping` (slot = block * block_size +
offset), then each sequence's new queries attend causally to its whole context, gathered from the cache by
its slots. Query i of a sequence with n new tokens sits at position C - n + i and sees keys 0..C - n + i.
The math is torch's scaled_dot_product_attention, per sequence, in the model's dtype (fp32 on CPU); a
sequence computed from position 0 uses `is_causal=True`, the same call the trainer's varlen path makes.

`TritonPagedAttention` is the GPU backend (gpu_runner.py): no per-sequence loop, the Triton kernels of
triton_attention.py read K/V through device-side block tables — one decode kernel (a query per sequence,
CUDA-graph friendly: every layout tensor has the padded batch's fixed shape) or one prefill kernel (chunks
of new tokens after a cached prefix, decode tokens mixed in). Its `attend` is for the fused forward, which
has already written the step's K/V into the cache (triton_ops.rotary_cache_write); `forward` is the model's
AttentionBackend protocol and writes them itself first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from clawrl.cuda_memory import StableBuffer
    from clawrl.engine.config import EngineConfig
    from clawrl.models.config import ModelArgs

_GIB = 1 << 30


class KVCache:
    """Per-layer paged key and value tensors."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        stable: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)  # + the scratch block
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.buffer: StableBuffer | None = None
        """The one buffer behind every K and V tensor (CUDA, stable=True), else None."""
        if stable and self.device.type == "cuda":
            self._build_stable()
        else:
            self.resume()

    def _build_stable(self) -> None:
        from clawrl.cuda_memory import StableBuffer, aligned

        numel = 1
        for size in self.block_shape:
            numel *= size
        stride = aligned(numel * torch.empty((), dtype=self.dtype).element_size())
        self.buffer = StableBuffer(2 * self.num_layers * stride, self.device)
        views = [
            self.buffer.view(i * stride, self.block_shape, self.dtype) for i in range(2 * self.num_layers)
        ]
        self.k, self.v = views[: self.num_layers], views[self.num_layers :]
        self.buffer.tensor.zero_()

    @property
    def scratch_slot(self) -> int:
        """A slot outside every sequence's blocks (in the extra block): padding tokens write there."""
        return self.num_blocks * self.block_size

    @property
    def is_allocated(self) -> bool:
        """False between release() and resume()."""
        if self.buffer is not None:
            return self.buffer.is_mapped
        return bool(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes of every K and V tensor together (what release gives back)."""
        per_tensor = torch.empty((), dtype=self.dtype).element_size()
        for size in self.block_shape:
            per_tensor *= size
        return 2 * self.num_layers * per_tensor

    def resume(self) -> None:
        """Allocate the tensors (no-op when allocated). Contents start as zeros."""
        if self.is_allocated:
            return
        if self.buffer is not None:
            self.buffer.resume()
            # Attention reads whole blocks and masks the unused positions: stale bit patterns there could be
            # NaN, and 0 * NaN is NaN. Zeroing ~50 GB takes ~15 ms on an H200.
            self.buffer.tensor.zero_()
            return
        self.k = [
            torch.zeros(self.block_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        self.v = [
            torch.zeros(self.block_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        ]

    def release(self) -> None:
        """Free the tensors (and return CUDA memory to the device)."""
        if self.buffer is not None:
            self.buffer.release()
            return
        self.k, self.v = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def bytes_per_block(
    *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def plan_num_blocks(
    *,
    num_kv_blocks: int | None,
    device: torch.device,
    mem_fraction_static: float,
    cpu_kv_cache_gib: float,
    block_bytes: int,
) -> int:
    """How many blocks to allocate; raises ValueError naming the flag when nothing fits."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if device.type == "cuda":
        # SGLang's rule: everything in use on the device (our weights, other processes) counts against
        # the fraction; what is left of it becomes KV cache.
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - mem_fraction_static)
        flag = f"mem_fraction_static={mem_fraction_static}"
    else:
        budget = cpu_kv_cache_gib * _GIB
        flag = f"cpu_kv_cache_gib={cpu_kv_cache_gib}"
    num_blocks = int(budget // block_bytes) - 1  # one block of the budget is the scratch block
    if num_blocks < 1:
        raise ValueError(f"EngineConfig.{flag} leaves no room for a KV-cache block of {block_bytes} bytes")
    return num_blocks


def build_kv_cache(
    config: EngineConfig, args: ModelArgs, *, dtype: torch.dtype, device: torch.device, stable: bool = False
) -> KVCache:
    """The KV cache of `config` for a model of shape `args` (sized by plan_num_blocks; `stable`: see KVCache)."""
    shape = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    block_bytes = bytes_per_block(block_size=config.block_size, dtype=dtype, **shape)
    num_blocks = plan_num_blocks(
        num_kv_blocks=config.num_kv_blocks, device=device, block_bytes=block_bytes,
        mem_fraction_static=config.mem_fraction_static, cpu_kv_cache_gib=config.cpu_kv_cache_gib,
    )  # fmt: skip
    return KVCache(num_blocks=num_blocks, block_size=config.block_size, dtype=dtype, device=device,
                   stable=stable, **shape)  # fmt: skip


@dataclass(kw_only=True)
class PagedBatch:
    """Attention layout of one step, built once and used by every layer."""

    slot_mapping_N: torch.Tensor
    """Cache slot of each new token, LongTensor [N]."""
    query_bounds: list[int]
    """Start of each sequence's new tokens in the flat batch, plus N at the end: [S + 1]."""
    context_slots: list[torch.Tensor]
    """Per sequence, cache slots of its C context positions in order, LongTensor [C]."""
    masks: list[torch.Tensor | None]
    """Per sequence, bool [n, C] (True = may attend), or None when plain causal / a single query."""


def causal_offset_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor | None:
    """Bool [n, C] mask for n queries that are the last n of C positions; None if no mask is needed."""
    if num_queries == 1 or num_queries == num_keys:
        return None  # one query sees everything; n == C is the plain causal case (is_causal=True)
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(1)
    return torch.arange(num_keys, device=device).unsqueeze(0) <= query_pos


class PagedAttention:
    """AttentionBackend writing to and reading from a KVCache; call `begin(batch)` before each forward."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.batch: PagedBatch | None = None

    def begin(self, batch: PagedBatch) -> None:
        """Set the layout of the next forward."""
        self.batch = batch

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (post-RoPE) -> [N, Hq, D]."""
        batch = self.batch
        assert batch is not None, "PagedAttention.begin() must be called before the forward"
        k_cache = self.kv_cache.k[layer_idx].view(-1, k.shape[1], k.shape[2])
        v_cache = self.kv_cache.v[layer_idx].view(-1, v.shape[1], v.shape[2])
        # Every layer writes all new k/v before any sequence reads, so a sequence reading blocks another
        # sequence writes in this same step would still see them (the scheduler does not rely on it).
        k_cache.index_copy_(0, batch.slot_mapping_N, k.to(k_cache.dtype))
        v_cache.index_copy_(0, batch.slot_mapping_N, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        bounds = batch.query_bounds
        for s, slots in enumerate(batch.context_slots):
            start, end = bounds[s], bounds[s + 1]
            out[start:end] = _attend(q[start:end], k_cache[slots], v_cache[slots], scale, batch.masks[s])
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [n, Hq, D] against k/v [C, Hkv, D] -> [n, Hq, D]."""
    is_causal = mask is None and q.shape[0] > 1  # n == C from position 0
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


@dataclass(kw_only=True)
class TritonBatch:
    """Attention layout of one GPU step (device tensors, built once and used by every layer)."""

    slot_mapping_N: torch.Tensor
    """Cache slot of each new token, LongTensor [N] (padding rows: the cache's scratch slot)."""
    block_tables: torch.Tensor
    """Block ids of each sequence's positions, IntTensor [S, W] (W >= blocks of the longest context)."""
    ctx_lens: torch.Tensor
    """Context length of each sequence after this step (cached + new tokens), LongTensor [S]; 0 = padding."""
    query_start: torch.Tensor | None = None
    """Prefill only: start of each sequence's new tokens in the flat batch, plus N: LongTensor [S + 1]."""
    tile_seq: torch.Tensor | None = None
    """Prefill only: sequence of each tile of new tokens (triton_attention.plan_prefill_tiles), [tiles]."""
    tile_first: torch.Tensor | None = None
    """Prefill only: index of each tile's first new token within its sequence, [tiles]."""
    num_splits: int = 1
    """Decode only: split-K factor (triton_attention.decode_num_splits of the padded batch size)."""

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (the CUDA-graph case)."""
        return self.query_start is None


class TritonPagedAttention:
    """GPU AttentionBackend over a KVCache with the Triton kernels; call `begin(batch)` before each forward."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.batch: TritonBatch | None = None

    def begin(self, batch: TritonBatch) -> None:
        """Set the layout of the next forward."""
        self.batch = batch

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (post-RoPE) -> [N, Hq, D]; writes k/v into the cache first."""
        batch = self.batch
        assert batch is not None, "TritonPagedAttention.begin() must be called before the forward"
        k_cache = self.kv_cache.k[layer_idx].flatten(0, 1)
        v_cache = self.kv_cache.v[layer_idx].flatten(0, 1)
        k_cache.index_copy_(0, batch.slot_mapping_N, k.to(k_cache.dtype))
        v_cache.index_copy_(0, batch.slot_mapping_N, v.to(v_cache.dtype))
        return self.attend(layer_idx, q, scale)

    def attend(self, layer_idx: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [N, Hq, D] against the cache, whose K/V for this step are already written -> [N, Hq, D]."""
        from clawrl.engine.runner.triton_attention import paged_decode_attention, paged_prefill_attention

        batch = self.batch
        assert batch is not None, "TritonPagedAttention.begin() must be called before the forward"
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        if batch.is_decode:
            return paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.ctx_lens, scale, num_splits=batch.num_splits
            )
        return paged_prefill_attention(
            q, k_cache, v_cache, batch.block_tables, batch.query_start, batch.ctx_lens,
            batch.tile_seq, batch.tile_first, scale,
        )  # fmt: skip
