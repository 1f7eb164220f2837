"""The sliced Triton sampler (triton_ops.sample_rows: one program per (row, vocabulary slice), then a merge)
on CPU through the Triton interpreter (on a GPU machine the kernels run compiled).

The sampled token must not depend on how a row is cut: every token's score is the same fp32 computation of
the same hash, and the maximum is exact. So for several slicings — one slice per row as the old one-program
kernel did, and many small ones — the tokens equal the torch reference sampler's exactly, ties go to the
lowest id across slice boundaries, and the logprobs agree to fp32 rounding.
"""

import pytest
import torch
from interpreted_triton import (  # before clawrl.engine.triton_*: sets TRITON_INTERPRET
    DEVICE,
    replace_tests_if_triton_was_imported_too_early,
)

from clawrl.engine.core.request import SamplingParams
from clawrl.engine.runner.sampler import _sample_torch, sampling_keys
from clawrl.engine.runner.triton_ops import sample_rows

VOCAB = 3001  # not a multiple of any slice or block below
# (block_v, split_len): one slice for the whole row (the old kernel's shape), and finer cuts.
SLICINGS = [(4096, 4096), (256, 1024), (128, 128), (64, 192)]


def run_kernel(logits, params, seeds, steps, *, block_v, split_len):
    """Greedy rows and sampled rows through sample_rows, each group listed in a shuffled order."""
    keys = torch.from_numpy(sampling_keys(seeds, steps)).to(DEVICE)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=DEVICE)
    tokens = torch.full((len(params),), -1, dtype=torch.int64, device=DEVICE)
    logprobs = torch.full((len(params),), float("nan"), dtype=torch.float32, device=DEVICE)
    for sampled in (False, True):
        rows = [i for i, p in enumerate(params) if (p.temperature > 0) == sampled][::-1]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
        sample_rows(
            logits,
            rows_t,
            temps,
            keys,
            tokens,
            logprobs,
            sample=sampled,
            block_v=block_v,
            split_len=split_len,
        )
    return tokens, logprobs, temps, keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_equal_the_reference_for_every_slicing(dtype):
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, VOCAB, generator=generator) * 3.0).to(dtype).to(DEVICE)
    logits[1, 2999] = 40.0  # the greedy winner sits in the last, partial slice
    logits[4, 5] = 40.0  # ... and in the first
    params = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7, 1.3, 0.0, 2.0)]
    seeds, steps = [11, 12, 13, 2**62 + 5, 15, 16], [0, 3, 7, 1, 0, 2**20]
    want_tokens, want_logprobs = None, None
    for block_v, split_len in SLICINGS:
        tokens, logprobs, temps, keys = run_kernel(
            logits, params, seeds, steps, block_v=block_v, split_len=split_len
        )
        if want_tokens is None:
            want_tokens, want_logprobs = _sample_torch(logits, params, temps, keys)
        assert tokens.tolist() == want_tokens.tolist(), (block_v, split_len)
        assert tokens[1].item() == 2999 and tokens[4].item() == 5
        torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=0)


def test_sampled_tokens_follow_the_hash_noise_not_the_slicing():
    # Flat logits: the draw is decided by the Gumbel noise alone, spread over every slice.
    logits = torch.zeros(8, VOCAB, device=DEVICE)
    params = [SamplingParams(temperature=1.0)] * 8
    seeds, steps = list(range(100, 108)), list(range(8))
    results = [
        run_kernel(logits, params, seeds, steps, block_v=b, split_len=s)[0].tolist() for b, s in SLICINGS
    ]
    assert all(r == results[0] for r in results)
    assert len(set(results[0])) == 8  # different keys, different tokens (not all from one slice)
    _, _, temps, keys = run_kernel(logits, params, seeds, steps, block_v=64, split_len=64)
    assert results[0] == _sample_torch(logits, params, temps, keys)[0].tolist()


def test_greedy_ties_across_slices_go_to_the_lowest_id():
    logits = torch.zeros(2, VOCAB, device=DEVICE)
    logits[0, [130, 1000, 2500]] = 1.0  # equal maxima in three slices of 128, none in the first
    logits[1, [255, 256]] = 1.0  # equal maxima on both sides of a slice boundary
    params = [SamplingParams(temperature=0.0)] * 2
    for block_v, split_len in SLICINGS:
        tokens, logprobs, _, _ = run_kernel(
            logits, params, [0, 0], [0, 0], block_v=block_v, split_len=split_len
        )
        assert tokens.tolist() == [130, 255], (block_v, split_len)
        want = torch.log_softmax(logits, dim=-1)[[0, 1], [130, 255]]
        torch.testing.assert_close(logprobs, want, atol=1e-6, rtol=0)


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
