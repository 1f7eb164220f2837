"""Per-token log-probs and entropy of target tokens, straight from hidden states, chunked over tokens.

Legend: M = tokens whose next-token log-prob is wanted, D = hidden size, V = vocab size.

The LM head is applied inside a custom autograd function, a chunk of rows at a time, so the full [M, V]
logits tensor (fp32: 4.9 GB for 8k tokens of a 152k vocab) never exists: forward keeps only the per-row
log-sum-exp, and backward recomputes each chunk's logits. Logits are divided by the rollout temperature,
so the log-probs are those of the distribution the engine sampled from (ARCHITECTURE decision 7).

Chunk size: `DEFAULT_CHUNK_TOKENS` rows. For Qwen2.5's vocab (V = 151936) one fp32 [1024, V] logits buffer is
622 MB; forward and backward each hold at most two such buffers (logits and their exponentials, updated in
place) plus, in backward, a bf16 copy of d logits: ~1.6 GB at the peak, negligible on an H200 (141 GB) next
to the activations of an 8k-token micro-batch, while each chunk's GEMM (1024 x 1536 x 151936 for
Qwen2.5-1.5B, 0.48 TFLOP) is large enough to keep the tensor cores busy. Smaller vocabularies use the same
row count (less memory).

Gradients, with z = h W^T / T and p = softmax(z):
    d logp_target / dz = onehot(target) - p
    d entropy / dz     = -p * (log p + entropy)
"""

from __future__ import annotations

import functools

import torch

DEFAULT_CHUNK_TOKENS = 1024


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_MD, weight_VD, targets_M, inv_temperature, chunk, with_entropy):
        num_rows = hidden_MD.shape[0]
        dtype = _compute_dtype(hidden_MD)
        logp_M = hidden_MD.new_empty(num_rows, dtype=dtype)
        lse_M = hidden_MD.new_empty(num_rows, dtype=dtype)
        entropy_M = hidden_MD.new_zeros(num_rows, dtype=dtype)
        for start in range(0, num_rows, chunk):
            rows = slice(start, min(start + chunk, num_rows))
            z = _chunk_logits(hidden_MD[rows], weight_VD, inv_temperature)
            # log-sum-exp by hand, so that at most two [c, V] buffers exist (torch.logsumexp makes three)
            # and the entropy reuses exp(z - max) instead of exponentiating again.
            z_max = z.amax(dim=-1)
            e = (z - z_max[:, None]).exp_()
            total = e.sum(dim=-1)
            lse = total.log().add_(z_max)
            lse_M[rows] = lse
            logp_M[rows] = z.gather(1, targets_M[rows, None]).squeeze(1) - lse
            if with_entropy:  # H = -sum p log p, with p = e / total
                log_p = z.sub_(lse[:, None])
                entropy_M[rows] = -e.mul_(log_p).sum(dim=-1) / total
        ctx.save_for_backward(hidden_MD, weight_VD, targets_M, lse_M, entropy_M)
        ctx.inv_temperature, ctx.chunk, ctx.with_entropy = inv_temperature, chunk, with_entropy
        return logp_M, entropy_M

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M):
        hidden_MD, weight_VD, targets_M, lse_M, entropy_M = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden_MD) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros_like(weight_VD, dtype=_compute_dtype(weight_VD)) if ctx.needs_input_grad[1] else None
        )
        use_entropy = ctx.with_entropy and grad_entropy_M is not None
        for start in range(0, hidden_MD.shape[0], ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, hidden_MD.shape[0]))
            dz = _chunk_grad_logits(
                _chunk_logits(hidden_MD[rows], weight_VD, ctx.inv_temperature),
                lse_M[rows],
                targets_M[rows],
                grad_logp_M[rows] if grad_logp_M is not None else None,
                (entropy_M[rows], grad_entropy_M[rows]) if use_entropy else None,
            )
            dz = dz.mul_(ctx.inv_temperature).to(hidden_MD.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = dz @ weight_VD
            if grad_weight is not None:
                grad_weight.add_(dz.t() @ hidden_MD[rows])  # bf16 product, fp32 running sum (no fp32 copy)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VD.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_grad_logits(z, lse, targets, grad_logp, entropy_and_grad):
    """d loss / d z for one chunk, overwriting z (two [c, V] buffers at the peak: z and p).

    With log p = z - lse:  dz = -p * (g_logp + g_ent * (log p + H)) + onehot(target) * g_logp.
    """
    log_p = z.sub_(lse[:, None])
    p = log_p.exp()
    coef = log_p  # reuse the buffer: log p is only needed inside coef
    if entropy_and_grad is not None:
        entropy, grad_entropy = entropy_and_grad
        coef.add_(entropy[:, None]).mul_(grad_entropy[:, None])
        if grad_logp is not None:
            coef.add_(grad_logp[:, None])
    elif grad_logp is not None:
        coef = grad_logp[:, None]
    else:
        coef.zero_()
    dz = p.mul_(coef).neg_()
    if grad_logp is not None:
        dz.scatter_add_(1, targets[:, None], grad_logp[:, None].to(dz.dtype))
    return dz


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (softmax statistics in low precision lose the log-probs); fp64 stays."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(hidden_cD: torch.Tensor, weight_VD: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """Logits of one chunk in the compute dtype, temperature applied: [c, V].

    bf16/fp16 on CUDA: the GEMM writes fp32 directly (`out_dtype`, torch >= 2.8). The tensor cores
    accumulate in fp32 anyway; rounding the logits to bf16 first would cost ~0.4% of each logit
    (|z| ~ 20 -> ~0.08 nats of log-prob error), for no speed gain.
    """
    dtype = _compute_dtype(hidden_cD)
    if hidden_cD.is_cuda and hidden_cD.dtype != dtype and _mm_out_dtype_supported():
        logits = torch.mm(hidden_cD, weight_VD.t(), out_dtype=dtype)
    else:
        logits = (hidden_cD @ weight_VD.t()).to(dtype)
    return logits.mul_(inv_temperature) if inv_temperature != 1.0 else logits


@functools.cache
def _mm_out_dtype_supported() -> bool:
    """Whether this torch's CUDA `mm` takes `out_dtype` (bf16 x bf16 -> fp32); probed once."""
    try:
        a = torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def linear_log_probs(
    hidden_MD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_M: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[target] and the entropy of that distribution, each [M], fp32 (fp64 for fp64 input).

    Entropy is zeros unless `with_entropy`. Differentiable w.r.t. hidden and weight.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden_MD.shape[0] == 0:
        empty = hidden_MD.new_zeros(0, dtype=torch.float32)
        return empty + hidden_MD.sum() * 0, empty
    return _LinearLogProbs.apply(
        hidden_MD, weight_VD, targets_M.long(), 1.0 / temperature, max(1, int(chunk_tokens)), with_entropy
    )
