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
    attention_backend: Literal["triton", "torch"] = "triton"
    """Engine attention on GPU: triton (paged kernels) or torch (the reference path: slow, for debugging)."""

    def __post_init__(self) -> None:
        check_types(self)
        check(self, "sglang_mem_fraction_static", lambda v: 0.0 < v < 1.0, "must be in (0, 1)")
        at_least(self, "sglang_context_length", 1)
        at_least(self, "sglang_max_running_requests", 1)
