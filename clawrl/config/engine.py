"""Engine flags: how the training job's built-in engines are sized and run (SGLang's server-arg names).

These are the switches a crash investigation reaches for first: turn CUDA graphs off, run attention through
the plain torch reference path, shrink the memory fraction or the context length. Unset values take the
defaults the placement implies (memory fraction 0.4 when colocated with the trainer, else 0.85; context =
--rollout-max-prompt-len + response budget, or the model's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clawrl.config.errors import at_least, check
from clawrl.config.fields import check_types


@dataclass(kw_only=True)
class EngineFlagsConfig:
    """Inference engines started by the job."""

    sglang_mem_fraction_static: float | None = None
    """GPU memory fraction for engine weights + KV cache; default: 0.4 with --colocate, else 0.85."""
    sglang_disable_cuda_graph: bool = False
    """Run decode steps eagerly instead of replaying CUDA graphs (slower; for crash debugging)."""
    sglang_context_length: int | None = None
    """Longest prompt + response an engine accepts; default: from --rollout-max-prompt-len, else the model's."""
    sglang_max_running_requests: int | None = None
    """Most sequences an engine decodes at once (default 256)."""
    sglang_disable_radix_cache: bool = False
    """Turn off prefix caching (KV reuse between requests with a common prefix)."""
    sglang_chunked_prefill_size: int | None = None
    """Most tokens one engine step computes (prefill chunks + decode tokens); default 8192."""
    sglang_page_size: int | None = None
    """Tokens per KV-cache block (paging and prefix-cache granularity); default 16."""
    sglang_max_total_tokens: int | None = None
    """KV-cache capacity in tokens (whole pages); default: from the memory fraction (GPU), 0.25 GiB (CPU)."""
    sglang_disable_overlap_schedule: bool = False
    """Schedule step t + 1 only after step t's tokens are back (GPU; the overlap is off on CPU anyway)."""
    attention_backend: Literal["triton", "torch"] = "triton"
    """Engine attention on GPU: triton (paged kernels) or torch (the reference path: slow, for debugging)."""

    def __post_init__(self) -> None:
        check_types(self)
        check(self, "sglang_mem_fraction_static", lambda v: 0.0 < v < 1.0, "must be in (0, 1)")
        at_least(self, "sglang_context_length", 1)
        at_least(self, "sglang_max_running_requests", 1)
        at_least(self, "sglang_chunked_prefill_size", 1)
        at_least(self, "sglang_page_size", 1)
        at_least(self, "sglang_max_total_tokens", 1)

    def sizing(self) -> dict[str, int | bool]:
        """The EngineConfig fields these flags set directly; flags left unset leave the engine's defaults.
        (--sglang-max-total-tokens becomes a block count where the engine's page size is known.)"""
        sizes = {
            "max_running_requests": self.sglang_max_running_requests,
            "max_num_batched_tokens": self.sglang_chunked_prefill_size,
            "block_size": self.sglang_page_size,
            "enable_overlap_schedule": False if self.sglang_disable_overlap_schedule else None,
        }
        return {name: value for name, value in sizes.items() if value is not None}


def engine_dtype(device: str) -> str:
    """The dtype engines run in, decided once: bfloat16 on CUDA, float32 on CPU (bf16 matmuls crawl there
    and fp32 keeps CPU runs bit-comparable with the trainer). The trainer converts weights to it before a
    sync and computes its checksums in it."""
    return "bfloat16" if device.startswith("cuda") else "float32"


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What an engine can release and resume (SGLang's tags for /release_memory_occupation)."""
CORE_MEMORY_TAGS = ("weights", "kv_cache")
"""The tags the engine core releases itself; "cuda_graph" belongs to the GPU runner's captured graphs."""
SYNC_MEMORY_TAGS = ("weights",)
"""Resumed before a weight sync in colocated runs: the weights only, so the trainer's gathered buckets
never share the GPU with a KV cache."""
GENERATION_MEMORY_TAGS = ("kv_cache", "cuda_graph")
"""Resumed after the sync: what generation needs. Every released tag must come back, or the engine holds
requests forever."""
