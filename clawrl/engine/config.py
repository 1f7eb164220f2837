"""EngineConfig: how one built-in engine is sized and run (flag names follow SGLang's server args)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clawrl.models.config import ModelArgs

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class EngineConfig:
    """Settings of one engine; `__post_init__` rejects bad values naming the field."""

    model_path: str
    """HF model directory (config.json, safetensors, tokenizer files)."""
    device: str = "cpu"
    """Torch device the model and KV cache live on ("cpu", "cuda", "cuda:1")."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: float32 | bfloat16 | float16."""
    block_size: int = 16
    """Tokens per KV-cache block (the paging and prefix-cache granularity)."""
    num_kv_blocks: int | None = None
    """KV-cache blocks to allocate; None sizes the cache from mem_fraction_static (CUDA) or cpu_kv_cache_gib."""
    mem_fraction_static: float = 0.85
    """CUDA: fraction of the device's memory that weights + KV cache may take (SGLang's flag)."""
    cpu_kv_cache_gib: float = 0.25
    """CPU: KV-cache size in GiB when num_kv_blocks is None."""
    max_running_requests: int = 256
    """Most sequences decoding at once (each of a request's n samples counts)."""
    max_num_batched_tokens: int = 8192
    """Token budget per step: prefill chunks + decode tokens computed in one forward."""
    context_length: int | None = None
    """Longest prompt + output; None takes the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of earlier requests with the same token prefix (same weight version only)."""
    enable_cuda_graph: bool = True
    """CUDA: replay decode steps from CUDA graphs captured at start-up per batch size (ignored on CPU)."""
    fused_kernels: bool = True
    """CUDA: fused Triton norm / RoPE+KV-write / SiLU kernels in the forward (False: the model's torch ops;
    attention is Triton either way). Ignored on CPU."""
    enable_overlap_schedule: bool | None = None
    """Launch step t + 1 before step t's tokens are back, so scheduling and output processing on the CPU
    overlap the GPU's work (SGLang's overlap schedule; same tokens as without it). step() then returns each
    step's outputs one call later, and a sequence that stops computes one extra, discarded token. None (the
    default) means on for a CUDA device and off on CPU, where the reference runner computes a step as it is
    launched, so there is nothing to overlap (see `overlap_schedule`)."""
    attention_backend: str = "triton"
    """CUDA: "triton" runs the GPU runner (paged Triton kernels, CUDA graphs); "torch" runs the reference
    runner (plain torch attention and sampling, no graphs): slow, the first thing to try on a crash."""
    weights_cpu_backup: bool = True
    """CUDA: copy the weights to pinned host memory when they are released and back on resume, so the engine
    comes back with them. False skips both copies (colocated training: a weight sync refills the weights right
    after resume); the engine then refuses requests until a weight update has landed."""
    true_on_policy_mode: bool = False
    """Batch-invariant kernels (clawrl/models/batch_invariant.py) for the forward and the sampled tokens'
    logprobs, so a trainer in the same mode recomputes them bit for bit; CUDA (or the Triton interpreter),
    native dense models, tp_size 1."""
    seed: int = 0
    """Seed of the engine's generator that seeds requests which carry no seed of their own."""
    model_impl: str = "auto"
    """Model code: "native" (clawrl/models), "hf" (transformers' forward, runner/hf_runner.py: slower, any
    causal LM) or "auto" (native when clawrl implements the architecture, else hf)."""
    tp_size: int = 1
    """Tensor-parallel ranks (1, 2, 4 or 8; --rollout-num-gpus-per-engine): this process is rank 0 and starts
    the others (runner/cpu_runner.py); attention heads and MLP columns are split over them
    (clawrl/models/tp.py). CPU: gloo between processes; CUDA: NCCL, one GPU per rank, the reference runner."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"EngineConfig.model_path must be a directory path, got {self.model_path!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _positive("block_size", self.block_size)
        _positive("max_running_requests", self.max_running_requests)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.context_length is not None:
            _positive("context_length", self.context_length)
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"EngineConfig.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"EngineConfig.cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.attention_backend not in ("triton", "torch"):
            raise ValueError(
                f"EngineConfig.attention_backend must be 'triton' or 'torch', got {self.attention_backend!r}"
            )
        if self.tp_size not in (1, 2, 4, 8):
            raise ValueError(f"EngineConfig.tp_size must be 1, 2, 4 or 8, got {self.tp_size!r}")
        if self.model_impl not in ("auto", "native", "hf"):
            raise ValueError(
                f"EngineConfig.model_impl must be 'auto', 'native' or 'hf', got {self.model_impl!r}"
            )
        if self.true_on_policy_mode:
            _check_true_on_policy(self)
        if self.enable_overlap_schedule is not None and not isinstance(self.enable_overlap_schedule, bool):
            raise ValueError(
                f"EngineConfig.enable_overlap_schedule must be true, false or null (auto), "
                f"got {self.enable_overlap_schedule!r}"
            )

    @property
    def overlap_schedule(self) -> bool:
        """Whether the engine starts with the overlap schedule: enable_overlap_schedule, None = on for CUDA."""
        if self.enable_overlap_schedule is None:
            return self.device.startswith("cuda")
        return self.enable_overlap_schedule


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")


def _check_true_on_policy(config: EngineConfig) -> None:
    """The settings the batch-invariant engine path cannot serve, refused with the reason."""
    if config.tp_size != 1:
        raise ValueError(f"EngineConfig.true_on_policy_mode needs tp_size 1, got tp_size={config.tp_size}")
    if config.model_impl == "hf":
        raise ValueError("EngineConfig.true_on_policy_mode needs the native model code, got model_impl='hf'")
    if config.attention_backend != "triton":
        raise ValueError(
            f"EngineConfig.true_on_policy_mode runs its own Triton kernels, got attention_backend="
            f"{config.attention_backend!r} (use 'triton')"
        )
    if not config.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"EngineConfig.true_on_policy_mode needs a CUDA device, got device={config.device!r} (on CPU "
            f"its Triton kernels run only under the interpreter, TRITON_INTERPRET=1, for tests)"
        )


_SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "qkv_bias", "qk_norm")  # fmt: skip


def check_same_shapes(serving: ModelArgs, incoming: ModelArgs, model_path: str) -> None:
    """Refuse a checkpoint of another architecture before any running sequence is disturbed."""
    for name in _SHAPE_FIELDS:
        if getattr(serving, name) != getattr(incoming, name):
            raise ValueError(
                f"{model_path}/config.json: {name}={getattr(incoming, name)!r}, but the served model has "
                f"{name}={getattr(serving, name)!r}"
            )


def context_length_of(config: EngineConfig, max_positions: int) -> int:
    """The engine's context length: EngineConfig.context_length, at most the model's positions."""
    if config.context_length is not None and config.context_length > max_positions:
        raise ValueError(
            f"EngineConfig.context_length={config.context_length} exceeds max_position_embeddings={max_positions} "
            f"of {config.model_path}/config.json"
        )
    return config.context_length or max_positions
