"""Per-token log-probs and entropy of target tokens, straight from hidden states, chunked over tokens.

Legend: M = tokens whose next-token log-prob is wanted, D = hidden size, V = vocab size.

The LM head is applied inside a custom autograd function, a chunk of rows at a time, so the full [M, V]
logits tensor (fp32: 4.9 GB for 8k tokens of a 152k vocab) never exists: forward keeps only the per-row
log-sum-exp, and backward recomputes each chunk's logits. Logits are divided by the rollout temperature,
so the log-probs are those of the distribution the engine sampled from (ARCHITECTURE decision 7).

Gradients, with z = h W^T / T and p = softmax(z):
    d logp_target / dz = onehot(target) - p
    d entropy / dz     = -p * (log p + entropy)
"""

from __future__ import annotations

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
            lse = torch.logsumexp(z, dim=-1)
            lse_M[rows] = lse
            logp_M[rows] = z.gather(1, targets_M[rows, None]).squeeze(1) - lse
            if with_entropy:
                entropy_M[rows] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
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
            z = _chunk_logits(hidden_MD[rows], weight_VD, ctx.inv_temperature)
            log_p = z - lse_M[rows, None]
            p = log_p.exp()
            dz = torch.zeros_like(z)
            if grad_logp_M is not None:
                g = grad_logp_M[rows, None]
                dz -= p * g
                dz.scatter_add_(1, targets_M[rows, None], g)
            if use_entropy:
                dz -= p * (log_p + entropy_M[rows, None]) * grad_entropy_M[rows, None]
            dz *= ctx.inv_temperature
            dz = dz.to(hidden_MD.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = dz @ weight_VD
            if grad_weight is not None:
                grad_weight += (dz.t() @ hidden_MD[rows]).to(grad_weight.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VD.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (softmax statistics in low precision lose the log-probs); fp64 stays."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(hidden_cD: torch.Tensor, weight_VD: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """Logits of one chunk in the compute dtype, temperature applied: [c, V]."""
    return (hidden_cD @ weight_VD.t()).to(_compute_dtype(hidden_cD)) * inv_temperature


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
