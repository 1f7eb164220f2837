"""Triton paged attention for the engine's GPU path: decode (one query per sequence) and prefill (chunks).

Shapes: S = sequences, N = new (query) tokens of the step, Hq / Hkv = query / key-value heads, G = Hq / Hkv
(the GQA group), D = head_dim, W = block-table width, P = block_size (tokens per KV page), NS = splits.

Both kernels read K/V straight out of the paged cache `[num_blocks, P, Hkv, D]` through each sequence's block
table (key position j lives in block `block_tables[s, j // P]`, row `j % P`), so nothing is gathered first.
One program owns one KV head and stacks the G query heads that share it as rows of one `tl.dot` operand:
K/V are read once per group, not once per query head. Scores, the running max / sum (online softmax in
base 2) and the output accumulator are fp32; K/V may be bf16, fp16 or fp32 (then dots run in IEEE fp32).

- decode: query s sits at position ctx_lens[s] - 1 and sees keys [0, ctx_lens[s]) (its own K/V were written
  before). With `num_splits` > 1 the keys are cut into NS chunks handled by separate programs (split-K, for
  small batches with long contexts); a second kernel merges their partial (max, sum, acc) triples.
- prefill: sequence s has q_len = query_start[s+1] - query_start[s] new tokens, the last q_len of its
  ctx_lens[s] positions; new token i (position ctx - q_len + i) sees keys [0, ctx - q_len + i]. It covers a
  fresh prompt, a chunk after a cached prefix, and decode tokens mixed into the same step. The step is cut
  into tiles of BLOCK_M tokens of one sequence (`plan_prefill_tiles`).

Sequences with ctx_lens 0 (CUDA-graph padding) produce zeros. `paged_attention_reference` is the exact torch
definition both kernels are tested against.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DECODE_BLOCK_N = 64  # keys per decode-loop iteration
DECODE_NUM_WARPS = 4
_NEG_BIG = -1.0e30  # finite "minus infinity" for running maxima: exp2(m_old - m_new) never sees inf - inf


@triton.jit
def _attend_keys(
    q, acc, m_i, l_i, k_cache, v_cache, table_ptr, kv_head, lo, hi, limit,
    stride_kb, stride_kt, stride_kh, qk_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Fold keys [lo, hi) into (acc, m_i, l_i); row r only sees keys < limit[r]. q: [ROWS, D_PAD]."""
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_mask = kpos < hi
        block = tl.load(table_ptr + kpos // PAGE, mask=k_mask, other=0).to(tl.int64)
        base = block * stride_kb + (kpos % PAGE) * stride_kt + kv_head * stride_kh
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(kpos[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v_cache.dtype.element_ty)
        if DOT_FP32:
            v = v.to(tl.float32)
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_cache, v_cache, tables, ctx_lens, out_ptr, part_acc, part_ml, qk_scale, num_splits,
    stride_qn, stride_qh, stride_on, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
    NEG_BIG: tl.constexpr,
):  # fmt: skip
    """Grid (S, Hkv, NS): the G query heads of one KV head of one sequence, over one split of its keys."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens + seq).to(tl.int32)
    rows = tl.arange(0, ROWS)
    heads = kv_head * GROUP + rows
    offs_d = tl.arange(0, D_PAD)
    io_mask = (rows < GROUP)[:, None] & (offs_d < D)[None, :]
    q = tl.load(
        q_ptr + seq * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    # No tl.cdiv / tl.zeros here: they are @jit library functions, which the interpreter cannot call when
    # triton was imported before TRITON_INTERPRET was set (as in a full pytest run); core ops are patched.
    per_split = (ctx + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx)
    limit = tl.full([ROWS], 0, tl.int32) + ctx
    acc = tl.full([ROWS, D_PAD], 0, tl.float32)
    m_i = tl.full([ROWS], 0, tl.float32) + NEG_BIG
    l_i = tl.full([ROWS], 0, tl.float32)
    acc, m_i, l_i = _attend_keys(
        q, acc, m_i, l_i, k_cache, v_cache, tables + seq.to(tl.int64) * stride_bt, kv_head, lo, hi, limit,
        stride_kb, stride_kt, stride_kh, qk_scale, D, D_PAD, BLOCK_N, PAGE, PRECISION, DOT_FP32,
    )  # fmt: skip
    if SPLIT:
        # Partials laid out [S, Hq, NS, (D | 2)]: unnormalised acc, and (max, sum) in the base-2 domain.
        row_id = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_acc + row_id[:, None] * D_PAD + offs_d[None, :], acc, mask=(rows < GROUP)[:, None])
        tl.store(part_ml + row_id * 2, m_i, mask=rows < GROUP)
        tl.store(part_ml + row_id * 2 + 1, l_i, mask=rows < GROUP)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + seq * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc, part_ml, out_ptr, num_heads, stride_on, stride_oh,
    NS: tl.constexpr, NS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Grid (S, Hq): merge the NS partial softmax states of one (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NS_PAD)
    s_mask = splits < NS
    row = (seq * num_heads + head) * NS + splits
    m = tl.load(part_ml + row * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
    total = tl.sum(l_s * weight, 0)
    offs_d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq * stride_on + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache, v_cache, tables, query_start, ctx_lens, tile_seq, tile_first, out_ptr, qk_scale,
    stride_qn, stride_qh, stride_on, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, NEG_BIG: tl.constexpr,
):  # fmt: skip
    """Grid (tiles, Hkv): BLOCK_M new tokens of one sequence x the G query heads of one KV head."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq + tile).to(tl.int32)
    first = tl.load(tile_first + tile).to(tl.int32)
    q_begin = tl.load(query_start + seq).to(tl.int32)
    q_len = tl.load(query_start + seq + 1).to(tl.int32) - q_begin
    ctx = tl.load(ctx_lens + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, D_PAD)
    io_mask = row_ok[:, None] & (offs_d < D)[None, :]
    q_rows = (q_begin + token).to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    limit = tl.where(row_ok, ctx - q_len + token + 1, 0)
    hi = tl.minimum(ctx, ctx - q_len + first + BLOCK_M)
    acc = tl.full([BLOCK_M * GROUP_PAD, D_PAD], 0, tl.float32)
    m_i = tl.full([BLOCK_M * GROUP_PAD], 0, tl.float32) + NEG_BIG
    l_i = tl.full([BLOCK_M * GROUP_PAD], 0, tl.float32)
    acc, m_i, l_i = _attend_keys(
        q, acc, m_i, l_i, k_cache, v_cache, tables + seq.to(tl.int64) * stride_bt, kv_head, 0, hi, limit,
        stride_kb, stride_kt, stride_kh, qk_scale, D, D_PAD, BLOCK_N, PAGE, PRECISION, DOT_FP32,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = (q_begin + token).to(tl.int64) * stride_on + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _padded(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16


def _dot_options(dtype: torch.dtype) -> dict:
    """PRECISION: fp32 K/V (parity runs) get exact IEEE products; bf16/fp16 use the tensor cores as they are.
    DOT_FP32: the Triton interpreter (CPU tests) multiplies the raw bits of bf16 tl.dot operands (Triton
    3.9), so there the operands are upcast first; bf16 x bf16 products are exact in fp32, so only the
    summation order differs from the compiled kernel."""
    dot_fp32 = _INTERPRETED and dtype != torch.float32
    return {"PRECISION": "ieee" if dtype == torch.float32 or dot_fp32 else "tf32", "DOT_FP32": dot_fp32}


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1, "head_dim must be contiguous"
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
    assert q.dtype == k_cache.dtype == v_cache.dtype


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits of the context per (sequence, KV head) so that small batches still fill the GPU's `num_sms`
    multiprocessors (about two programs each; an H200 has 132).

    Depends only on the (padded) batch size, never on context lengths, so a CUDA graph captured for a batch
    size computes exactly what the eager path computes for it.
    """
    target_programs = 2 * num_sms
    programs = num_seqs * num_kv_heads
    if programs >= target_programs // 2:
        return 1
    return min(16, 1 << math.ceil(math.log2(target_programs / programs)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    block_n: int = DECODE_BLOCK_N,
    num_warps: int = DECODE_NUM_WARPS,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) -> [S, Hq, D] over the paged cache (module docstring).

    `block_n` keys per loop iteration and `num_warps` are tuning knobs (bench/engine_throughput.py --check
    times a few); the defaults are what the engine uses."""
    _check_cache(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    d_pad = _padded(head_dim)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_seqs * num_heads * num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs * num_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused by the kernel when SPLIT is False
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, part_acc, part_ml, scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), D=head_dim, D_PAD=d_pad,
        BLOCK_N=block_n, PAGE=page, **_dot_options(q.dtype), SPLIT=split, NEG_BIG=_NEG_BIG,
        num_warps=num_warps,
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, num_heads, out.stride(0), out.stride(1),
            NS=num_splits, NS_PAD=max(2, triton.next_power_of_2(num_splits)), D=head_dim, D_PAD=d_pad,
            num_warps=1,
        )  # fmt: skip
    return out


def prefill_block_m(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per prefill tile: ~128 rows of (token, query head) per program."""
    return max(1, 128 // triton.next_power_of_2(num_heads // num_kv_heads))


def plan_prefill_tiles(query_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first new token) of every tile of `block_m` new tokens, in order."""
    tile_seq, tile_first = [], []
    for seq, q_len in enumerate(query_lens):
        for first in range(0, q_len, block_m):
            tile_seq.append(seq)
            tile_first.append(first)
    return tile_seq, tile_first


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    ctx_lens: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_first: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] (each sequence's new tokens back to back) -> [N, Hq, D] (module docstring).

    `tile_seq` / `tile_first` come from `plan_prefill_tiles(query_lens, prefill_block_m(Hq, Hkv))`.
    """
    _check_cache(q, k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return out
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start, ctx_lens, tile_seq, tile_first, out, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_M=prefill_block_m(num_heads, num_kv_heads),
        D=head_dim, D_PAD=_padded(head_dim), BLOCK_N=64, PAGE=page,
        **_dot_options(q.dtype), NEG_BIG=_NEG_BIG, num_warps=4,
    )  # fmt: skip
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: list[int],
    ctx_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The definition, in fp32 torch: each sequence's new queries vs its cached keys, causally offset."""
    page = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, ctx in enumerate(ctx_lens):
        begin, end = query_start[s], query_start[s + 1]
        if ctx == 0 or end == begin:
            continue
        positions = torch.arange(ctx, device=q.device)
        slots = block_tables[s].long()[positions // page] * page + positions % page
        keys = k_cache.flatten(0, 1)[slots].float()  # [C, Hkv, D]
        values = v_cache.flatten(0, 1)[slots].float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,chd->hnc", q[begin:end].float(), keys) * scale
        query_pos = torch.arange(ctx - (end - begin), ctx, device=q.device)
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[begin:end] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), values)
    return out
