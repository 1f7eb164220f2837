"""The chunked fused LM-head log-prob/entropy function equals the plain computation, values and gradients."""

import pytest
import torch

from clawrl.trainer.logprobs import linear_log_probs


def _reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).double() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_unfused(chunk, temperature):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=gen)
    w_logp = torch.randn(11, dtype=torch.float64, generator=gen)
    w_ent = torch.randn(11, dtype=torch.float64, generator=gen)

    logp, ent = linear_log_probs(
        hidden, weight, targets, temperature=temperature, with_entropy=True, chunk_tokens=chunk
    )
    ((logp.double() * w_logp).sum() + (ent.double() * w_ent).sum()).backward()
    g_hidden, g_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_logp, ref_ent = _reference(hidden, weight, targets, temperature)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()

    assert logp.dtype == torch.float64  # fp64 inputs keep fp64; the tolerance is fp64-tight
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_hidden, hidden.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_weight, weight.grad, rtol=1e-10, atol=1e-10)


def test_fp32_inputs_give_fp32_within_fp32_rounding():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    targets = torch.randint(0, 40, (9,), generator=gen)
    logp, ent = linear_log_probs(hidden, weight, targets, temperature=0.8, with_entropy=True, chunk_tokens=4)
    ref_logp, ref_ent = _reference(hidden.double(), weight.double(), targets, 0.8)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)


def test_hand_computed_two_token_vocab():
    # h W^T = [0, ln 3]: p = [1/4, 3/4]; logp(target 1) = ln(3/4); entropy = -(1/4 ln 1/4 + 3/4 ln 3/4)
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[0.0], [torch.log(torch.tensor(3.0)).item()]])
    logp, ent = linear_log_probs(hidden, weight, torch.tensor([1]), with_entropy=True)
    assert logp.item() == pytest.approx(-0.2876820724517809, abs=1e-6)
    assert ent.item() == pytest.approx(0.5623351446188083, abs=1e-6)


def test_entropy_off_gives_zeros_and_no_entropy_grad_needed():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8)
    logp, ent = linear_log_probs(hidden, weight, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(ent, torch.zeros(4))
    logp.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_empty_rows_and_bad_temperature():
    hidden = torch.randn(0, 8, requires_grad=True)
    logp, _ = linear_log_probs(hidden, torch.randn(10, 8), torch.zeros(0, dtype=torch.long))
    assert logp.shape == (0,)
    logp.sum().backward()  # still differentiable: the trainer may get a micro-batch with no response token
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        linear_log_probs(torch.randn(2, 8), torch.randn(10, 8), torch.tensor([0, 1]), temperature=0)
