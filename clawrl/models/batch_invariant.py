"""Batch-invariant Triton kernels for `--true-on-policy-mode`: the engine's sampled-token log-probs and the
trainer's recomputed ones come out of the same kernels in the same order, so they are equal bit for bit.

Why ordinary kernels differ: cuBLAS picks its tiling and split-K by the matrix shape, FlashAttention splits
long contexts for small batches, and a softmax reduces in an order that depends on the launch. The engine
computes a token in a decode batch of 1..256 rows against a paged KV cache; the trainer computes the same
token inside an 8k-token packed micro-batch. Every kernel here fixes its reduction order by the shapes the
two sides share (K, head_dim, vocab, context position) and never by the row count:

    y = linear(x, weight, bias)            # x [M, K] @ weight[N, K]^T (+ bias) -> [M, N] x.dtype; K in
                                           # fixed 2048-element chunks, each summed from 0 in fp32, the
                                           # chunk sums added in order (split over programs or not)
    y = rms_norm(x, weight, eps)           # one program per row; RMSNorm's numerics (layers.py)
    lp = log_probs_of(logits, tokens, t)   # log_softmax(logits.float() / t)[token], one program per row,
                                           # online max / sum over fixed vocab chunks
    o = varlen_attention(q, k, v, cu_seqlens, scale)      # the trainer's packed sequences
    PagedBatchInvariantAttention(kv_cache)                # the engine's paged cache, the same kernel

Attention: each query row (one query token, one query head) attends over its sequence's keys 0..p (p =
the query's position) in chunks of BLOCK_N positions starting at 0, online softmax in fp32, no split over
the keys. Keys are found through an index (paged: row = block_table[s, p // page] * page + p % page;
packed: row = cu_seqlens[s] + p), so the arithmetic is the same whichever side calls it. A program takes a
tile of ATTENTION_ROWS rows: the query heads of one KV head for one token (decode; prefill and the
trainer's packed forward too while PREFILL_QUERY_BLOCKS is off), or for up to ATTENTION_ROWS // (Hq / Hkv)
consecutive tokens of one sequence (2 tokens for Qwen2.5's 7 or 6 heads per KV head). Chunks past a row's own position are masked out for it, and
a fully masked chunk leaves its softmax state unchanged bit for bit, so a row's result does not depend on
which tokens share its program.

Assumption of `linear` (the GPU test tests/gpu/test_true_on_policy.py checks it): an output element's value
depends only on its row of x and its row of the weight, not on which row or column block it falls in nor on
the tile shape. That is what lets the engine's packed qkv_proj / gate_up_proj give the same numbers as the
trainer's separate q/k/v and gate/up layers, and lets a decode batch of 256 rows take other tiles than the
trainer's 8k-token micro-batch (linear_tiles; bench/batch_invariant_linear.py times the choices). It holds
for tl.dot on tensor cores, where each output element is its own fp32 accumulator fed the same k16 slices
in the same order whatever BLOCK_M, BLOCK_N and BLOCK_K are (measured on the H200 for every config the
benchmark times, BLOCK_M >= 64).

`enable_batch_invariant(model)` switches a native CausalLM to these kernels (its Linear layers including the
LM head, its RMSNorms and its attention), and RoPE and SiLU * up to the fused elementwise kernels of
clawrl/models/triton_train_ops.py on every side (elementwise, so invariant; one kernel each instead of the
eager chains' ~10 small launches per layer, which cost a decode step ~0.8 ms at 0.5B). The engine and the
trainer both call it, so both run the same code. Gradients: forward = the kernel, backward = plain torch
or the fused kernels' own (gradients need not be invariant).

Split-K: a decode batch's down_proj (few columns, long K) has fewer tiles than the GPU has SMs. Its K
chunks then run on separate programs, each writing its fp32 chunk sum, and a reduce kernel adds them in
chunk order (linear_splits). The one-program path adds the same chunk sums in the same order, so the
split changes the speed only, never a bit: the order depends on K alone.

Cost: no split-KV leaves small decode batches' attention with fewer programs than SMs, and prefill's
attention re-reads keys per query token (per block of tokens with PREFILL_QUERY_BLOCKS); logits are bf16 (the engine's) instead of the trainer's fp32.

On CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1, tests); there every dot is
an explicit fp32 multiply-and-sum in k order (_sum_dot), not numpy's matmul (bf16 operands would be
multiplied as raw bits, and fp32 rows get bits that depend on their place in the tile on some CPUs).

Shapes: M = rows, K = input features, N = output features, V = vocab, T = tokens, Hq / Hkv = query / KV
heads, D = head_dim, S = sequences.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from clawrl.models.attention import VarlenAttention
from clawrl.models.cublas_rows import choose_kernels, cublas_linear, kernel_linear, needs_autograd
from clawrl.models.layers import RMSNorm, enable_train_kernels
from clawrl.models.triton_train_ops import sm_count

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_NEG_BIG = -1.0e30  # finite "minus infinity" for running maxima: never inf - inf
_LOG2E = 1.4426950408889634
# The interpreter gets small tiles so that the CPU tests cross tile boundaries with tiny shapes (one config:
# its dot is a numpy matmul, whose order may follow the tile).


class LinearTiles(NamedTuple):
    """The linear kernel's launch config (bench/batch_invariant_linear.py times the alternatives)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


if _INTERPRETED:
    LINEAR_TILES_DECODE = LINEAR_TILES_NARROW = LINEAR_TILES_LARGE = LinearTiles(16, 32, 16, 4, 3)
else:  # the fastest configs of the 0.5B / 1.5B decode batches and of 8k-row micro-batches (CUDA graphs)
    LINEAR_TILES_DECODE, LINEAR_TILES_LARGE = LinearTiles(64, 64, 64, 4, 4), LinearTiles(128, 256, 64, 8, 3)
    LINEAR_TILES_NARROW = LinearTiles(64, 32, 64, 4, 4)
LINEAR_LARGE_ROWS = 512
"""Row counts above this take LINEAR_TILES_LARGE (prefill chunks, the trainer's micro-batches); below, a
grid of LINEAR_TILES_DECODE smaller than the SM count (a down_proj: few columns, long K) takes the narrow
tiles, twice the programs."""


def linear_tiles(num_rows: int, num_cols: int, device: torch.device) -> LinearTiles:
    """The tiles linear_forward takes for an [num_rows, K] @ [num_cols, K]^T product on `device`."""
    if num_rows > LINEAR_LARGE_ROWS:
        return LINEAR_TILES_LARGE
    tiles = LINEAR_TILES_DECODE
    if device.type == "cuda" and (
        triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(num_cols, tiles.block_n)
        < sm_count(device.index or 0)
    ):
        return LINEAR_TILES_NARROW
    return tiles


LINEAR_CHUNK_K = 32 if _INTERPRETED else 2048
"""K is summed in chunks of this many elements on every side (engine, trainer, any row count), each chunk
from 0 and the chunk sums added in order: a split-K over these chunks then keeps every bit. K <= one chunk
(every linear of the 0.5B and 1.5B shapes but the down_proj) is the plain sum."""
LINEAR_REDUCE_BLOCK = (16, 32) if _INTERPRETED else (32, 128)
LINEAR_INTERPRETED_CORES = 4  # the interpreter's stand-in for the SM count: small grids split there too
LOGPROB_BLOCK_V = 512 if _INTERPRETED else 4096
ATTENTION_BLOCK_N = 8 if _INTERPRETED else 64
# Where the switched model's RoPE / SiLU-and-mul take the fused kernels: wherever Triton runs.
_ELEMENTWISE_DEVICES = frozenset({"cuda", "cpu"} if _INTERPRETED else {"cuda"})


def _dot_options(dtype: torch.dtype) -> dict:
    """fp32 operands: exact IEEE products; bf16/fp16: tensor cores. Under the interpreter every dot is
    _sum_dot (DOT_FP32): tl.dot there is numpy's matmul, whose bits for a row can depend on the row's place
    in the tile (on an AMD EPYC, rows 6-15 of a 16 x 16 fp32 block differ from the same row at 0-5)."""
    return {
        "PRECISION": "ieee" if dtype == torch.float32 or _INTERPRETED else "tf32",
        "DOT_FP32": _INTERPRETED,
    }


@triton.jit
def _sum_dot(a, b):
    """a [M, K] @ b [K, N] as fp32 products summed over k in order (the interpreter's dot: numpy reduces a
    middle axis one k slice after another, the same for every row)."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


# ------------------------------------------------------------------------------------------------- linear
@triton.jit
def _linear_chunk(x_ptr, w_ptr, rm, rn, M, N, k_start, k_end, stride_xm, stride_wn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """The fp32 sum over k in [k_start, k_end) of one BLOCK_M x BLOCK_N tile, from 0, in BLOCK_K steps."""
    rk = tl.arange(0, BLOCK_K)
    part = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + rk) < k_end
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :],
                    mask=(rm < M)[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :],
                    mask=(rn < N)[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            part += _sum_dot(x, tl.trans(w))
        else:
            part = tl.dot(x, tl.trans(w), part, input_precision=PRECISION)
    return part


@triton.jit(do_not_specialize=["M", "N", "stride_om"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ONE_CHUNK: tl.constexpr, CHUNK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """K in chunks of CHUNK_K, each summed from 0 in its own fp32 accumulator.

    SPLIT False, grid (M tiles, N tiles): the chunk sums are added in order (0 + c0 + c1 + ...), then the
    bias, and the tile is stored in out's dtype. SPLIT True, grid (M tiles, N tiles, chunks): program
    (i, j, c) stores chunk c's fp32 sum at out[c] of a [chunks, M, N] workspace; _linear_reduce_kernel adds
    them in the same order. Either way an element's bits follow from K alone, not from the split."""
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        k_start = tl.program_id(2) * CHUNK_K
        part = _linear_chunk(x_ptr, w_ptr, rm, rn, M, N, k_start, tl.minimum(k_start + CHUNK_K, K),
                             stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, DOT_FP32)  # fmt: skip
        chunk_base = tl.program_id(2).to(tl.int64) * M * N
        tl.store(out_ptr + chunk_base + rm[:, None] * N + rn[None, :], part, mask=mask)
    else:
        # K <= CHUNK_K: the plain loop, without the chunk loop around it (that loop slows large tiles)
        if ONE_CHUNK:
            acc = _linear_chunk(x_ptr, w_ptr, rm, rn, M, N, 0, K, stride_xm, stride_wn,
                                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, DOT_FP32)  # fmt: skip
        else:
            acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
            for k_start in range(0, K, CHUNK_K):
                acc += _linear_chunk(x_ptr, w_ptr, rm, rn, M, N, k_start, tl.minimum(k_start + CHUNK_K, K),
                                     stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, DOT_FP32)  # fmt: skip
        _add_bias_and_store(acc, b_ptr, out_ptr, rm, rn, N, mask, stride_om, HAS_BIAS)


@triton.jit
def _add_bias_and_store(acc, b_ptr, out_ptr, rm, rn, N, mask, stride_om, HAS_BIAS: tl.constexpr):
    """The fp32 tile + bias (in fp32), stored in out's dtype: the linear's last step on either path."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "N", "num_chunks", "stride_om"])
def _linear_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, num_chunks, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out = ((0 + part[0]) + part[1] + ...) + bias, in fp32, then out's dtype: _linear_kernel's order."""
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    for c in range(0, num_chunks):
        acc += tl.load(part_ptr + c * M * N + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
    _add_bias_and_store(acc, b_ptr, out_ptr, rm, rn, N, mask, stride_om, HAS_BIAS)


def linear_splits(num_rows: int, num_cols: int, k_dim: int, tiles: LinearTiles, device: torch.device) -> int:
    """K chunks spread over programs: all of them when the tile grid alone has fewer programs than the SMs
    (a decode batch's down_proj: few columns, long K), else 1 (one program sums every chunk in turn)."""
    chunks = triton.cdiv(k_dim, LINEAR_CHUNK_K)
    if chunks == 1:
        return 1
    programs = triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(num_cols, tiles.block_n)
    cores = sm_count(device.index or 0) if device.type == "cuda" else LINEAR_INTERPRETED_CORES
    return chunks if programs < cores else 1


def linear_forward(
    x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, tiles: LinearTiles | None = None,
    *, split: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """The kernel without autograd: [M, K] @ [N, K]^T (+ bias in the fp32 accumulator) -> [M, N] x.dtype.
    `tiles` and `split` (benchmarks, tests) override linear_tiles' and linear_splits' choices by shape;
    neither changes a bit of the result."""
    if x_MK.dtype != weight_NK.dtype:
        raise ValueError(f"batch-invariant linear: input {x_MK.dtype} and weight {weight_NK.dtype} differ")
    x_MK, weight_NK = x_MK.contiguous(), weight_NK.contiguous()
    (num_rows, k_dim), num_cols = x_MK.shape, weight_NK.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x_MK.dtype, device=x_MK.device)
    if num_rows == 0:
        return out
    if tiles is None:
        tiles = linear_tiles(num_rows, num_cols, x_MK.device)
    chunks = triton.cdiv(k_dim, LINEAR_CHUNK_K)
    if split is None:
        chunks = linear_splits(num_rows, num_cols, k_dim, tiles, x_MK.device)
    elif not split:
        chunks = 1
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(num_cols, tiles.block_n))
    bias = bias_N if bias_N is not None else weight_NK  # a pointer the kernel never reads without HAS_BIAS
    common = dict(HAS_BIAS=bias_N is not None, ONE_CHUNK=k_dim <= LINEAR_CHUNK_K, CHUNK_K=LINEAR_CHUNK_K, BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **_dot_options(x_MK.dtype),
                  num_warps=tiles.warps, num_stages=tiles.stages)  # fmt: skip
    if chunks == 1:
        _linear_kernel[grid](x_MK, weight_NK, bias, out, num_rows, num_cols, k_dim, x_MK.stride(0),
                             weight_NK.stride(0), out.stride(0), SPLIT=False, **common)  # fmt: skip
        return out
    parts = torch.empty(chunks, num_rows, num_cols, dtype=torch.float32, device=x_MK.device)
    _linear_kernel[(*grid, chunks)](x_MK, weight_NK, bias, parts, num_rows, num_cols, k_dim, x_MK.stride(0),
                                    weight_NK.stride(0), num_cols, SPLIT=True, **common)  # fmt: skip
    reduce_grid = (
        triton.cdiv(num_rows, LINEAR_REDUCE_BLOCK[0]),
        triton.cdiv(num_cols, LINEAR_REDUCE_BLOCK[1]),
    )
    _linear_reduce_kernel[reduce_grid](parts, bias, out, num_rows, num_cols, chunks, out.stride(0),
                                       HAS_BIAS=bias_N is not None, BLOCK_M=LINEAR_REDUCE_BLOCK[0],
                                       BLOCK_N=LINEAR_REDUCE_BLOCK[1], num_warps=4)  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the batch-invariant kernel: x [..., K], weight [N, K] -> [..., N] in x.dtype."""
    out = kernel_linear(x.reshape(-1, x.shape[-1]), weight, bias, linear_forward)
    return out.view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------------ RMSNorm
@triton.jit(do_not_specialize=["stride_x", "stride_o"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    """Grid (rows,): RMSNorm of one row (fp32 statistics, normalised value rounded to x's dtype first)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / width + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel without autograd."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, width, eps, rows.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(width)
        )  # fmt: skip
    return out.view(x.shape)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():  # gradients of the eager definition, recomputed
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(_rms_norm_eager(x_, w_, ctx.eps), (x_, w_), grad_out)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim of x (clawrl.models.layers.RMSNorm's numerics), one program per row."""
    if needs_autograd(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_forward(x, weight, eps)  # the engine, no-grad passes: the same kernel, less host time


# ------------------------------------------------------------------------------------ sampled log-probs
@triton.jit(do_not_specialize=["stride_l"])
def _log_probs_kernel(
    logits_ptr, tokens_ptr, temps_ptr, out_ptr, vocab, stride_l, BLOCK_V: tl.constexpr, NEG_BIG: tl.constexpr
):
    """Grid (rows,): log_softmax(logits / t)[token] of one row; lane-wise online max / sum over BLOCK_V
    chunks from 0, then one tree over the lanes."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    temp = tl.load(temps_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], NEG_BIG, tl.float32)
    s_vec = tl.full([BLOCK_V], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK_V):
        mask = start + cols < vocab
        z = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32) / temp
        z = tl.where(mask, z, NEG_BIG)
        m_new = tl.maximum(m_vec, z)
        s_vec = s_vec * tl.exp(m_vec - m_new) + tl.where(mask, tl.exp(z - m_new), 0.0)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
    token = tl.load(tokens_ptr + row)
    z_token = tl.load(base + token).to(tl.float32) / temp
    tl.store(out_ptr + row, (z_token - m) - tl.log(s))


def _row_temperatures(temperature: float | torch.Tensor, num_rows: int, device) -> torch.Tensor:
    """fp32 [M] temperatures (0: greedy rows, reported at temperature 1, like the engine's sampler)."""
    if not isinstance(temperature, torch.Tensor):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        temperature = torch.full((num_rows,), float(temperature), dtype=torch.float32, device=device)
    temperature = temperature.to(device=device, dtype=torch.float32)
    return torch.where(temperature == 0.0, 1.0, temperature).contiguous()


def log_probs_forward(logits_MV: torch.Tensor, tokens_M: torch.Tensor, temps_M: torch.Tensor) -> torch.Tensor:
    """The kernel without autograd: fp32 [M] (temps_M from `_row_temperatures`)."""
    logits_MV = logits_MV if logits_MV.stride(-1) == 1 else logits_MV.contiguous()
    out = torch.empty(logits_MV.shape[0], dtype=torch.float32, device=logits_MV.device)
    if logits_MV.shape[0]:
        _log_probs_kernel[(logits_MV.shape[0],)](
            logits_MV, tokens_M.to(torch.int64).contiguous(), temps_M, out, logits_MV.shape[1],
            logits_MV.stride(0), BLOCK_V=LOGPROB_BLOCK_V, NEG_BIG=_NEG_BIG,
        )  # fmt: skip
    return out


class _LogProbsOf(torch.autograd.Function):
    """(logp [M], entropy [M]): logp by the kernel; entropy eager (fp32, chunks of rows, no graph kept);
    backward recomputes softmax(logits / t) per chunk of rows."""

    CHUNK = 1024

    @staticmethod
    def forward(ctx, logits_MV, tokens_M, temps_M, with_entropy):
        ctx.set_materialize_grads(False)
        logp_M = log_probs_forward(logits_MV, tokens_M, temps_M)
        entropy_M = torch.zeros_like(logp_M)
        if with_entropy:
            for rows in _chunks(logits_MV.shape[0], _LogProbsOf.CHUNK):
                log_p = torch.log_softmax(logits_MV[rows].float() / temps_M[rows, None], dim=-1)
                entropy_M[rows] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(logits_MV, tokens_M, temps_M, entropy_M)
        return logp_M, entropy_M

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M):
        logits_MV, tokens_M, temps_M, entropy_M = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits_MV)
        for rows in _chunks(logits_MV.shape[0], _LogProbsOf.CHUNK):
            log_p = torch.log_softmax(logits_MV[rows].float() / temps_M[rows, None], dim=-1)
            p = log_p.exp()
            dz = torch.zeros_like(p)
            if grad_logp_M is not None:  # d logp / dz = onehot - p
                dz -= p * grad_logp_M[rows, None]
                dz.scatter_add_(1, tokens_M[rows, None].long(), grad_logp_M[rows, None].float())
            if grad_entropy_M is not None:  # d H / dz = -p (log p + H)
                dz -= p * (log_p + entropy_M[rows, None]) * grad_entropy_M[rows, None]
            grad_logits[rows] = (dz / temps_M[rows, None]).to(logits_MV.dtype)
        return grad_logits, None, None, None


def _chunks(num_rows: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def log_probs_of(
    logits_MV: torch.Tensor, tokens_M: torch.Tensor, temperature: float | torch.Tensor, *, with_entropy=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits.float() / t)[token], entropy of that distribution or zeros), fp32 [M] each.

    `temperature`: one value or fp32 [M] per row; 0 means temperature 1 (greedy rows). Differentiable
    w.r.t. the logits. Row i's log-prob depends on row i only, bit for bit."""
    temps_M = _row_temperatures(temperature, logits_MV.shape[0], logits_MV.device)
    return _LogProbsOf.apply(logits_MV, tokens_M.long(), temps_M, with_entropy)


def sampled_log_probs(logits_MV, tokens_M, temperatures_M, *, out: torch.Tensor) -> torch.Tensor:
    """The engine's side: `out` [M] = log-probs of the sampled tokens (graph-safe, no host sync)."""
    return out.copy_(log_probs_forward(logits_MV, tokens_M, _row_temperatures(temperatures_M, 0, out.device)))


# ---------------------------------------------------------------------------------------------- attention
ATTENTION_ROWS = 16
"""Rows of a program's q tile: (query token, query head) pairs, BLOCK_M = ATTENTION_ROWS // GROUP tokens of
one sequence for the query heads of one KV head (GROUP = Hq / Hkv). One value for every caller (the tile's
shape is part of the arithmetic); a decode row fills GROUP of them."""


PREFILL_QUERY_BLOCKS = False
"""Whether prefill and the trainer's packed forward put several tokens in a program (attention_block_m) or
one (as decode). Off until tests/gpu/test_true_on_policy.py::test_paged_attention_equals_packed_attention
has passed on a GPU: it asserts that a row's bits are the same either way on tensor cores (the CPU tests
assert it under the interpreter). bench/batch_invariant_attention.py times both."""


def layout_block_m(num_heads: int, num_kv_heads: int) -> int:
    """Tokens per program of the model's prefill / packed attention calls."""
    return attention_block_m(num_heads, num_kv_heads) if PREFILL_QUERY_BLOCKS else 1


class QueryBlocks(NamedTuple):
    """The programs of one attention call: program b takes queries token0[b] .. token0[b] + count[b] - 1, all
    of sequence seq[b] (count 0: an unused program)."""

    seq: torch.Tensor
    token0: torch.Tensor
    count: torch.Tensor


def _tile_rows(group: int, rows: int | None) -> int:
    return max(rows or ATTENTION_ROWS, triton.next_power_of_2(group))


def attention_block_m(num_heads: int, num_kv_heads: int, rows: int | None = None) -> int:
    """Query tokens per program: as many as fit the q tile (ATTENTION_ROWS, or `rows`) with their GROUP
    heads each."""
    group = num_heads // num_kv_heads
    return _tile_rows(group, rows) // group


def token_blocks(seq_T: torch.Tensor) -> QueryBlocks:
    """One program per query token (a decode batch: each sequence has one new token); graph-safe."""
    token = torch.arange(seq_T.numel(), device=seq_T.device)
    return QueryBlocks(seq_T.to(torch.int64), token, torch.ones_like(token))


def query_blocks(seq_T: torch.Tensor, starts: torch.Tensor, num_tokens: int, block_m: int) -> QueryBlocks:
    """The programs of a prefill or packed call: token_blocks (seq_T: each token's sequence) for one token a
    program, else segment_blocks."""
    return token_blocks(seq_T) if block_m == 1 else segment_blocks(starts, num_tokens, block_m)


def segment_blocks(starts: torch.Tensor, num_tokens: int, block_m: int) -> QueryBlocks:
    """Programs for S sequences whose query tokens are contiguous: sequence s owns tokens starts[s] ..
    starts[s + 1] - 1 (starts [S + 1]); tokens from starts[S] to num_tokens (padding) get programs of their
    own (seq S - 1; their positions must be -1). No host sync: the grid is an upper bound (num_tokens //
    block_m + S + 1 programs), the unused ones count 0 tokens."""
    starts = starts.to(torch.int64)
    num_seqs = starts.numel() - 1
    bounds = torch.cat([starts, starts.new_full((1,), num_tokens)])
    lengths = (bounds[1:] - bounds[:-1]).clamp(min=0)  # S sequences + the padding tail
    per_segment = (lengths + block_m - 1) // block_m
    ends = per_segment.cumsum(0)
    block = torch.arange(num_tokens // block_m + num_seqs + 1, device=starts.device)
    segment = torch.searchsorted(ends, block, right=True).clamp(max=num_seqs)
    index = block - (ends - per_segment)[segment]
    count = (lengths[segment] - index * block_m).clamp(0, block_m)
    return QueryBlocks(segment.clamp(max=max(num_seqs - 1, 0)), bounds[segment] + index * block_m, count)


@triton.jit(do_not_specialize=["stride_qn", "stride_on", "stride_kr", "stride_t"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, blk_seq_ptr, blk_tok_ptr, blk_cnt_ptr, table_ptr, qk_scale,
    stride_qn, stride_qh, stride_on, stride_oh, stride_kr, stride_kh, stride_t,
    GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    NEG_BIG: tl.constexpr,
):  # fmt: skip
    """Grid (programs, Hkv): up to ROWS // GROUP query tokens of one sequence, with the GROUP query heads of
    one KV head each, over keys 0..max position; row (i, h) keeps only keys 0..pos[token0 + i].

    A row's arithmetic does not depend on the other rows: its dot is a row of the same tile shape, and the
    key chunks past its own position are masked to -inf, which leaves its running max, sum and accumulator
    unchanged bit for bit (alpha = exp2(0) = 1, p = 0). Key row of position j: PAGED: table[seq, j // PAGE]
    * PAGE + j % PAGE; else table[seq] + j. pos -1 (padding) gives zeros. k and v share strides."""
    block = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq = tl.load(blk_seq_ptr + block).to(tl.int64)
    token0 = tl.load(blk_tok_ptr + block).to(tl.int64)
    count = tl.load(blk_cnt_ptr + block).to(tl.int32)
    rows = tl.arange(0, ROWS)
    row_token = rows // GROUP
    valid = row_token < count
    tokens = token0 + row_token
    heads = kv_head * GROUP + rows % GROUP
    limits = tl.load(pos_ptr + tokens, mask=valid, other=-1).to(tl.int32) + 1  # keys 0..pos: pos + 1 of them
    num_keys = tl.max(limits, 0)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    io_mask = valid[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    acc = tl.full([ROWS, D_PAD], 0, tl.float32)
    m_i = tl.full([ROWS], 0, tl.float32) + NEG_BIG
    l_i = tl.full([ROWS], 0, tl.float32)
    first_row = tl.load(table_ptr + seq * stride_t).to(tl.int64)  # packed: the sequence's first key row
    for start in range(0, num_keys, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_mask = kpos < num_keys
        if PAGED:
            page = tl.load(table_ptr + seq * stride_t + kpos // PAGE, mask=k_mask, other=0).to(tl.int64)
            key_rows = page * PAGE + kpos % PAGE
        else:
            key_rows = first_row + kpos
        offsets = key_rows[:, None] * stride_kr + kv_head * stride_kh + offs_d[None, :]
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = _sum_dot(q, tl.trans(k)) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(kpos[None, :] < limits[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
        p = p.to(v_ptr.dtype.element_ty)
        if DOT_FP32:
            acc = acc * alpha[:, None] + _sum_dot(p, v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + tokens[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def attention_forward(
    q_THD: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, pos_T: torch.Tensor, blocks: QueryBlocks,
    table: torch.Tensor, scale: float, *, page: int | None, rows: int | None = None, num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """The kernel: q [T, Hq, D]; k/v rows [R, Hkv, D] (a flattened paged cache, or packed k/v); pos_T each
    query's position (-1: padding); `blocks` the programs (token_blocks / segment_blocks, built with
    attention_block_m's count, which every token must be covered by); table [S, W] block ids (`page` tokens
    each) or, with page None, [S] first rows of packed sequences -> [T, Hq, D] in q's dtype. `rows` and
    `num_warps` are for benchmarks: callers that must agree keep the defaults."""
    assert k_rows.stride() == v_rows.stride() and k_rows.stride(-1) == 1 and q_THD.stride(-1) == 1
    assert q_THD.dtype == k_rows.dtype == v_rows.dtype, (q_THD.dtype, k_rows.dtype)
    num_tokens, num_heads, head_dim = q_THD.shape
    num_kv_heads = k_rows.shape[1]
    group = num_heads // num_kv_heads
    tile_rows = _tile_rows(group, rows)
    out = torch.empty_like(q_THD)
    if num_tokens == 0:
        return out
    table = table if table.dim() == 2 else table.unsqueeze(1)
    _attention_kernel[(blocks.seq.numel(), num_kv_heads)](
        q_THD, k_rows, v_rows, out, pos_T, blocks.seq, blocks.token0, blocks.count, table, scale * _LOG2E,
        q_THD.stride(0), q_THD.stride(1), out.stride(0), out.stride(1), k_rows.stride(0), k_rows.stride(1),
        table.stride(0), GROUP=group, ROWS=tile_rows, D=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=ATTENTION_BLOCK_N, PAGE=page or 1,
        PAGED=page is not None, **_dot_options(q_THD.dtype), NEG_BIG=_NEG_BIG, num_warps=num_warps,
    )  # fmt: skip
    return out


def packed_layout(
    cu_seqlens: torch.Tensor, num_tokens: int, block_m: int
) -> tuple[torch.Tensor, QueryBlocks]:  # fmt: skip
    """Positions of `num_tokens` packed tokens (tokens past cu_seqlens[-1] get -1) and their query blocks."""
    token = torch.arange(num_tokens, device=cu_seqlens.device)
    cu = cu_seqlens.to(torch.int64)
    seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=cu.numel() - 2)
    pos = torch.where(token < cu[-1], token - cu[seq], -1)
    return pos, query_blocks(seq, cu, num_tokens, block_m)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, max_seqlen, layout):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale, ctx.max_seqlen = scale, max_seqlen
        pos_T, blocks = layout
        k, v = k.contiguous(), v.contiguous()
        return attention_forward(q.contiguous(), k, v, pos_T, blocks, cu_seqlens[:-1].to(torch.int64), scale,
                                 page=None)  # fmt: skip

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cu_seqlens = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        max_seqlen = ctx.max_seqlen or max(int(cu_seqlens.diff().max()), 1)
        # The trainer's own attention recomputed for its gradients (gradients need not be batch-invariant):
        # FlashAttention's varlen kernel on CUDA in bf16, one call per layer; elsewhere exact per-segment
        # SDPA. (Per-segment SDPA on the GPU made an RL step of 256 sequences 8.7x the default's.)
        with torch.enable_grad():
            out = VarlenAttention(cu_seqlens, max_seqlen).forward(0, *leaves, ctx.scale)
            grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        return (*grads, None, None, None, None)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    max_seqlen: int | None = None, backend: VarlenAttention | None = None,
):  # fmt: skip
    """Causal attention inside each packed segment (VarlenAttention's meaning) with the batch-invariant
    kernel: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. `max_seqlen` (the longest segment; computed when
    not given) is for the backward's FlashAttention call; `backend` (the forward's VarlenAttention, whose
    cu_seqlens these are) keeps the query blocks from one layer to the next."""
    cu_seqlens = cu_seqlens.to(q.device)
    key = ("batch_invariant_layout", q.shape[0], layout_block_m(q.shape[1], k.shape[1]))
    layout = backend.derived.get(key) if backend is not None else None
    if layout is None:
        layout = packed_layout(cu_seqlens, q.shape[0], key[2])
        if backend is not None:
            backend.derived[key] = layout
    return _VarlenAttention.apply(q, k, v, cu_seqlens, scale, max_seqlen, layout)


@triton.jit
def _kv_cache_write_kernel(
    k_ptr, v_ptr, slots, k_cache, v_cache, stride_kn, stride_kh, stride_vn, stride_vh, stride_slot, stride_ch,
    NUM_KV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Grid (tokens,): copy one token's k and v [Hkv, D] to its cache slot (a negative slot writes nothing)."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + tok).to(tl.int64)
    heads, dims = tl.arange(0, HKV_PAD), tl.arange(0, D_PAD)
    # The slot test as a vector: the interpreter rejects masks built with a scalar bool.
    ok = (heads < NUM_KV) & ((tl.full([HKV_PAD], 0, tl.int64) + slot) >= 0)
    mask = ok[:, None] & (dims < D)[None, :]
    cache = slot * stride_slot + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + tok * stride_kn + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vn + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache + cache, k, mask=mask)
    tl.store(v_cache + cache, v, mask=mask)


def kv_cache_write(k, v, slot_mapping, k_cache, v_cache) -> None:
    """k / v [N, Hkv, D] (unit last stride; strided views of a packed qkv are fine) into the paged caches
    [blocks, block_size, Hkv, D] at `slot_mapping` [N]: one launch for both (two index_copy_ cost a decode
    step of the 0.5B model 0.13 ms)."""
    num_tokens, num_kv, head_dim = k.shape
    assert k.stride(2) == v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    if num_tokens == 0:
        return
    _kv_cache_write_kernel[(num_tokens,)](
        k, v, slot_mapping, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), NUM_KV=num_kv, HKV_PAD=triton.next_power_of_2(num_kv),
        D=head_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=1,
    )  # fmt: skip


class PagedBatchInvariantAttention:
    """The engine's AttentionBackend in true-on-policy mode: writes the step's k/v into the paged cache, then
    runs the batch-invariant kernel over it. `begin(batch)` takes the GPU runner's TritonBatch (slot mapping,
    block tables, context lengths, and for prefill the query starts); graph-safe for decode batches."""

    def __init__(self, kv_cache) -> None:
        self.kv_cache = kv_cache
        self.batch = None
        self.layout: tuple[torch.Tensor, torch.Tensor] | None = None
        """(sequence, position) of the forward's tokens: computed at layer 0, read by the others."""

    def begin(self, batch) -> None:
        """Set the layout of the next forward."""
        self.batch = batch
        self.layout = None

    def forward(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        batch = self.batch
        assert batch is not None, "PagedBatchInvariantAttention.begin() must be called before the forward"
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
        kv_cache_write(k.to(k_rows.dtype), v.to(v_rows.dtype), batch.slot_mapping_N, k_cache, v_cache)
        if layer_idx == 0 or self.layout is None:  # once per forward (inside the CUDA graph when captured)
            self.layout = self._layout(q.shape[0], layout_block_m(q.shape[1], k.shape[1]))
        pos_T, blocks = self.layout
        return attention_forward(q.contiguous(), k_rows, v_rows, pos_T, blocks, batch.block_tables, scale,
                                 page=k_cache.shape[1])  # fmt: skip

    def _layout(self, num_tokens: int, block_m: int) -> tuple[torch.Tensor, QueryBlocks]:
        """Position of each new token and the programs: decode: row s at ctx_lens[s] - 1 (-1 for padding
        rows), one program each; prefill: the last q_len of each sequence's ctx_lens positions, in blocks of
        `block_m` tokens of one sequence (tokens after the last sequence's: -1)."""
        batch = self.batch
        ctx = batch.ctx_lens.to(torch.int64)
        if batch.query_start is None:
            return ctx - 1, token_blocks(torch.arange(num_tokens, device=ctx.device))
        starts = batch.query_start.to(torch.int64)
        token = torch.arange(num_tokens, device=ctx.device)
        seq = torch.searchsorted(starts[1:], token, right=True).clamp(max=ctx.numel() - 1)
        pos = ctx[seq] - (starts[seq + 1] - starts[seq]) + (token - starts[seq])
        pos = torch.where(token < starts[-1], pos, -1)
        return pos, query_blocks(seq, starts, num_tokens, block_m)


# ----------------------------------------------------------------------------------------- model switch
class BatchInvariantLinear(nn.Linear):
    """nn.Linear whose forward is the batch-invariant kernel (same parameters and state-dict names): cuBLAS
    in checked row blocks where its group passed cublas_rows.rows_check, else the Triton linear."""

    cublas_block_rows: int = 0
    """Set by enable_batch_invariant (cublas_rows.choose_kernels): 0 = the Triton kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_linear(self, x)


def layer_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s product by the kernel enable_batch_invariant chose for it (also the trainer's log-prob
    pass, which applies the LM head to the response rows only)."""
    rows_per_block = getattr(layer, "cublas_block_rows", 0)
    if rows_per_block:
        return cublas_linear(x, layer.weight, layer.bias, rows_per_block)
    return linear(x, layer.weight, layer.bias)


class BatchInvariantRMSNorm(RMSNorm):
    """RMSNorm whose forward is the batch-invariant kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def attend(backend, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
    """A switched Attention module's attention: the trainer's VarlenAttention or the engine's
    PagedBatchInvariantAttention, both through the one kernel."""
    if isinstance(backend, VarlenAttention):
        return varlen_attention(q, k, v, backend.cu_seqlens, scale, backend.max_seqlen, backend)
    if isinstance(backend, PagedBatchInvariantAttention):
        return backend.forward(layer_idx, q, k, v, scale)
    raise TypeError(
        f"true-on-policy mode: attention backend {type(backend).__name__} is not batch-invariant "
        f"(use VarlenAttention or PagedBatchInvariantAttention)"
    )


def enable_batch_invariant(model: nn.Module, *, compute_dtype: torch.dtype | None = None) -> int:
    """Route a native CausalLM's Linear layers (LM head and packed ones included), RMSNorms and attention
    through the batch-invariant kernels, and its RoPE and SiLU * up through the fused elementwise kernels
    (on CUDA; on CPU too under the Triton interpreter). Call before FSDP wraps it. Returns the number of
    modules switched (0 for a model already switched: calling it again only re-reads the verdicts).

    On CUDA each group of Linear layers takes cuBLAS if it passes cublas_rows.rows_check in `compute_dtype`
    (the dtype its forward multiplies in: the parameters' unless given; the trainer's fp32 master weights
    run in bf16), else the Triton linear. CLAWRL_TRUE_ON_POLICY_CUBLAS=0 keeps Triton for every layer (a
    benchmark's comparison; the engine and the trainer must then both see it)."""
    from clawrl.models.moe import SparseMoeBlock

    if _INTERPRETED is False and not torch.cuda.is_available():
        raise ValueError("--true-on-policy-mode: the batch-invariant kernels need a CUDA device "
                         "(on CPU they run only under the Triton interpreter, TRITON_INTERPRET=1)")  # fmt: skip
    switched = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            raise ValueError("--true-on-policy-mode supports dense models only (Qwen2/Qwen3/Llama), not MoE")
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
        elif type(module) is RMSNorm:
            module.__class__ = BatchInvariantRMSNorm
        elif isinstance(getattr(type(module), "batch_invariant", None), bool) and not module.batch_invariant:
            module.batch_invariant = True  # decoder.Attention (which imports this module: not imported here)
        else:
            continue
        switched += 1
    enable_train_kernels(model, _ELEMENTWISE_DEVICES)  # RoPE and SiLU * up: the fused elementwise kernels
    model.batch_invariant = True  # read by the trainer's log-prob pass (clawrl/trainer/rl_step.py)
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda" and os.environ.get(CUBLAS_ENV, "1") != "0":
        choose_kernels(model, compute_dtype or param.dtype, param.device)
    return switched


CUBLAS_ENV = "CLAWRL_TRUE_ON_POLICY_CUBLAS"


def kernel_choices(model: nn.Module) -> dict[str, str]:
    """Linear layer name -> its kernel ("cublas" or "triton"), for logs and tests."""
    return {
        name: "cublas" if getattr(m, "cublas_block_rows", 0) else "triton"
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
