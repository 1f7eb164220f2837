"""Triton kernels of the fused LM-head log-prob function (clawrl.trainer.logprobs) on GPU.

Legend: c = rows of one chunk, V = vocab size. h W^T [c, V] are one chunk's fp32 logits as the cuBLAS GEMM
writes them; the kernels divide them by the temperature as they load them (z = h W^T / T), which saves the
PyTorch path's separate read-multiply-write pass over the chunk when T != 1 (same fp32 rounding).
`logprobs._chunk_stats` / `logprobs._chunk_grad_logits` are the PyTorch definitions the kernels are tested
against.

- `chunk_forward`: one program per row, one read of z. Per lane of a BLOCK_V-wide vector it keeps a running
  max m (in raw logit units, see the kernel), s = sum e^(z - m) and t = sum e^(z - m) (z - m), rescaled when m grows (each element costs one exp:
  exactly one of "rescale the old sums" and "add the new term" is not a multiply by 1); the lanes are merged
  at the end. Outputs lse = m + log s, logp = (z[target] - m) - log s and, when asked, the entropy
      H = -sum p log p = lse - sum p z = log s - t / s.
  Numerics: t <= 0 and s >= 1, so H is the sum of two non-negative terms (no cancellation), each accurate to
  a few fp32 ulps (the sums are lane-wise, ~V / BLOCK_V terms each, then a tree), whatever the size of |z|;
  log s near s = 1 resolves ~6e-8 absolute, as fp32 log-probs themselves do. The PyTorch form
  -sum p (z - lse) rounds every (z - lse) to fp32 first, an absolute error ~ 6e-8 |lse| that does not shrink
  with H. Measured against fp64 (3000-token rows, H ~ 0.26, the logits shifted by 0 / +40 / +80): kernel
  2e-7 / 3e-7 / 2e-7, PyTorch form 6e-7 / 1.4e-6 / 3.5e-6; the tests hold the kernel to 1e-6 absolute and
  1e-5 relative on a row with H ~ 1e-20. logp = (z[target] - m) - log s likewise avoids rounding lse
  (|lse| ~ 20) before the subtraction (4e-7 vs 3.4e-6 at the +80 shift).
- `chunk_grad_logits`: one program per row, one read of z and one write of dz (in the dtype of `out`: bf16
  when the hidden states are bf16, straight into the buffer the gradient GEMMs read):
      dz = inv_T * (onehot(target) g_logp - p (g_logp + g_ent (log p + H))),   log p = z - lse
  computed in fp32 and rounded once on the store.

A target outside [0, V) gives logp = NaN (nothing is read out of bounds), so a tokenizer/vocab mismatch shows
up in the metrics instead of reading other rows' logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 2048 fp32 per block with 4 warps: 16 values per thread (four 16-byte loads), few registers, so several
# programs share an SM and keep enough loads in flight; c = 1024 rows fill the 132 SMs of an H200 ~2x.
FORWARD_BLOCK_V = 2048
BACKWARD_BLOCK_V = 2048
NUM_WARPS = 4
_NEG_BIG = -1.0e30  # finite "minus infinity" for the running max: m_old - m_new never meets inf - inf


@triton.jit
def _forward_kernel(
    z_ptr, stride_z, targets_ptr, lse_ptr, logp_ptr, entropy_ptr, inv_temperature, vocab,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, NEG_BIG: tl.constexpr,
):  # fmt: skip
    """Grid (c,): lse, logp (and entropy) of one row of z."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * stride_z
    # The running max is kept in raw units (h W^T, before the temperature): differences are taken raw and
    # then scaled, (x - m) * inv_T. Scaling first, x * inv_T - m, lets the compiler fuse it into an FMA that
    # skips the rounding of x * inv_T, and the max element's own "z - m" then comes out as +-1 ulp of |z|
    # instead of 0: a slightly positive shifted term, and a peaked row's entropy of -1e-6.
    m_vec = tl.full([BLOCK_V], NEG_BIG, tl.float32)
    s_vec = tl.full([BLOCK_V], 0.0, tl.float32)
    t_vec = tl.full([BLOCK_V], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        grows = x > m_vec
        m_new = tl.maximum(m_vec, x)
        q = tl.exp(
            -tl.abs(x - m_vec) * inv_temperature
        )  # e^(z_old_max - z) if x grows the max, else e^(z - z_max)
        alpha = tl.where(grows, q, 1.0)  # rescales the old sums to the new max
        e = tl.where(grows, 1.0, q)  # e^(z - z_max_new)
        if WITH_ENTROPY:
            # x - m_new is -inf on masked lanes (e = 0 there): zero it so that 0 * -inf never makes a NaN.
            shifted = tl.where(e > 0.0, x - m_new, 0.0) * inv_temperature  # <= 0 exactly
            t_vec = alpha * (t_vec + (m_vec - m_new) * inv_temperature * s_vec) + e * shifted
        s_vec = s_vec * alpha + e
        m_vec = m_new
    m = tl.max(m_vec, 0)
    scale = tl.exp((m_vec - m) * inv_temperature)  # lanes that saw no element: 0, and their sums are 0
    s = tl.sum(s_vec * scale, 0)  # >= 1: the max's own term is e^0
    log_s = tl.log(s)
    target = tl.load(targets_ptr + row)
    valid = (target >= 0) & (target < vocab)
    x_target = tl.load(row_ptr + target, mask=valid, other=float("nan"))
    tl.store(lse_ptr + row, m * inv_temperature + log_s)
    tl.store(logp_ptr + row, (x_target - m) * inv_temperature - log_s)
    if WITH_ENTROPY:
        t = tl.sum(scale * (t_vec + (m_vec - m) * inv_temperature * s_vec), 0)  # <= 0
        tl.store(entropy_ptr + row, log_s - t / s)


@triton.jit
def _grad_logits_kernel(
    z_ptr, stride_z, out_ptr, stride_o, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    inv_temperature, vocab,
    HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Grid (c,): d loss / d (h W^T) of one row, written in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    # d z / d (h W^T) = 1 / T enters once per row: both gradient weights are pre-multiplied by it.
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row) * inv_temperature
    else:
        g_logp = 0.0
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row) * inv_temperature
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        log_p = tl.load(z_ptr + row * stride_z + offs, mask=mask, other=0.0) * inv_temperature - lse
        p = tl.exp(log_p)
        if HAS_GRAD_ENTROPY:
            dz = -p * (g_logp + g_ent * (log_p + entropy))
        else:
            dz = -p * g_logp
        if HAS_GRAD_LOGP:
            dz = tl.where(offs == target, dz + g_logp, dz)
        tl.store(out_ptr + row * stride_o + offs, dz.to(out_ptr.dtype.element_ty), mask=mask)


def chunk_forward(
    logits_cV: torch.Tensor,
    inv_temperature: float,
    targets_c: torch.Tensor,
    lse_c: torch.Tensor,
    logp_c: torch.Tensor,
    entropy_c: torch.Tensor | None = None,
    *,
    block_v: int = FORWARD_BLOCK_V,
) -> None:
    """With z = logits * inv_temperature: fill lse_c = logsumexp(z), logp_c = z[target] - lse_c and, if given,
    entropy_c = H(softmax z).

    logits_cV fp32 with unit stride along V; the [c] outputs fp32, contiguous (slices of [M] tensors are fine).
    """
    num_rows, vocab = logits_cV.shape
    _check_rows(logits_cV, targets_c, lse_c, logp_c, entropy_c)
    if num_rows == 0:
        return
    _forward_kernel[(num_rows,)](
        logits_cV, logits_cV.stride(0), targets_c, lse_c, logp_c,
        entropy_c if entropy_c is not None else lse_c, float(inv_temperature), vocab,
        WITH_ENTROPY=entropy_c is not None, BLOCK_V=block_v, NEG_BIG=_NEG_BIG, num_warps=NUM_WARPS,
    )  # fmt: skip


def chunk_grad_logits(
    logits_cV: torch.Tensor,
    inv_temperature: float,
    out_cV: torch.Tensor,
    targets_c: torch.Tensor,
    lse_c: torch.Tensor,
    grad_logp_c: torch.Tensor | None,
    entropy_and_grad: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    block_v: int = BACKWARD_BLOCK_V,
) -> None:
    """out_cV = d loss / d logits for one chunk (logits = h W^T fp32, z = logits * inv_temperature, lse_c and
    the entropy those of z), in out_cV's dtype.

    `grad_logp_c` None: the log-probs get no gradient; `entropy_and_grad` = (entropy_c, grad_entropy_c) or
    None when the entropy gets no gradient (its terms are then skipped, not multiplied by zero).
    """
    num_rows, vocab = logits_cV.shape
    entropy_c, grad_entropy_c = entropy_and_grad if entropy_and_grad is not None else (lse_c, None)
    grad_logp = grad_logp_c.contiguous() if grad_logp_c is not None else None
    grad_entropy = grad_entropy_c.contiguous() if grad_entropy_c is not None else None
    _check_rows(logits_cV, targets_c, lse_c, entropy_c, grad_logp, grad_entropy)
    assert out_cV.shape == logits_cV.shape and out_cV.stride(1) == 1, (out_cV.shape, out_cV.stride())
    if num_rows == 0:
        return
    _grad_logits_kernel[(num_rows,)](
        logits_cV, logits_cV.stride(0), out_cV, out_cV.stride(0), targets_c, lse_c, entropy_c,
        grad_logp if grad_logp is not None else lse_c, grad_entropy if grad_entropy is not None else lse_c,
        float(inv_temperature), vocab,
        HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, BLOCK_V=block_v,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def _check_rows(logits_cV: torch.Tensor, *per_row: torch.Tensor | None) -> None:
    """Internal contract: fp32 logits, unit stride along V; per-row tensors [c], contiguous, on the same device."""
    assert logits_cV.dtype == torch.float32 and logits_cV.stride(1) == 1, (
        logits_cV.dtype,
        logits_cV.stride(),
    )
    rows, device = logits_cV.shape[0], logits_cV.device
    for t in per_row:
        if t is not None:
            assert t.shape == (rows,) and t.is_contiguous() and t.device == device, (
                t.shape,
                t.stride(),
                t.device,
            )
