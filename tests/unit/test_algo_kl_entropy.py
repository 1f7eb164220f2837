"""KL estimators, entropy and the chunked log-prob/entropy function against hand-computed numbers."""

import math

import pytest
import torch

from clawrl.algo import entropy_from_logits, kl_estimate, log_probs_and_entropy

ATOL = 1e-5


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# d = log_probs - ref = [0.5, -1.0, 0.0]
LOG_PROBS = torch.tensor([-1.0, -2.0, 0.0])
REF = torch.tensor([-1.5, -1.0, 0.0])


def test_k1():
    close(kl_estimate(LOG_PROBS, REF, "k1"), [0.5, -1.0, 0.0])


def test_k2():
    # d^2 / 2 = [0.125, 0.5, 0]
    close(kl_estimate(LOG_PROBS, REF, "k2"), [0.125, 0.5, 0.0])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_k3_and_low_var_kl_in_range(kind):
    # exp(-d) - 1 + d: d=0.5 -> 0.6065307 - 0.5 = 0.1065307; d=-1 -> e - 2 = 0.7182818; d=0 -> 0.
    close(kl_estimate(LOG_PROBS, REF, kind), [0.1065307, 0.7182818, 0.0])


def test_low_var_kl_clamps_k3_does_not():
    # d = -15: k3 = e^15 - 16 = 3269001.37 (clamped to 10); d = 15: e^-15 - 1 + 15 = 14.0000003 (clamped to 10).
    log_probs = torch.tensor([-15.0, 15.0], dtype=torch.float64)
    ref = torch.zeros(2, dtype=torch.float64)
    close(kl_estimate(log_probs, ref, "low_var_kl"), [10.0, 10.0])
    k3 = kl_estimate(log_probs, ref, "k3")
    assert k3[0].item() == pytest.approx(3269001.3724721107, rel=1e-6)
    assert k3[1].item() == pytest.approx(14.0000003059, rel=1e-9)


def test_kl_gradient_k3():
    # d k3 / d logp = 1 - exp(-d): d = 0.5 -> 1 - 0.6065307 = 0.3934693; d = -1 -> 1 - e = -1.7182818.
    log_probs = torch.tensor([0.5, -1.0], requires_grad=True)
    kl_estimate(log_probs, torch.zeros(2), "k3").sum().backward()
    close(log_probs.grad, [0.3934693, -1.7182818])


def test_kl_rejects_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match="--kl-loss-type 'k4' is not one of k1, k2, k3, low_var_kl"):
        kl_estimate(LOG_PROBS, REF, "k4")
    with pytest.raises(ValueError, match="differ in shape"):
        kl_estimate(LOG_PROBS, REF[:2], "k1")


# --- entropy ---------------------------------------------------------------------------------------------


def test_entropy_hand_computed():
    # Uniform over 2 -> ln 2 = 0.6931472; uniform over 4 -> ln 4 = 1.3862944;
    # [ln 3, 0] -> p = [0.75, 0.25]: H = 0.75*0.2876821 + 0.25*1.3862944 = 0.5623351.
    logits = torch.tensor(
        [[0.0, 0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -math.inf, -math.inf]]
    )
    close(entropy_from_logits(logits), [0.6931472, 1.3862944, 0.5623351])


def test_entropy_large_logits_stable_and_bf16_gives_fp32():
    # [1000, 0]: p = [1, e^-1000] -> H = 0 (a naive exp would overflow); [1000, 1000] -> ln 2.
    logits = torch.tensor([[1000.0, 0.0], [1000.0, 1000.0]], dtype=torch.bfloat16)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    close(out, [0.0, 0.6931472])


def test_log_probs_and_entropy_hand_computed():
    # T = 1, logits [ln 3, 0], target 0: logp = ln 0.75 = -0.2876821, H = 0.5623351.
    # T = 2: z = [ln sqrt(3), 0] -> p = [sqrt3/(sqrt3+1), 1/(sqrt3+1)] = [0.6339746, 0.3660254];
    #   logp_0 = -0.4557464, H = -(0.6339746 ln 0.6339746 + 0.3660254 ln 0.3660254) = 0.6568064.
    logits = torch.tensor([[math.log(3), 0.0]])
    lp, ent = log_probs_and_entropy(logits, torch.tensor([0]), temperature=1.0)
    close(lp, [-0.2876821])
    close(ent, [0.5623351])
    lp, ent = log_probs_and_entropy(logits, torch.tensor([0]), temperature=2.0)
    close(lp, [-0.4557464])
    close(ent, [0.6568064])


def test_log_probs_and_entropy_gradient_hand_computed():
    # logits [ln 3, 0], T = 1, target 0, p = [0.75, 0.25], lp = [-0.2876821, -1.3862944], H = 0.5623351.
    # d lp_0 / dz = [1 - 0.75, -0.25] = [0.25, -0.25]
    # d H / dz_j = -p_j (lp_j + H) = [-0.75 * 0.2746531, -0.25 * -0.8239593] = [-0.2059898, 0.2059898]
    # loss = lp_0 + H -> grad [0.0440102, -0.0440102]
    logits = torch.tensor([[math.log(3), 0.0]], requires_grad=True)
    lp, ent = log_probs_and_entropy(logits, torch.tensor([0]))
    (lp + ent).sum().backward()
    close(logits.grad, [[0.0440102, -0.0440102]])
    # T = 2, loss = lp_0 only: (onehot - p) / T = [(1 - 0.6339746) / 2, -0.3660254 / 2] = [0.1830127, -0.1830127]
    logits.grad = None
    lp, _ = log_probs_and_entropy(logits, torch.tensor([0]), temperature=2.0)
    lp.sum().backward()
    close(logits.grad, [[0.1830127, -0.1830127]])


def _unchunked(logits, targets, temperature):
    """Plain autograd reference: full fp32 [N, V] log_softmax."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(1, targets[:, None]).squeeze(1), entropy_from_logits(logits.float() / temperature)


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 100])
def test_chunked_matches_unchunked_values_and_gradients(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 50, generator=gen) * 3).requires_grad_()
    logits.data[5, :10] = -math.inf  # a masked vocabulary slice must not produce NaN
    targets = torch.randint(10, 50, (37,), generator=gen)
    grad_lp, grad_ent = torch.randn(37, generator=gen), torch.randn(37, generator=gen)

    lp, ent = log_probs_and_entropy(logits, targets, temperature=0.7, chunk_size=chunk_size)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_ent = _unchunked(logits, targets, 0.7)
    (ref_lp * grad_lp + ref_ent * grad_ent).sum().backward()

    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(chunked_grad).any()
    torch.testing.assert_close(chunked_grad, logits.grad, atol=1e-5, rtol=1e-5)


def test_chunked_bf16_logits_fp32_outputs_and_bf16_grad():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 30, generator=gen).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 30, (9,), generator=gen)
    lp, ent = log_probs_and_entropy(logits, targets, chunk_size=4)
    assert lp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = _unchunked(logits.detach(), targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_chunked_under_no_grad_and_errors():
    with torch.no_grad():
        lp, _ = log_probs_and_entropy(torch.zeros(3, 4), torch.tensor([0, 1, 2]), chunk_size=2)
    close(lp, [-1.3862944] * 3)  # uniform over 4: ln(1/4)
    with pytest.raises(ValueError, match="--rollout-temperature must be > 0, got 0"):
        log_probs_and_entropy(torch.zeros(1, 4), torch.tensor([0]), temperature=0)
    with pytest.raises(ValueError, match="expected logits"):
        log_probs_and_entropy(torch.zeros(2, 4), torch.tensor([0]))


@pytest.mark.gpu
def test_chunked_peak_memory_on_gpu():
    # bf16 logits [4096, 65536] (0.5 GiB); one fp32 [N, V] copy would be 1 GiB. With chunk 256 a fp32
    # [chunk, V] buffer is 64 MiB; the design keeps at most 3 alive, so allow 4 in the forward, and in the
    # backward 4 plus the bf16 logits gradient (the one full-size tensor it must create).
    num_rows, vocab, chunk = 4096, 65536, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(num_rows, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (num_rows,), device="cuda", generator=gen)
    chunk_bytes = chunk * vocab * 4

    def extra_peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    with torch.no_grad():
        peak, (lp, ent) = extra_peak(lambda: log_probs_and_entropy(logits, targets, chunk_size=chunk))
    assert peak < 4 * chunk_bytes, f"forward peak {peak / 2**20:.0f} MiB"
    ref_lp, ref_ent = _unchunked(logits, targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-5)

    leaf = logits.detach().requires_grad_()

    def forward_backward():
        lp, ent = log_probs_and_entropy(leaf, targets, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()

    peak, _ = extra_peak(forward_backward)
    assert peak < num_rows * vocab * 2 + 4 * chunk_bytes, f"forward+backward peak {peak / 2**20:.0f} MiB"
