"""Building blocks of the decoder: RMSNorm, rotary position embedding (with Llama-3 scaling), gated SiLU MLP.

Numerics follow `transformers` exactly, so that logits match it to float rounding:
- RMSNorm normalises in fp32 and casts back to the input dtype *before* multiplying by the weight.
- RoPE angles are `position * inv_freq` in fp32 (inv_freq computed on the CPU, as transformers does), cos/sin
  are cast to the activation dtype, and rotation is the non-interleaved "rotate_half" convention.

Training kernels: `enable_train_kernels(model)` switches the modules below (and the decoder's Attention) to
the fused Triton ops with autograd of clawrl/models/triton_train_ops.py, for tensors on CUDA only. It is off
by default, so the CPU path, the engine and every model that was not switched run the eager ops unchanged.

Shapes: N = tokens (flat, no batch dim), H = heads, D = head_dim.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TrainKernelSwitch:
    """Mixin of the modules that have fused Triton training kernels; see `enable_train_kernels`."""

    kernel_devices: frozenset[str] = frozenset()
    """Device types whose tensors take the kernels ("cuda"; "cpu" under the Triton interpreter); none by default."""

    def use_train_kernels(self, x: torch.Tensor) -> bool:
        return x.device.type in self.kernel_devices


def enable_train_kernels(model: nn.Module, devices: Iterable[str] = ("cuda",)) -> int:
    """Route `model`'s RMSNorm, SiLU-and-mul and RoPE through the fused Triton training kernels for tensors on
    these device types (`devices=()` switches back to eager). Returns the number of modules switched: 0 when
    triton is not installed, where the eager ops stay. "cpu" needs TRITON_INTERPRET=1 (tests only)."""
    kernel_devices = frozenset(devices)
    if "cpu" in kernel_devices and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"enable_train_kernels(devices={sorted(kernel_devices)}): Triton kernels run on CPU tensors only "
            f"under the Triton interpreter (TRITON_INTERPRET=1 before triton is imported); drop 'cpu'"
        )
    if kernel_devices and importlib.util.find_spec("triton") is None:
        return 0
    switched = [m for m in model.modules() if isinstance(m, TrainKernelSwitch)]
    for module in switched:
        module.kernel_devices = kernel_devices
    return len(switched)


@functools.cache
def _train_ops() -> ModuleType:
    # Imported on first use: triton stays unimported on the eager paths (and in the engine).
    from clawrl.models import triton_train_ops

    return triton_train_ops


class RMSNorm(TrainKernelSwitch, nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistics accumulated in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_train_kernels(x):
            return _train_ops().fused_rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [D/2] in fp32 on the CPU; Llama-3 scaling rescales the long wavelengths."""
    # Explicitly on the CPU (also under a `torch.device(...)` context): that is where transformers computes it.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 RoPE: wavelengths longer than the original context / low_freq_factor are divided by
    `factor`; shorter than context / high_freq_factor are kept; in between, a linear blend of the two."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    is_medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, D/2] (fp32, not saved), looked up by position id."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        if not self.cos_cache.is_meta:  # meta-built models compute them in to_empty (meta math costs ~1.5 s)
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the tables on the buffers' device, e.g. after `to_empty()` from the meta device."""
        device = self.cos_cache.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = positions[:, None] * inv_freq[None, :]
        self.cos_cache = angles.cos()
        self.sin_cache = angles.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [N, 1, D/2] (fp32; broadcast over heads)."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by angles cos/sin [N, 1, D/2]: HF's `x * cos + rotate_half(x) * sin`."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` on q [N, Hq, D] and k [N, Hkv, D]; fused=True runs the Triton training kernel."""
    if fused:
        return _train_ops().fused_rotary_qk(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class GatedMLP(TrainKernelSwitch, nn.Module):
    """down(silu(gate(x)) * up(x)); `fused` keeps gate and up in one matrix `gate_up_proj` ([gate; up])."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.use_train_kernels(gate):
            return self.down_proj(_train_ops().fused_silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)
