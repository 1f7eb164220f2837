"""Fused Triton kernels (triton_ops.py) against the torch ops they replace, run by the Triton interpreter on CPU
(compiled on a GPU machine): add + RMSNorm, RoPE + KV-cache write, SiLU-and-mul, the one-pass sampler."""

import pytest
import torch
import torch.nn.functional as F
from interpreted_triton import (  # before clawrl.engine.triton_*: sets TRITON_INTERPRET
    DEVICE,
    replace_tests_if_triton_was_imported_too_early,
)

from clawrl.engine.core.request import SamplingParams
from clawrl.engine.runner.sampler import _sample_torch, sampling_keys
from clawrl.engine.runner.triton_ops import add_rmsnorm, rotary_cache_write, sample_rows, silu_and_mul
from clawrl.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]
# The interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even), so bit-identity with the
# eager bf16 ops is only asserted on CUDA; on CPU bf16 results must agree to about one bf16 rounding.
BITWISE = torch.cuda.is_available()


def bf16_tol(dtype):
    return (1e-6, 1e-6) if dtype == torch.float32 else (2e-2, 2e-2)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_matches_the_model_norm_of_the_rounded_sum(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(device=DEVICE, dtype=dtype)
    norm.weight.data = randn(96, dtype=dtype)
    x, residual = randn(5, 96, dtype=dtype), randn(5, 96, dtype=dtype, scale=3.0)
    expected_sum = x + residual
    expected = norm(expected_sum)
    out, summed = add_rmsnorm(x, residual.clone(), norm.weight, 1e-6)
    atol, rtol = bf16_tol(dtype)
    torch.testing.assert_close(summed, expected_sum, atol=atol, rtol=rtol)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    if BITWISE and dtype == torch.bfloat16:  # the eager rounding steps: (almost) every element identical
        assert torch.equal(summed, expected_sum)
        assert (out == expected).float().mean() > 0.97
    first, same = add_rmsnorm(x, None, norm.weight, 1e-6)
    assert same is x
    torch.testing.assert_close(first, norm(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_cache_write_rotates_q_in_place_and_fills_the_cache(dtype):
    torch.manual_seed(1)
    num_tokens, hq, hkv, d, page = 6, 7, 1, 32, 4
    rope = RotaryEmbedding(d, 64, 10000.0, None).to(DEVICE)
    qkv = randn(num_tokens, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)
    positions = torch.tensor([0, 5, 9, 33, 63, 2], device=DEVICE)
    slots = torch.tensor([3, 17, 8, -1, 0, 22], device=DEVICE)
    cos, sin = rope(positions)
    q_in = q.clone()
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    want_v = v.clone()
    k_cache = torch.zeros(6, page, hkv, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    rotary_cache_write(q, k, v, positions, rope.cos_cache, rope.sin_cache, slots, k_cache, v_cache)
    atol, rtol = bf16_tol(dtype)
    torch.testing.assert_close(q, want_q, atol=atol, rtol=rtol)
    if BITWISE and dtype == torch.bfloat16:
        # Compiled, x1 * cos - x2 * sin becomes one FMA (one rounding instead of eager's three): ~10% of the
        # elements differ from eager by an ulp, and the kernel is never further from the exact rotation.
        c16, s16 = cos.to(dtype).double(), sin.to(dtype).double()
        exact_q = apply_rotary(q_in.double(), c16, s16)
        assert (q.double() - exact_q).abs().max() <= (want_q.double() - exact_q).abs().max()
    written = slots >= 0
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    torch.testing.assert_close(flat_k[slots[written]], want_k[written], atol=atol, rtol=rtol)
    assert torch.equal(flat_v[slots[written]], want_v[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()  # slot -1 wrote nothing


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(2)
    gate_up = randn(3, 2 * 1100, dtype=dtype, scale=2.0)
    gate, up = gate_up.chunk(2, dim=-1)
    atol, rtol = bf16_tol(dtype)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, atol=atol, rtol=rtol)


def run_sample_kernel(logits, params, seeds, steps):
    num_rows = logits.shape[0]
    keys = torch.from_numpy(sampling_keys(seeds, steps)).to(DEVICE)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=DEVICE)
    tokens = torch.full((num_rows,), -1, dtype=torch.int64, device=DEVICE)
    logprobs = torch.zeros(num_rows, dtype=torch.float32, device=DEVICE)
    for sample in (False, True):
        rows = [i for i, p in enumerate(params) if (p.temperature > 0) == sample]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
        sample_rows(logits, rows_t, temps, keys, tokens, logprobs, sample=sample)
    return tokens, logprobs, temps, keys


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_kernel_equals_the_torch_sampler(dtype):
    torch.manual_seed(3)
    vocab = 5000  # not a multiple of the kernel's 2048-wide chunks
    logits = randn(6, vocab, dtype=dtype, scale=3.0)
    logits[1, 4321] = 40.0  # the greedy row's winner sits in the last, partial chunk
    params = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7, 1.3, 0.0, 2.0)]
    seeds, steps = [11, 12, 13, 2**62 + 5, 15, 16], [0, 3, 7, 1, 0, 2**20]
    tokens, logprobs, temps, keys = run_sample_kernel(logits, params, seeds, steps)
    want_tokens, want_logprobs = _sample_torch(logits, params, temps, keys)
    assert tokens.tolist() == want_tokens.tolist()
    assert tokens[1].item() == 4321
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=0)


def test_sample_kernel_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(1, 4096, device=DEVICE)
    logits[0, [2049, 3000, 4000]] = 1.0  # equal maxima, none in the first chunk
    tokens, _, _, _ = run_sample_kernel(logits, [SamplingParams(temperature=0.0)], [0], [0])
    assert tokens.tolist() == [2049]


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
