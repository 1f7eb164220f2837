"""Fused Triton kernels of the engine's GPU step: residual add + RMSNorm, RoPE + KV-cache write, SiLU-and-mul,
and the sampler (greedy / temperature) over the vocabulary, split into slices per row and merged.

Shapes: N = tokens, H = hidden size, I = MLP intermediate size, Hq / Hkv = query / KV heads, D = head_dim,
M = rows of logits, V = vocabulary.

Each kernel reproduces the rounding of the torch ops it replaces in `clawrl.models.layers` (transformers'
numerics), so the fused forward and the model's own forward agree to the bit in most elements:
- add_rmsnorm: the residual sum is rounded to the activation dtype, the statistics are fp32, the normalised
  value is rounded before it is multiplied by the weight (HF's `weight * x.to(input_dtype)`).
- rotary: cos/sin are rounded to the activation dtype and every product and sum is rounded like the eager
  `x1 * cos - x2 * sin` in that dtype (a no-op in fp32).
- silu_and_mul: silu(gate) is rounded before the product with up, as `F.silu(gate) * up` does.

The sampler's noise is the counter-based hash of clawrl.engine.runner.sampler (`lowbias32`), computed here in uint32
arithmetic; the torch version there is the reference it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps, hidden, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(dtype), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for x [N, H]; `residual` is updated in place.

    With residual None the sum is x itself (first layer): returns (rmsnorm(x) * weight, x).
    """
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    has_residual = residual is not None
    res = residual if has_residual else x
    assert x.stride(1) == 1 and res.stride(1) == 1 and weight.is_contiguous()
    if num_rows:
        _add_rmsnorm_kernel[(num_rows,)](
            x, res, weight, out, eps, hidden, x.stride(0), res.stride(0), out.stride(0),
            HAS_RESIDUAL=has_residual, BLOCK=triton.next_power_of_2(hidden), num_warps=4,
        )  # fmt: skip
    return out, res


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to the activation dtype and back: one rounding of an eager op in that dtype."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate(x_ptrs, mask, c, s, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) of the two halves at x_ptrs, eager rounding."""
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _round(_round(x1 * c, DTYPE) - _round(x2 * s, DTYPE), DTYPE)
    o2 = _round(_round(x2 * c, DTYPE) + _round(x1 * s, DTYPE), DTYPE)
    return o1, o2


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions, cos_ptr, sin_ptr, slots, k_cache, v_cache,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_slot, stride_ch,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + tok).to(tl.int64)
    slot = tl.load(slots + tok).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    h_mask = offs < HALF
    c = _round(tl.load(cos_ptr + pos * HALF + offs, mask=h_mask, other=0.0), DTYPE)
    s = _round(tl.load(sin_ptr + pos * HALF + offs, mask=h_mask, other=0.0), DTYPE)
    qh = tl.arange(0, HQ_PAD)
    q_mask = (qh < NUM_Q)[:, None] & h_mask[None, :]
    q_ptrs = q_ptr + tok * stride_qn + qh[:, None] * stride_qh + offs[None, :]
    o1, o2 = _rotate(q_ptrs, q_mask, c[None, :], s[None, :], HALF, DTYPE)
    tl.store(q_ptrs, o1.to(DTYPE), mask=q_mask)
    tl.store(q_ptrs + HALF, o2.to(DTYPE), mask=q_mask)
    kh = tl.arange(0, HKV_PAD)
    # The slot test as a vector: the interpreter rejects masks built with a scalar bool.
    kv_ok = (kh < NUM_KV) & ((tl.full([HKV_PAD], 0, tl.int64) + slot) >= 0)
    kv_mask = kv_ok[:, None] & h_mask[None, :]
    k_ptrs = k_ptr + tok * stride_kn + kh[:, None] * stride_kh + offs[None, :]
    o1, o2 = _rotate(k_ptrs, kv_mask, c[None, :], s[None, :], HALF, DTYPE)
    cache_offs = slot * stride_slot + kh[:, None] * stride_ch + offs[None, :]
    tl.store(k_cache + cache_offs, o1.to(DTYPE), mask=kv_mask)
    tl.store(k_cache + cache_offs + HALF, o2.to(DTYPE), mask=kv_mask)
    v_ptrs = v_ptr + tok * stride_vn + kh[:, None] * stride_vh + offs[None, :]
    tl.store(v_cache + cache_offs, tl.load(v_ptrs, mask=kv_mask, other=0.0), mask=kv_mask)
    tl.store(v_cache + cache_offs + HALF, tl.load(v_ptrs + HALF, mask=kv_mask, other=0.0), mask=kv_mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate q [N, Hq, D] in place; write rotated k and v [N, Hkv, D] into the caches at `slot_mapping`.

    q/k/v may be strided views of the fused qkv projection (last dim contiguous). cos/sin_cache are the
    model's fp32 tables [max_positions, D/2]; the caches are [num_blocks, block_size, Hkv, D], contiguous.
    A negative slot skips the cache write of that token.
    """
    num_tokens, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and head_dim % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos_cache.is_contiguous()
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype and cos_cache.dtype == torch.float32
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_cache_kernel[(num_tokens,)](
        q, k, v, positions, cos_cache, sin_cache, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_Q=num_q, NUM_KV=num_kv, HQ_PAD=triton.next_power_of_2(num_q), HKV_PAD=triton.next_power_of_2(num_kv),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), DTYPE=_TL_DTYPES[q.dtype], num_warps=4,
    )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] ([gate; up] as GatedMLP's gate_up_proj packs them) -> silu(gate) * up, [N, I]."""
    num_rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    assert gate_up.stride(1) == 1
    if num_rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


@triton.jit
def _mix32(x):
    """lowbias32 (uint32 -> uint32), the integer hash of clawrl.engine.runner.sampler."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_partial_kernel(
    logits_ptr, stride_l, rows_ptr, temps_ptr, keys_ptr, stats_ptr, index_ptr, vocab, split_len, num_splits,
    SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr, NEG_BIG: tl.constexpr,
):  # fmt: skip
    """Program (i, j): slice j (`split_len` tokens) of listed row i. Over the slice: the running max m and
    sum s of exp(scaled - m) of scaled = logits / T, and the best score (logits, or scaled + Gumbel noise if
    SAMPLE) with its token id, ties to the lowest id. Writes stats[i, :, j] = (m, s, best), index[i, j]."""
    item = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.load(rows_ptr + item).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    if SAMPLE:
        temperature = tl.load(temps_ptr + row)
        key = tl.load(keys_ptr + row).to(tl.uint32)
    else:
        temperature = 1.0
    m_run = tl.full((), NEG_BIG, tl.float32)
    s_run = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    first = split * split_len
    for chunk in range(0, split_len, BLOCK_V):
        start = first + chunk
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        scaled = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if SAMPLE:
            scaled = scaled / temperature
        m_new = tl.maximum(m_run, tl.max(scaled, 0))
        s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(scaled - m_new), 0)
        m_run = m_new
        if SAMPLE:
            bits = _mix32(key ^ offs.to(tl.uint32))
            uniform = ((bits >> 8) | 1).to(tl.float32) * (1.0 / 16777216.0)
            scores = tl.where(mask, scaled - tl.log(-tl.log(uniform)), float("-inf"))
        else:
            scores = scaled
        chunk_best = tl.max(scores, 0)
        chunk_idx = start + tl.argmax(scores, 0)
        best_idx = tl.where(chunk_best > best, chunk_idx, best_idx)  # strict: an equal later score loses
        best = tl.maximum(best, chunk_best)
    stats = stats_ptr + item.to(tl.int64) * 3 * num_splits + split
    tl.store(stats, m_run)
    tl.store(stats + num_splits, s_run)
    tl.store(stats + 2 * num_splits, best)
    tl.store(index_ptr + item.to(tl.int64) * num_splits + split, best_idx)


@triton.jit
def _sample_merge_kernel(
    logits_ptr, stride_l, rows_ptr, temps_ptr, stats_ptr, index_ptr, tokens_ptr, logprobs_ptr, vocab,
    num_splits, SAMPLE: tl.constexpr, SPLITS_PAD: tl.constexpr, NEG_BIG: tl.constexpr,
):  # fmt: skip
    """Program i: combine the slices of listed row i. The token is the best slice's (the lowest id on a tie),
    its logprob = scaled[token] - logsumexp(scaled), logsumexp = M + log(sum_j s_j exp(m_j - M)), M = max_j m_j."""
    item = tl.program_id(0)
    row = tl.load(rows_ptr + item).to(tl.int64)
    offs = tl.arange(0, SPLITS_PAD)
    mask = offs < num_splits
    stats = stats_ptr + item.to(tl.int64) * 3 * num_splits + offs
    m = tl.load(stats, mask=mask, other=NEG_BIG)
    s = tl.load(stats + num_splits, mask=mask, other=0.0)
    best = tl.load(stats + 2 * num_splits, mask=mask, other=float("-inf"))
    index = tl.load(index_ptr + item.to(tl.int64) * num_splits + offs, mask=mask, other=0)
    m_all = tl.max(m, 0)
    s_all = tl.sum(s * tl.exp(m - m_all), 0)
    # The lowest id among the slices that reach the best score (explicit, not argmax's tie rule). A row of
    # NaN matches no slice: token 0, as the one-program kernel gave, and no load past the row.
    token = tl.min(tl.where(mask & (best == tl.max(best, 0)), index, vocab), 0)
    token = tl.where(token < vocab, token, 0)
    if SAMPLE:
        temperature = tl.load(temps_ptr + row)
    else:
        temperature = 1.0
    chosen = tl.load(logits_ptr + row * stride_l + token).to(tl.float32) / temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - m_all - tl.log(s_all))


def sample_rows(
    logits_MV: torch.Tensor,
    rows: torch.Tensor,
    temperatures_M: torch.Tensor,
    keys_M: torch.Tensor,
    tokens_M: torch.Tensor,
    logprobs_M: torch.Tensor,
    *,
    sample: bool,
    block_v: int = 2048,
    split_len: int = 8192,
) -> None:
    """Fill tokens_M / logprobs_M at `rows`: greedy argmax (sample=False) or a Gumbel-max draw from
    softmax(logits / T) with the hash noise of `keys_M` (sample=True). logprob = log_softmax(logits / T)
    of the chosen token (T = 1 for greedy), fp32. Ties go to the lowest token id, like torch.argmax.

    Two launches: each row is cut into slices of `split_len` tokens (a multiple of `block_v`, the tokens a
    program loads at once), one program per (row, slice), so a batch of a few hundred 152k-token rows keeps
    every multiprocessor streaming; a second kernel merges each row's slices. Every token's score is computed
    by the same fp32 operations whatever the slicing, and the maximum is exact, so the sampled token does not
    depend on `block_v` / `split_len`; the logprob's sum of exponentials is only summed in another order."""
    assert logits_MV.stride(1) == 1 and split_len % block_v == 0
    num_items, vocab = rows.numel(), logits_MV.shape[1]
    if num_items == 0:
        return
    num_splits = triton.cdiv(vocab, split_len)
    stats = torch.empty(num_items, 3, num_splits, dtype=torch.float32, device=logits_MV.device)
    index = torch.empty(num_items, num_splits, dtype=torch.int32, device=logits_MV.device)
    _sample_partial_kernel[(num_items, num_splits)](
        logits_MV, logits_MV.stride(0), rows, temperatures_M, keys_M, stats, index, vocab, split_len, num_splits,
        SAMPLE=sample, BLOCK_V=block_v, NEG_BIG=-1.0e30, num_warps=8,
    )  # fmt: skip
    _sample_merge_kernel[(num_items,)](
        logits_MV, logits_MV.stride(0), rows, temperatures_M, stats, index, tokens_M, logprobs_M, vocab,
        num_splits, SAMPLE=sample, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), NEG_BIG=-1.0e30, num_warps=1,
    )  # fmt: skip
