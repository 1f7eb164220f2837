"""VarlenAttention: causal within each packed segment, nothing across segments, grouped-query heads.

The CPU path (per-segment SDPA) is checked against hand-computed numbers and a dense masked reference;
the CUDA FlashAttention path (bf16) against the CPU path, on a GPU only.
"""

from __future__ import annotations

import math

import pytest
import torch

from clawrl.models.attention import VarlenAttention

LENGTHS = [4, 1, 7, 3]


def random_qkv(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    shapes = [(n, num_heads, head_dim), (n, num_kv_heads, head_dim), (n, num_kv_heads, head_dim)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def dense_reference(q, k, v, lengths, scale):
    """Plain softmax(q k^T * scale + mask) v over the whole flat batch with a block-diagonal causal mask;
    kv head j serves query heads j*g .. (j+1)*g - 1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(q.shape[0])
    allowed = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def test_hand_computed_two_token_segment():
    """Segment [t0, t1], one head, scale 1: t1 scores [q.k0, q.k1] = [0, ln 3] -> weights [1/4, 3/4]."""
    q = torch.tensor([[[5.0, 5.0]], [[1.0, 0.0]]])
    k = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]])
    v = torch.tensor([[[4.0, 0.0]], [[0.0, 8.0]]])
    out = VarlenAttention.from_lengths([2]).forward(0, q, k, v, scale=1.0)
    assert torch.allclose(out, torch.tensor([[[4.0, 0.0]], [[1.0, 6.0]]]), atol=1e-6)


def test_single_token_segment_returns_its_value_per_kv_group():
    q, k, v = random_qkv()
    out = VarlenAttention.from_lengths(LENGTHS).forward(0, q, k, v, scale=0.3)
    t = LENGTHS[0]  # the one-token segment
    assert torch.allclose(out[t], v[t].repeat_interleave(2, dim=0), atol=1e-6)


def test_matches_dense_block_causal_reference_with_gqa():
    q, k, v = random_qkv(num_heads=6, num_kv_heads=2)
    out = VarlenAttention.from_lengths(LENGTHS).forward(3, q, k, v, scale=8**-0.5)
    assert torch.allclose(out, dense_reference(q, k, v, LENGTHS, 8**-0.5), atol=1e-6, rtol=1e-5)


def test_no_attention_across_segments_and_gradients_flow():
    q, k, v = (t.requires_grad_() for t in random_qkv())
    attn = VarlenAttention.from_lengths(LENGTHS)
    out = attn.forward(0, q, k, v, scale=0.5)
    first = LENGTHS[0]
    # Changing every later token leaves the first segment's outputs unchanged.
    q2, k2, v2 = (torch.cat([t[:first], torch.randn_like(t[first:])]) for t in (q, k, v))
    assert torch.equal(attn.forward(0, q2, k2, v2, scale=0.5)[:first], out[:first])
    out[:first].sum().backward()
    assert k.grad[:first].abs().sum() > 0 and k.grad[first:].abs().sum() == 0


def test_padding_after_last_segment_is_zero_and_bad_cu_seqlens_rejected():
    q, k, v = random_qkv()
    cu = torch.tensor([0, 4, 5, 12], dtype=torch.int32)  # 3 trailing tokens belong to no segment
    out = VarlenAttention(cu, 7).forward(0, q, k, v, scale=0.5)
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))
    assert torch.allclose(out[:12], dense_reference(q[:12], k[:12], v[:12], [4, 1, 7], 0.5), atol=1e-6)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
        VarlenAttention(torch.tensor([0.0, 3.0]), 3)


@pytest.mark.gpu
def test_cuda_flash_varlen_matches_cpu_path():
    q, k, v = (
        t.requires_grad_()
        for t in random_qkv(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda")
    )
    out = VarlenAttention.from_lengths(LENGTHS, device="cuda").forward(0, q, k, v, scale=0.125)
    expected = dense_reference(*(t.detach().float().cpu() for t in (q, k, v)), LENGTHS, 0.125)
    assert (out.float().cpu() - expected).abs().max() < 2e-2
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all() and k.grad.abs().sum() > 0
