"""Per-token log-probs and entropy of target tokens, straight from hidden states, chunked over tokens.

Legend: M = tokens whose next-token log-prob is wanted, D = hidden size, V = vocab size, c = chunk rows,
G = rows of one backward group.

The LM head is applied inside a custom autograd function, a chunk of rows at a time, so the full fp32 [M, V]
logits tensor (4.9 GB for 8k tokens of a 152k vocab) never exists: forward keeps only the per-row log-sum-exp
(and entropy), and backward recomputes each chunk's logits. Logits are divided by the rollout temperature,
so the log-probs are those of the distribution the engine sampled from (ARCHITECTURE decision 7).

Two implementations of the per-chunk softmax math share the GEMMs (cuBLAS, fp32 logits out):
- Triton (clawrl.trainer.triton_logprobs), chosen automatically for CUDA tensors when triton imports: one
  pass over each fp32 [c, V] logits chunk in forward (lse, target logit and entropy together) and one in
  backward (reads the logits, writes d logits in the hidden dtype), instead of ~8 elementwise PyTorch passes;
  the kernels divide by the temperature as they load, so T != 1 costs no extra pass either.
- PyTorch (below): CPU, fp64, and the reference the kernels are tested against. `TRITON_PATH` overrides the
  choice (tests run the kernels under the Triton interpreter on CPU with it).

Memory. Chunk size `DEFAULT_CHUNK_TOKENS` rows: for Qwen2.5's vocab (V = 151936) one fp32 [1024, V] logits
buffer is 622 MB (the PyTorch path holds two: logits and their exponentials); each chunk's GEMM (1024 x 1536
x 151936 for Qwen2.5-1.5B, 0.48 TFLOP) keeps the tensor cores busy. Backward writes d logits of G rows into
one buffer in the hidden dtype and then runs two large GEMMs over it (d hidden = dz W, d W = dz^T h) instead
of two per chunk; G is the largest multiple of c whose buffer fits in `DZ_BUFFER_BYTES` (4 GiB: 14k rows of
bf16 at V = 151936, so an 8k-token micro-batch is one group: 2.5 GB for dz plus one 622 MB logits chunk at
the peak).

Precision of d W (bf16 training): dz is rounded to bf16 once (as before; the GEMM operands are bf16 anyway);
the GEMM accumulates over all G rows in fp32 and rounds once. With one group d W comes out of the GEMM in the
weight dtype directly; with several (only past 13k rows at V = 151936), each group's product is added to an
fp32 accumulator (`mm` with `out_dtype` fp32 on CUDA: one fp32 [V, D] temporary per group, 934 MB for
Qwen2.5-1.5B), so nothing is summed in bf16. (The previous code rounded every chunk's [V, D]
product to bf16 before adding it to an fp32 buffer.)

Gradients, with z = h W^T / T and p = softmax(z):
    d logp_target / dz = onehot(target) - p
    d entropy / dz     = -p * (log p + entropy)
An output that gets no gradient (e.g. the entropy when --entropy-coef is 0: the loss detaches it) arrives as
None in backward (`set_materialize_grads(False)`), so its terms are skipped rather than multiplied by zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

DEFAULT_CHUNK_TOKENS = 1024
DZ_BUFFER_BYTES = 4 << 30
# "auto": Triton for CUDA tensors when triton imports; "never": always PyTorch; "always": Triton for CPU
# tensors too (only meaningful under TRITON_INTERPRET=1: the tests' way to run the kernels without a GPU).
TRITON_PATH = "auto"


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_MD, weight_VD, targets_M, inv_temperature, chunk, with_entropy, dz_buffer_bytes):
        ctx.set_materialize_grads(False)
        num_rows = hidden_MD.shape[0]
        dtype = _compute_dtype(hidden_MD)
        logp_M = hidden_MD.new_empty(num_rows, dtype=dtype)
        lse_M = hidden_MD.new_empty(num_rows, dtype=dtype)
        entropy_M = hidden_MD.new_zeros(num_rows, dtype=dtype)
        kernels = _triton_kernels(hidden_MD)
        for start in range(0, num_rows, chunk):
            rows = slice(start, min(start + chunk, num_rows))
            if kernels is not None:  # the kernel divides by the temperature as it reads the logits
                logits = _chunk_logits(hidden_MD[rows], weight_VD, 1.0)
                entropy = entropy_M[rows] if with_entropy else None
                kernels.chunk_forward(
                    logits, inv_temperature, targets_M[rows], lse_M[rows], logp_M[rows], entropy
                )
            else:
                z = _chunk_logits(hidden_MD[rows], weight_VD, inv_temperature)
                lse_M[rows], logp_M[rows], entropy = _chunk_stats(z, targets_M[rows], with_entropy)
                if with_entropy:
                    entropy_M[rows] = entropy
        ctx.save_for_backward(hidden_MD, weight_VD, targets_M, lse_M, entropy_M)
        ctx.inv_temperature, ctx.chunk, ctx.with_entropy = inv_temperature, chunk, with_entropy
        ctx.dz_buffer_bytes = dz_buffer_bytes
        return logp_M, entropy_M

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M):
        hidden_MD, weight_VD, targets_M, lse_M, entropy_M = ctx.saved_tensors
        use_entropy = ctx.with_entropy and grad_entropy_M is not None
        grads = _Grads(
            logp_M=grad_logp_M, entropy_and_grad_M=(entropy_M, grad_entropy_M) if use_entropy else None
        )
        num_rows, vocab = hidden_MD.shape[0], weight_VD.shape[0]
        group = _group_rows(ctx.chunk, vocab * hidden_MD.element_size(), ctx.dz_buffer_bytes)
        grad_hidden = hidden_MD.new_empty(hidden_MD.shape) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for start in range(0, num_rows, group):
            rows = slice(start, min(start + group, num_rows))
            dz_GV = _group_grad_logits(
                hidden_MD[rows], weight_VD, targets_M[rows], lse_M[rows], grads.at(rows), ctx
            )
            if grad_hidden is not None:
                torch.mm(dz_GV, weight_VD, out=grad_hidden[rows])
            if ctx.needs_input_grad[1]:
                grad_weight = _add_grad_weight(grad_weight, dz_GV, hidden_MD[rows], single=group >= num_rows)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VD.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


@dataclass(kw_only=True, frozen=True)
class _Grads:
    """The incoming gradients of one backward call, sliceable by rows; None: that output gets no gradient."""

    logp_M: torch.Tensor | None
    """d loss / d logp, [M]."""
    entropy_and_grad_M: tuple[torch.Tensor, torch.Tensor] | None
    """(entropy [M], d loss / d entropy [M]), or None when the entropy gets no gradient."""

    def at(self, rows: slice) -> _Grads:
        ent = self.entropy_and_grad_M
        return _Grads(
            logp_M=self.logp_M[rows] if self.logp_M is not None else None,
            entropy_and_grad_M=(ent[0][rows], ent[1][rows]) if ent is not None else None,
        )


def _group_rows(chunk: int, bytes_per_row: int, dz_buffer_bytes: int) -> int:
    """Rows of one backward group: the largest multiple of `chunk` whose dz buffer fits (at least one chunk)."""
    return max(1, dz_buffer_bytes // (bytes_per_row * chunk)) * chunk


def _group_grad_logits(hidden_GD, weight_VD, targets_G, lse_G, grads: _Grads, ctx) -> torch.Tensor:
    """d loss / d (h W^T) of one group, [G, V] in the hidden dtype, one logits chunk at a time."""
    dz_GV = hidden_GD.new_empty(hidden_GD.shape[0], weight_VD.shape[0])
    kernels = _triton_kernels(hidden_GD)
    for start in range(0, hidden_GD.shape[0], ctx.chunk):
        rows = slice(start, min(start + ctx.chunk, hidden_GD.shape[0]))
        part, inv_t = grads.at(rows), ctx.inv_temperature
        if kernels is not None:  # one read of the raw logits (divided by T on load), one write of dz
            logits = _chunk_logits(hidden_GD[rows], weight_VD, 1.0)
            kernels.chunk_grad_logits(
                logits, inv_t, dz_GV[rows], targets_G[rows], lse_G[rows], part.logp_M, part.entropy_and_grad_M
            )
        else:
            z = _chunk_logits(hidden_GD[rows], weight_VD, inv_t)
            dz = _chunk_grad_logits(z, lse_G[rows], targets_G[rows], part.logp_M, part.entropy_and_grad_M)
            dz_GV[rows] = dz.mul_(inv_t)  # rounded to the hidden dtype on the copy
    return dz_GV


def _add_grad_weight(acc_VD, dz_GV, hidden_GD, *, single: bool) -> torch.Tensor:
    """acc + dz^T h. One group: the GEMM's own fp32 accumulation, output in the hidden dtype. Several: an
    fp32 running sum (on CUDA the GEMM writes fp32 directly; elsewhere its product is rounded first)."""
    if single:
        return dz_GV.t() @ hidden_GD
    dtype = _compute_dtype(hidden_GD)
    if hidden_GD.is_cuda and hidden_GD.dtype != dtype and _mm_out_dtype_supported():
        product = torch.mm(dz_GV.t(), hidden_GD, out_dtype=dtype)
    else:
        product = (dz_GV.t() @ hidden_GD).to(dtype)
    return product if acc_VD is None else acc_VD.add_(product)


def _triton_kernels(hidden: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module if this call should use it (see TRITON_PATH), else None (PyTorch path)."""
    assert TRITON_PATH in ("auto", "never", "always"), TRITON_PATH
    if TRITON_PATH == "never" or _compute_dtype(hidden) != torch.float32:
        return None  # fp64 stays on the PyTorch path: the kernels compute in fp32
    if not hidden.is_cuda and TRITON_PATH != "always":
        return None
    return _import_triton_kernels()


@functools.cache
def _import_triton_kernels() -> ModuleType | None:
    """clawrl.trainer.triton_logprobs, or None where triton is not installed (then PyTorch does the math)."""
    try:
        from clawrl.trainer import triton_logprobs
    except ImportError:
        return None
    return triton_logprobs


def _chunk_stats(z, targets, with_entropy):
    """(lse [c], logp of the targets [c], entropy [c] or None) of one logits chunk, overwriting z.

    log-sum-exp by hand, so that at most two [c, V] buffers exist (torch.logsumexp makes three), and the
    entropy reuses exp(z - max) instead of exponentiating again.
    """
    z_max = z.amax(dim=-1)
    e = (z - z_max[:, None]).exp_()
    total = e.sum(dim=-1)
    lse = total.log().add_(z_max)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lse, logp, None
    log_p = z.sub_(lse[:, None])  # H = -sum p log p, with p = e / total
    return lse, logp, -e.mul_(log_p).sum(dim=-1) / total


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
    dz_buffer_bytes: int = DZ_BUFFER_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[target] and the entropy of that distribution, each [M], fp32 (fp64 for fp64 input).

    Entropy is zeros unless `with_entropy`. Differentiable w.r.t. hidden and weight. `chunk_tokens` rows of
    fp32 logits exist at a time; backward's d-logits buffer holds at most `dz_buffer_bytes`, but at least one
    chunk (module docstring).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden_MD.shape[0] == 0:
        empty = hidden_MD.new_zeros(0, dtype=torch.float32)
        return empty + hidden_MD.sum() * 0, empty
    return _LinearLogProbs.apply(
        hidden_MD, weight_VD, targets_M.long().contiguous(), 1.0 / temperature, max(1, int(chunk_tokens)),
        with_entropy, int(dz_buffer_bytes),
    )  # fmt: skip
