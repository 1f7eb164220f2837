"""KVCache: the paged K/V tensors, one pair per layer, each [num_blocks, block_size, Hkv, D].

Sizing: an explicit `num_kv_blocks`, or on CUDA what `mem_fraction_static` of the device's total memory
leaves after everything already in use (SGLang's meaning: weights + KV cache take that fraction; activations
and CUDA graphs live in the rest), or on CPU `cpu_kv_cache_gib`. `release()` drops the tensors (colocated
training needs the memory back) and `resume()` allocates them again with the same shape; the contents are
lost, so the prefix cache must be flushed by the caller.

Each tensor holds one block more than `num_blocks`: a scratch block the block manager never hands out. The
GPU path pads a batch to a CUDA-graph size with dummy tokens whose K/V go to `scratch_slot`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
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
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)  # + the scratch block
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.resume()

    @property
    def scratch_slot(self) -> int:
        """A slot outside every sequence's blocks (in the extra block): padding tokens write there."""
        return self.num_blocks * self.block_size

    @property
    def is_allocated(self) -> bool:
        """False between release() and resume()."""
        return bool(self.k)

    def resume(self) -> None:
        """Allocate the tensors (no-op when allocated). Contents start as zeros."""
        if self.is_allocated:
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
    config: EngineConfig, args: ModelArgs, *, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """The KV cache of `config` for a model of shape `args` (sized by plan_num_blocks)."""
    shape = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    block_bytes = bytes_per_block(block_size=config.block_size, dtype=dtype, **shape)
    num_blocks = plan_num_blocks(
        num_kv_blocks=config.num_kv_blocks, device=device, block_bytes=block_bytes,
        mem_fraction_static=config.mem_fraction_static, cpu_kv_cache_gib=config.cpu_kv_cache_gib,
    )  # fmt: skip
    return KVCache(num_blocks=num_blocks, block_size=config.block_size, dtype=dtype, device=device, **shape)
