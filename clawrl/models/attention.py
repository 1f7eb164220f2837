"""The execution-mode seam: the decoder hands post-RoPE q/k/v to an AttentionBackend and gets the output.

The model knows nothing about how attention runs. The trainer passes a `VarlenAttention` (causal attention
inside each packed sequence, none across sequences); the engine passes its own backend that also writes
k/v into a paged KV cache and reads the cached prefix.

Shapes: N = tokens of the flat packed batch, Hq / Hkv = query / key-value heads, D = head_dim,
B = packed sequences; `cu_seqlens` [B+1] holds segment boundaries (0, len0, len0+len1, ..., N).

    attn = VarlenAttention.from_lengths([5, 3, 9], device="cpu")
    hidden = model(input_ids, positions, attn)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    """How one attention layer is executed (varlen for training, paged KV cache for the engine)."""

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (post-RoPE) -> attention output [N, Hq, D]."""
        ...


class VarlenAttention:
    """Causal attention within each packed segment of a flat batch; grouped-query heads supported.

    CUDA + fp16/bf16: one `torch.nn.attention.varlen.varlen_attn` (FlashAttention) call per layer.
    Otherwise (CPU, fp32, older torch): exact per-segment `scaled_dot_product_attention(is_causal=True)`.
    Tokens after `cu_seqlens[-1]` (padding) get zeros on the per-segment path.
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [B+1] starting at 0, got shape "
                f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
            )
        if max_seqlen <= 0:
            raise ValueError(f"max_seqlen={max_seqlen} must be > 0")
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = int(max_seqlen)
        self._host_bounds: list[int] | None = None  # filled once per batch, not once per layer
        self._device_cu_seqlens: torch.Tensor | None = None
        self.derived: dict = {}
        """Per-batch values other kernels derive from cu_seqlens, kept here once per forward, not per layer
        (the batch-invariant attention's query blocks)."""

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu") -> VarlenAttention:
        """Backend for segments of the given lengths laid out back to back."""
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + int(n))
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
        return cls(cu_seqlens, max(max(lengths, default=1), 1))

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if _flash_varlen_usable(q):
            return self._flash_forward(q, k, v, scale)
        return self._segment_forward(q, k, v, scale)

    def _segment_forward(self, q, k, v, scale) -> torch.Tensor:
        if self._host_bounds is None:
            self._host_bounds = [int(b) for b in self.cu_seqlens.tolist()]
        bounds = self._host_bounds
        outs = [
            causal_sdpa(q[start:end], k[start:end], v[start:end], scale)
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
            if end > start
        ]
        if bounds[-1] < q.shape[0]:
            outs.append(q.new_zeros((q.shape[0] - bounds[-1], *q.shape[1:])))
        return torch.cat(outs) if outs else torch.zeros_like(q)

    def _flash_forward(self, q, k, v, scale) -> torch.Tensor:
        # UNTESTED ON GPU in this repository's CPU CI: see tests/unit/test_models_attention.py (gpu marker).
        from torch.nn.attention.varlen import varlen_attn

        if self._device_cu_seqlens is None:
            self._device_cu_seqlens = self.cu_seqlens.to(device=q.device, dtype=torch.int32)
        cu = self._device_cu_seqlens
        params = _varlen_params()
        kwargs: dict = {}
        # torch 2.10 spells causality `is_causal=True`; later releases use `window_size=(-1, 0)`.
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # the kernel then uses 1/sqrt(D); fold any other scale into q
            q = q * (scale * q.shape[-1] ** 0.5)
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:  # expand kv heads like transformers' repeat_kv: kv head j serves q heads j*g..(j+1)*g-1
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen_attn(
            q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, self.max_seqlen, self.max_seqlen, **kwargs
        )


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over one sequence: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def _flash_varlen_usable(q: torch.Tensor) -> bool:
    """FlashAttention varlen needs CUDA, fp16/bf16, head_dim a multiple of 8 up to 256, torch >= 2.10."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and bool(_varlen_params())
    )


@functools.cache
def _varlen_params() -> frozenset[str]:
    """Keyword names of this torch's `varlen_attn` (its signature changed between releases); empty if absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)
