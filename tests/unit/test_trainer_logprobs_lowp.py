"""The fused log-prob function with bf16 hidden states and LM head (the GPU training dtype).

Softmax statistics and outputs are fp32 whatever the input dtype; gradients come back in the input dtype.
On CUDA the logits GEMM writes fp32 directly, so the log-probs equal the fp32 computation on the same
bf16-rounded inputs to fp32 accuracy (checked on a GPU only); elsewhere logits are rounded to bf16 first.
"""

import pytest
import torch

from clawrl.trainer.logprobs import linear_log_probs


def _inputs(device, dtype=torch.bfloat16, rows=37, vocab=300, dim=32):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.3).to(device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    return hidden, weight, targets


def _fp32_reference(hidden, weight, targets, temperature):
    logits = (hidden.detach().float() @ weight.detach().float().t()) / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def _check(device, atol):
    hidden, weight, targets = _inputs(device)
    logp, ent = linear_log_probs(hidden, weight, targets, temperature=0.7, with_entropy=True, chunk_tokens=8)
    assert logp.dtype == ent.dtype == torch.float32
    want_logp, want_ent = _fp32_reference(hidden, weight, targets, 0.7)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=atol)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=atol)
    (logp.sum() + 0.1 * ent.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    ref_h = hidden.detach().float().requires_grad_()
    ref_w = weight.detach().float().requires_grad_()
    r_logp, r_ent = _fp32_reference(ref_h, ref_w, targets, 0.7)
    logits = (ref_h @ ref_w.t()) / 0.7
    logp_all = torch.log_softmax(logits, -1)
    (logp_all.gather(1, targets[:, None]).sum() - 0.1 * (logp_all.exp() * logp_all).sum()).backward()
    for got, want in ((hidden.grad, ref_h.grad), (weight.grad, ref_w.grad)):
        scale = want.abs().max()
        assert ((got.float() - want).abs().max() / scale).item() < 2e-2  # bf16 gradient rounding


def test_bf16_inputs_on_cpu():
    _check("cpu", atol=0.05)  # logits rounded to bf16 (|z| ~ 3: ~0.01) before the fp32 softmax


@pytest.mark.gpu
def test_bf16_inputs_on_cuda_use_fp32_logits():
    _check("cuda", atol=1e-4)  # vs ~5e-3 if the logits were rounded to bf16
