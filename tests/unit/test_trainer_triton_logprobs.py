"""The Triton LM-head kernels (clawrl/trainer/triton_logprobs.py) against the PyTorch path of logprobs.py, run
by the Triton interpreter on CPU (compiled on a GPU machine), and linear_log_probs taking the Triton path:
values, gradients, the grouped d-logits buffer and the skipped entropy terms."""

import pytest
import torch
from interpreted_triton import (  # before clawrl.trainer.triton_logprobs: sets TRITON_INTERPRET
    DEVICE,
    replace_tests_if_triton_was_imported_too_early,
)

from clawrl.trainer import logprobs
from clawrl.trainer import triton_logprobs as kernels
from clawrl.trainer.logprobs import linear_log_probs

# Small blocks so that V = 1000 / 2053 take several loop iterations with a ragged tail.
BLOCK = 256


def _logits(rows, vocab, seed=0, scale=3.0):
    """fp32 logits with a peaked row (entropy ~ 0) and a row whose target is the last vocab index."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * scale
    z[1, vocab - 1] = 60.0  # peaked; its target below is the argmax at the last index
    z[2] += 45.0  # large |z|: the lse is big, the entropy is not
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[1] = vocab - 1
    targets[3] = vocab - 1
    return z.to(DEVICE), targets.to(DEVICE)


def _fp64_stats(z, targets):
    log_p = torch.log_softmax(z.double(), -1)
    return (
        torch.logsumexp(z.double(), -1),
        log_p.gather(1, targets[:, None]).squeeze(1),
        -(log_p.exp() * log_p).sum(-1),
    )


@pytest.mark.parametrize("vocab", [1000, 2053])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_the_torch_chunk_stats(vocab, temperature):
    logits, targets = _logits(6, vocab)
    z = logits * (1 / temperature)  # the PyTorch path's (rounded) division by T; the kernel does it on load
    lse, logp, entropy = (torch.full((6,), 7.0, device=DEVICE) for _ in range(3))
    kernels.chunk_forward(logits, 1 / temperature, targets, lse, logp, entropy, block_v=BLOCK)
    want_lse, want_logp, want_entropy = logprobs._chunk_stats(z.clone(), targets, True)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    # Against fp64 the online entropy form is within a few fp32 ulps even on the |z| ~ 50 row (on a GPU the
    # kernel's exp is the fast approximate one: a little more than here, within the same bound).
    # (the truth is that of the unrounded z = logits / T: the kernel scales logit differences, not logits)
    exact_lse, exact_logp, exact_entropy = _fp64_stats(logits.double() / temperature, targets)
    assert (entropy.double() - exact_entropy).abs().max() < 2e-6
    assert (logp.double() - exact_logp).abs().max() < 2e-6
    # the peaked row (entropy ~ 1e-20, lse ~ 60): no cancellation against lse, so even this tiny H is exact
    assert entropy[1].item() == pytest.approx(exact_entropy[1].item(), rel=1e-5)
    assert logp[1].item() == pytest.approx(0.0, abs=1e-6)  # target = argmax at the last vocab index

    logp_only = torch.full((6,), 7.0, device=DEVICE)
    untouched = torch.full((6,), 7.0, device=DEVICE)
    kernels.chunk_forward(logits, 1 / temperature, targets, lse, logp_only, None, block_v=BLOCK)
    torch.testing.assert_close(logp_only, want_logp, rtol=0, atol=1e-5)
    assert torch.equal(untouched, torch.full((6,), 7.0, device=DEVICE))


def test_forward_hand_computed_two_token_row_and_a_bad_target():
    # z = [0, ln 3]: lse = ln 4; logp(1) = ln(3/4); entropy = -(1/4 ln 1/4 + 3/4 ln 3/4)
    z = torch.tensor([[0.0, 1.0986122886681098], [0.0, 1.0986122886681098]], device=DEVICE)
    targets = torch.tensor([1, 2], device=DEVICE)  # 2 is outside the vocab
    lse, logp, entropy = (torch.empty(2, device=DEVICE) for _ in range(3))
    kernels.chunk_forward(z, 1.0, targets, lse, logp, entropy, block_v=BLOCK)
    assert lse[0].item() == pytest.approx(1.3862943611198906, abs=1e-6)
    assert logp[0].item() == pytest.approx(-0.2876820724517809, abs=1e-6)
    assert entropy[0].item() == pytest.approx(0.5623351446188083, abs=1e-6)
    assert torch.isnan(logp[1])  # no out-of-bounds read: the bad target shows up as NaN


def _forward(logits, inv_temperature, targets):
    lse, logp, entropy = (torch.empty(logits.shape[0], device=DEVICE) for _ in range(3))
    kernels.chunk_forward(logits, inv_temperature, targets, lse, logp, entropy, block_v=BLOCK)
    return lse, logp, entropy


@pytest.mark.parametrize("vocab", [1000, 2053])
@pytest.mark.parametrize("inv_temperature", [1.0, 1 / 0.7])
@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_grad_logits_match_the_torch_chunk_gradient(vocab, inv_temperature, which):
    logits, targets = _logits(5, vocab, seed=1)
    lse, logp, entropy = _forward(logits, inv_temperature, targets)
    gen = torch.Generator().manual_seed(2)
    grad_logp = torch.randn(5, generator=gen).to(DEVICE) if which != "entropy" else None
    ent = (entropy, torch.randn(5, generator=gen).to(DEVICE)) if which != "logp" else None
    out = torch.full((5, vocab), 9.0, device=DEVICE)
    kernels.chunk_grad_logits(logits, inv_temperature, out, targets, lse, grad_logp, ent, block_v=BLOCK)
    z = logits * inv_temperature
    want = logprobs._chunk_grad_logits(z, lse, targets, grad_logp, ent).mul_(inv_temperature)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    if which == "logp":  # the one-hot term lands on the target, including the last vocab index (row 3)
        assert out[3, vocab - 1].item() == pytest.approx(
            inv_temperature * grad_logp[3].item() * (1 - logp[3].exp().item()), abs=1e-5
        )


def test_grad_logits_write_bf16_rounded_once_and_take_strided_grads():
    logits, targets = _logits(4, 1000, seed=3)
    lse, logp, entropy = _forward(logits, 1.25, targets)
    grad_logp = torch.ones((), device=DEVICE).expand(4)  # what logp.sum().backward() hands in: stride 0
    ent = (entropy, torch.full((4,), -0.5, device=DEVICE))
    buffer = torch.zeros(6, 1000, dtype=torch.bfloat16, device=DEVICE)
    kernels.chunk_grad_logits(logits, 1.25, buffer[1:5], targets, lse, grad_logp, ent, block_v=BLOCK)
    want = logprobs._chunk_grad_logits(logits * 1.25, lse, targets, grad_logp.contiguous(), ent).mul_(1.25)
    # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): within one bf16 ulp either way
    torch.testing.assert_close(buffer[1:5].float(), want, rtol=2**-7, atol=1e-6)
    assert not buffer[0].any() and not buffer[5].any()  # rows outside the slice untouched


# ------------------------------------------------------------------------ linear_log_probs, Triton path
def _problem(rows=13, dim=16, vocab=3000, dtype=torch.float32, seed=0):
    """V = 3000: the default 2048-wide blocks take two iterations with a ragged tail."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=gen).to(device=DEVICE, dtype=dtype)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.5).to(device=DEVICE, dtype=dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    targets[-1] = vocab - 1
    w_logp, w_ent = torch.randn(rows, generator=gen).to(DEVICE), torch.randn(rows, generator=gen).to(DEVICE)
    return hidden, weight, targets, w_logp, w_ent


def _run(path, monkeypatch, hidden, weight, targets, w_logp, w_ent, which, **kwargs):
    """(logp, entropy, d hidden, d weight) of sum(w_logp logp) + sum(w_ent entropy) on the given path."""
    monkeypatch.setattr(logprobs, "TRITON_PATH", path)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = linear_log_probs(h, w, targets, with_entropy=True, **kwargs)
    loss = 0.0
    if which in ("logp", "both", "detached"):
        loss = loss + (logp * w_logp).sum()
    if which in ("entropy", "both"):
        loss = loss + (ent * w_ent).sum()
    if which == "detached":  # the trainer with --entropy-coef 0: entropy only logged
        loss = loss + (ent.detach() * w_ent).sum()
    loss.backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


class _Calls:
    """Counts calls to a real function (and records whether the entropy terms were asked for)."""

    def __init__(self, fn, entropy_arg):
        self.fn, self.entropy_arg, self.calls, self.with_entropy = fn, entropy_arg, 0, []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.with_entropy.append(args[self.entropy_arg] is not None)
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("which", ["logp", "entropy", "both", "detached"])
def test_triton_path_equals_the_torch_path(monkeypatch, temperature, which):
    problem = _problem()
    forward = _Calls(kernels.chunk_forward, 5)
    backward = _Calls(kernels.chunk_grad_logits, 6)
    monkeypatch.setattr(kernels, "chunk_forward", forward)
    monkeypatch.setattr(kernels, "chunk_grad_logits", backward)
    kwargs = dict(temperature=temperature, chunk_tokens=4)
    got = _run("always", monkeypatch, *problem, which, **kwargs)
    assert forward.calls == 4 and backward.calls == 4  # 13 rows in chunks of 4: the kernels did the math
    assert backward.with_entropy == [which in ("entropy", "both")] * 4  # detached: entropy terms skipped
    want = _run("never", monkeypatch, *problem, which, **kwargs)
    assert forward.calls == 4  # the torch path did not touch the kernels
    for g, w in zip(got, want, strict=True):
        scale = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5 * scale)


def test_triton_path_matches_fp64_and_the_grouped_dz_buffer_changes_nothing(monkeypatch):
    hidden, weight, targets, w_logp, w_ent = _problem(seed=4)
    one_group = _run("always", monkeypatch, hidden, weight, targets, w_logp, w_ent, "both", chunk_tokens=4)
    # 3000 fp32 values per row: 5 * 12000 bytes fits one 4-row chunk -> four groups, fp32 running d W
    groups = _run(
        "always",
        monkeypatch,
        hidden,
        weight,
        targets,
        w_logp,
        w_ent,
        "both",
        chunk_tokens=4,
        dz_buffer_bytes=60000,
    )
    for a, b in zip(one_group, groups, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    want = _run(
        "never",
        monkeypatch,
        hidden.double(),
        weight.double(),
        targets,
        w_logp.double(),
        w_ent.double(),
        "both",
    )
    for g, w in zip(one_group, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_torch_path_skips_entropy_terms_when_the_entropy_is_detached(monkeypatch):
    spy = _Calls(logprobs._chunk_grad_logits, 4)
    monkeypatch.setattr(logprobs, "_chunk_grad_logits", spy)
    hidden, weight, targets, w_logp, w_ent = _problem(rows=6, vocab=50)
    _run("never", monkeypatch, hidden, weight, targets, w_logp, w_ent, "detached", chunk_tokens=4)
    assert spy.with_entropy == [False, False]


def test_bf16_triton_path_within_bf16_rounding_of_the_torch_path(monkeypatch):
    problem = _problem(rows=9, dim=32, dtype=torch.bfloat16, seed=5)
    got = _run("always", monkeypatch, *problem, "both", temperature=0.7, chunk_tokens=4)
    want = _run("never", monkeypatch, *problem, "both", temperature=0.7, chunk_tokens=4)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)  # same logits: fp32 stats agree
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    for g, w in zip(got[2:], want[2:], strict=True):
        assert ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() < 2e-2


# -------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_compiled_kernels_at_the_qwen_vocab_match_torch():
    logits, targets = _logits(64, 151936, seed=6)
    inv_t = 1 / 0.7
    lse, logp, entropy = (torch.empty(64, device="cuda") for _ in range(3))
    kernels.chunk_forward(logits, inv_t, targets, lse, logp, entropy)  # production block sizes
    want = logprobs._chunk_stats(logits * inv_t, targets, True)
    for got, w in zip((lse, logp, entropy), want, strict=True):
        torch.testing.assert_close(got, w, rtol=0, atol=2e-5)
    grad_logp, ent = torch.randn(64, device="cuda"), (entropy, torch.randn(64, device="cuda"))
    out = torch.empty(64, 151936, dtype=torch.bfloat16, device="cuda")
    kernels.chunk_grad_logits(logits, inv_t, out, targets, lse, grad_logp, ent)
    want_dz = logprobs._chunk_grad_logits(logits * inv_t, lse, targets, grad_logp, ent).mul_(inv_t)
    # atol: the kernel's log p = fma(x, 1/T, -lse) skips a rounding; on a peaked row's target, 1 - p then
    # moves by ~ulp(|z|) = 4e-6 x |grad| (both are fp32 noise; bf16 relative tolerance covers the rest).
    torch.testing.assert_close(out.float(), want_dz.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
def test_bf16_end_to_end_on_cuda_triton_vs_torch(monkeypatch):
    problem = _problem(rows=3000, dim=256, vocab=32000, dtype=torch.bfloat16, seed=7)
    problem = tuple(t.cuda() for t in problem)
    got = _run("auto", monkeypatch, *problem, "both", temperature=0.7)
    want = _run("never", monkeypatch, *problem, "both", temperature=0.7)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-4)
    for g, w in zip(got[2:], want[2:], strict=True):
        assert ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() < 1e-2


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
