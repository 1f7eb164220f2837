"""Ragged per-sample layout shared by the algorithm modules.

A micro-batch of B samples stores per-token quantities flat: one 1-D tensor over the concatenation of the
samples' response tokens, in sample order. `response_lengths` (list[int] or LongTensor[B]) says where each
sample's tokens are. These helpers convert between that layout, per-sample values and a right-padded matrix.

Shapes: B = samples, N = sum(response_lengths) tokens, T = max(response_lengths).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def as_lengths(response_lengths: Sequence[int] | Tensor, num_tokens: int, device: torch.device) -> Tensor:
    """LongTensor[B] of response lengths on `device`, checked against the flat tensor's N."""
    lengths_cpu = torch.as_tensor(response_lengths, dtype=torch.long).cpu()
    if lengths_cpu.dim() != 1:
        raise ValueError(
            f"response_lengths must be 1-D (one length per sample), got shape {tuple(lengths_cpu.shape)}"
        )
    if bool((lengths_cpu < 0).any()):
        raise ValueError(f"response_lengths must be >= 0, got {lengths_cpu.tolist()}")
    total = int(lengths_cpu.sum())
    if total != num_tokens:
        raise ValueError(
            f"response_lengths sum to {total} but the per-token tensor has {num_tokens} entries "
            f"(lengths {lengths_cpu.tolist()})"
        )
    return lengths_cpu.to(device)


def sample_ids(lengths_B: Tensor, num_tokens: int) -> Tensor:
    """LongTensor[N]: which sample each flat token belongs to."""
    sample_range_B = torch.arange(lengths_B.numel(), device=lengths_B.device)
    # output_size avoids a device->host sync on GPU.
    return torch.repeat_interleave(sample_range_B, lengths_B, output_size=num_tokens)


def segment_sum(x_N: Tensor, lengths_B: Tensor) -> Tensor:
    """Per-sample sums [B] of a flat per-token tensor (differentiable in x_N)."""
    ids_N = sample_ids(lengths_B, x_N.numel())
    return x_N.new_zeros(lengths_B.numel()).index_add(0, ids_N, x_N)


def broadcast_to_tokens(x_B: Tensor, lengths_B: Tensor, num_tokens: int) -> Tensor:
    """Repeat each per-sample value over that sample's tokens -> [N]."""
    return x_B[sample_ids(lengths_B, num_tokens)]


def valid_positions(lengths_B: Tensor) -> Tensor:
    """BoolTensor[B, T]: True where position t < length of sample b."""
    max_len = int(lengths_B.max()) if lengths_B.numel() else 0
    positions_T = torch.arange(max_len, device=lengths_B.device)
    return positions_T[None, :] < lengths_B[:, None]


def pad_by_lengths(x_N: Tensor, lengths_B: Tensor) -> Tensor:
    """Right-pad a flat per-token tensor into [B, T] with zeros after each sample's end."""
    valid_BT = valid_positions(lengths_B)
    x_BT = x_N.new_zeros(valid_BT.shape)
    # Boolean-mask assignment fills row-major, i.e. in the flat layout's sample order.
    x_BT[valid_BT] = x_N
    return x_BT


def unpad(x_BT: Tensor, lengths_B: Tensor) -> Tensor:
    """Inverse of pad_by_lengths: [B, T] -> flat [N]."""
    return x_BT[valid_positions(lengths_B)]
