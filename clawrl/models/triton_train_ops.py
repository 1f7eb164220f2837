"""Fused Triton kernels with autograd for the trainer's forward and backward: RMSNorm, SiLU-and-mul, and the
rotary embedding of q and k. Each replaces a chain of eager ops (and their backward) in clawrl.models.layers by
one pass over the activations in each direction.

    y = fused_rms_norm(x, weight, eps)            # x [..., H] -> [..., H]; RMSNorm.forward
    a = fused_silu_mul(gate, up)                  # [N, I], [N, I] -> silu(gate) * up; GatedMLP.forward
    q, k = fused_rotary_qk(q, k, cos, sin)        # q [N, Hq, D], k [N, Hkv, D]; apply_rotary on both

The model uses them only after `clawrl.models.layers.enable_train_kernels(model)` and only for tensors on the
enabled device types (CUDA; CPU under the Triton interpreter for tests). The engine never calls them.

Numerics. The forward kernels round like the eager ops they replace (the convention of
clawrl/engine/runner/triton_ops.py), so the trainer's forward stays equal to the eager model up to reduction order:
- RMSNorm: fp32 statistics; the normalised value is rounded to x's dtype before the weight product (HF).
- SiLU-and-mul: silu(gate) is rounded to the activation dtype before the product with up.
- RoPE: cos/sin rounded to the activation dtype, every product and sum rounded like eager
  `x1 * cos - x2 * sin` in that dtype.
The backward kernels compute in fp32 and round each gradient once (eager autograd rounds after every op), so
bf16 gradients are at least as accurate as the eager ones. In fp32 every rounding step is a no-op.

Shapes: N = tokens, H = normalised width (hidden size or head_dim), I = MLP intermediate size,
Hq / Hkv = query / key-value heads, D = head_dim.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_MAX_TILE = 4096  # elements per RMSNorm tile: rows of a narrow norm (q/k norm, D=128) share a program


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width] with a unit last stride (a view when possible)."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query is not free)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _reduction_programs(device: torch.device, num_tiles: int) -> int:
    """Programs of a kernel that also reduces over rows: a few per SM on a GPU, few under the interpreter."""
    target = 4 * sm_count(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(num_tiles, target))


# ------------------------------------------------------------------------------------------------ RMSNorm
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, out_ptr, rstd_ptr, num_rows, width, eps, stride_x, stride_o,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask, col_mask = rows < num_rows, cols < width
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / width + eps)
    normed = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)  # HF: round before the weight product
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], out, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, num_rows, width, tiles_per_program,
    stride_dy, stride_x, stride_dx, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dx of every row of this program's tiles, and their summed dweight (one fp32 row per program)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < width
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, tiles_per_program):
        rows = (pid * tiles_per_program + t) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        xhat = x.to(tl.float32) * rstd[:, None]
        dxhat = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (dxhat - xhat * mean(dxhat * xhat)).
        proj = tl.sum(dxhat * xhat, axis=1) / width
        dx = rstd[:, None] * (dxhat - xhat * proj[:, None])
        tl.store(dx_ptr + rows64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        # The weight multiplied the rounded normalised value in the forward.
        dw_acc += tl.sum(dy * xhat.to(x.dtype).to(tl.float32), axis=0)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * width + cols, dw_acc, mask=col_mask)


def _rms_norm_tiling(width: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps): a power-of-two block over the row, several narrow rows per tile."""
    block = triton.next_power_of_2(width)
    rows = max(1, _MAX_TILE // block)
    num_warps = min(16, max(4, rows * block // 512))
    return block, rows, num_warps


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        assert weight.shape == (width,), f"weight {tuple(weight.shape)} does not match x [..., {width}]"
        x2 = _rows(x, width)
        out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block, rows, num_warps = _rms_norm_tiling(width)
        if x2.shape[0]:
            _rms_norm_fwd_kernel[(triton.cdiv(x2.shape[0], rows),)](
                x2, weight.contiguous(), out, rstd, x2.shape[0], width, eps, x2.stride(0), out.stride(0),
                ROWS=rows, BLOCK=block, num_warps=num_warps,
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        num_rows, width = x2.shape
        dy2 = _rows(dy, width)
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        block, rows, num_warps = _rms_norm_tiling(width)
        num_tiles = triton.cdiv(num_rows, rows)
        programs = _reduction_programs(x2.device, num_tiles)
        tiles_per_program = max(1, triton.cdiv(num_tiles, programs))
        programs = max(1, triton.cdiv(num_tiles, tiles_per_program))  # no program without a real tile
        dw_partial = torch.empty(programs, width, dtype=torch.float32, device=x2.device)
        if not num_rows:
            dw_partial.zero_()
        else:
            _rms_norm_bwd_kernel[(programs,)](
                dy2, x2, weight.contiguous(), rstd, dx, dw_partial, num_rows, width, tiles_per_program,
                dy2.stride(0), x2.stride(0), dx.stride(0), ROWS=rows, BLOCK=block, num_warps=num_warps,
            )  # fmt: skip
        dw = dw_partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.x_shape), dw, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dim, as clawrl.models.layers.RMSNorm; differentiable in x and weight.

    The output has the promoted dtype of x and weight (eager type promotion); dx comes back in x's dtype and
    dweight in weight's dtype, reduced over rows in fp32.
    """
    return _RMSNorm.apply(x, weight, eps)


# ------------------------------------------------------------------------------------------- SiLU-and-mul
@triton.jit
def _silu_mul_fwd_kernel(gate_ptr, up_ptr, out_ptr, width, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)  # F.silu rounds its output
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, width,
    stride_d, stride_g, stride_u, stride_dg, stride_du, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dout = tl.load(dout_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    g32 = gate.to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g32))  # exp overflow gives sig = 0 and finite (zero) gradients
    act = (g32 * sig).to(gate.dtype).to(tl.float32)  # the rounded silu the forward multiplied by up
    # silu'(g) = sig * (1 + g * (1 - sig))
    dgate = dout * up * sig * (1.0 + g32 * (1.0 - sig))
    tl.store(dgate_ptr + row * stride_dg + cols, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * stride_du + cols, (dout * act).to(dup_ptr.dtype.element_ty), mask=mask)


def _elementwise_grid(num_rows: int, width: int) -> tuple[tuple[int, int], int]:
    block = min(1024, triton.next_power_of_2(width))
    return (num_rows, triton.cdiv(width, block)), block


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        assert gate.shape == up.shape and gate.dtype == up.dtype, (gate.shape, up.shape, gate.dtype, up.dtype)
        width = gate.shape[-1]
        gate2, up2 = _rows(gate, width), _rows(up, width)
        out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
        grid, block = _elementwise_grid(gate2.shape[0], width)
        if gate2.shape[0]:
            _silu_mul_fwd_kernel[grid](
                gate2,
                up2,
                out,
                width,
                gate2.stride(0),
                up2.stride(0),
                out.stride(0),
                BLOCK=block,
                num_warps=4,
            )
        ctx.save_for_backward(gate2, up2)
        ctx.shape = gate.shape
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        gate2, up2 = ctx.saved_tensors
        width = gate2.shape[1]
        dout2 = _rows(dout, width)
        dgate = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        dup = torch.empty(up2.shape, dtype=up2.dtype, device=up2.device)
        grid, block = _elementwise_grid(gate2.shape[0], width)
        if gate2.shape[0]:
            _silu_mul_bwd_kernel[grid](
                dout2, gate2, up2, dgate, dup, width, dout2.stride(0), gate2.stride(0), up2.stride(0),
                dgate.stride(0), dup.stride(0), BLOCK=block, num_warps=4,
            )  # fmt: skip
        return dgate.view(ctx.shape), dup.view(ctx.shape)


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up (same shape and dtype; strided row views such as gate_up.chunk(2, -1) are fine)."""
    return _SiluMul.apply(gate, up)


# ----------------------------------------------------------------------------------------------- rotary
@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to the activation dtype and back: one rounding of an eager op in that dtype."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, num_heads, stride_xn, stride_xh, stride_on, stride_oh, stride_cs,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, TRANSPOSE: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """One token, all heads: (x1 c - x2 s, x2 c + x1 s) with eager rounding, or with TRANSPOSE the rotation by
    minus the angle in fp32 (x1 c + x2 s, x2 c - x1 s), which is the backward of the forward rotation."""
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    half_mask = offs < HALF
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]
    # The eager op casts cos/sin to the activation dtype first (apply_rotary); backward uses the same values.
    c = _round(tl.load(cos_ptr + tok * stride_cs + offs, mask=half_mask, other=0.0), DTYPE)[None, :]
    s = _round(tl.load(sin_ptr + tok * stride_cs + offs, mask=half_mask, other=0.0), DTYPE)[None, :]
    x_ptrs = x_ptr + tok * stride_xn + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        o1 = x1 * c + x2 * s
        o2 = x2 * c - x1 * s
    else:
        o1 = _round(x1 * c, DTYPE) - _round(x2 * s, DTYPE)
        o2 = _round(x2 * c, DTYPE) + _round(x1 * s, DTYPE)
    out_ptrs = out_ptr + tok * stride_on + heads[:, None] * stride_oh + offs[None, :]
    tl.store(out_ptrs, o1.to(DTYPE), mask=mask)
    tl.store(out_ptrs + HALF, o2.to(DTYPE), mask=mask)


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """x [N, H, D] (unit last stride) rotated into a new contiguous tensor; cos2/sin2 [N, D/2]."""
    if x.stride(2) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = head_dim // 2
    heads_pad, half_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, out, cos2, sin2, num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos2.stride(0), HALF=half, HEADS_PAD=heads_pad, HALF_PAD=half_pad, TRANSPOSE=transpose,
            DTYPE=_TL_DTYPES[x.dtype], num_warps=max(1, min(8, heads_pad * half_pad // 256)),
        )  # fmt: skip
    return out


class _RotaryQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        half = q.shape[-1] // 2
        assert q.shape[-1] % 2 == 0 and k.shape[-1] == q.shape[-1] and q.dtype == k.dtype
        assert cos.shape == sin.shape == (q.shape[0], 1, half), (cos.shape, q.shape)
        cos2, sin2 = _rows(cos, half), _rows(sin, half)
        assert cos2.stride(0) == sin2.stride(0)
        ctx.save_for_backward(cos2, sin2)
        return _rotate(q, cos2, sin2, transpose=False), _rotate(k, cos2, sin2, transpose=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos2, sin2 = ctx.saved_tensors
        return _rotate(dq, cos2, sin2, transpose=True), _rotate(dk, cos2, sin2, transpose=True), None, None


def fused_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)) in one kernel per tensor, differentiable in q, k.

    q [N, Hq, D] and k [N, Hkv, D] may be strided views (unit last stride); cos/sin are RotaryEmbedding's
    [N, 1, D/2] lookups (packed varlen positions already applied), not differentiated. Returns new contiguous
    tensors; the inputs are not modified.
    """
    return _RotaryQK.apply(q, k, cos, sin)
