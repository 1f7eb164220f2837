"""Loss aggregation modes (split-invariant over micro-batches and ranks) and the SFT loss."""

import math

import pytest
import torch

from clawrl.algo import aggregate_loss, masked_mean, sft_loss

# Global batch of 4 samples, lengths [2, 3, 1, 2] (sample 3 has length 1, sample 4 is all masked).
LENGTHS = [2, 3, 1, 2]
X = [1.0, 2.0, 3.0, math.inf, 5.0, 6.0, 7.0, 8.0]  # the inf sits under mask 0 and must be ignored
MASK = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
# Hand-computed: masked tokens 5, sum(x*m) = 1 + 2 + 3 + 5 + 6 = 17.
#   per_token     = 17 / 5 = 3.4
#   per_sample    = (3/2 + 8/2 + 6/1 + 0) / 4 = 11.5 / 4 = 2.875
#   seq_sum_const = 17 / (4 samples * max_response_len 4) = 1.0625
EXPECTED = {"per_token": 3.4, "per_sample": 2.875, "seq_sum_const": 1.0625}
GLOBAL = {"num_global_tokens": 5, "num_global_samples": 4, "max_response_len": 4}

# Each split is a list of ranks, each rank a list of micro-batches, each micro-batch a list of sample indices.
SPLITS = {
    "unsplit": [[[0, 1, 2, 3]]],
    "one_sample_per_micro_batch": [[[0], [1], [2], [3]]],
    "two_ranks_uneven": [[[0], [1]], [[2, 3]]],
    "three_ranks": [[[0, 1]], [[2]], [[3]]],
}


def micro_batch(sample_indices, dtype=torch.float64):
    offsets = [0]
    for length in LENGTHS:
        offsets.append(offsets[-1] + length)
    x, mask = [], []
    for b in sample_indices:
        x += X[offsets[b] : offsets[b + 1]]
        mask += MASK[offsets[b] : offsets[b + 1]]
    return torch.tensor(x, dtype=dtype), torch.tensor(mask, dtype=dtype), [LENGTHS[b] for b in sample_indices]


def split_total(mode, split, dtype):
    total = 0.0
    for rank in SPLITS[split]:
        for indices in rank:
            x, mask, lengths = micro_batch(indices, dtype)
            total += aggregate_loss(x, mask, lengths, mode, **GLOBAL).item()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["per_token", "per_sample", "seq_sum_const"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_sum_over_micro_batches_and_ranks_is_the_global_loss(mode, split, dtype):
    total = split_total(mode, split, dtype)
    assert total == pytest.approx(split_total(mode, "unsplit", dtype), abs=1e-6)
    assert total == pytest.approx(EXPECTED[mode], abs=1e-6)


def test_all_masked_micro_batch_contributes_zero():
    x, mask, lengths = micro_batch([3])
    for mode in EXPECTED:
        out = aggregate_loss(x, mask, lengths, mode, **GLOBAL)
        assert out.item() == 0.0


@pytest.mark.parametrize("mode", ["per_token", "per_sample", "seq_sum_const"])
def test_nan_under_mask_one_is_not_hidden(mode):
    # A NaN in a token that counts is a real bug upstream; the loss must show it rather than drop it.
    x = torch.tensor([1.0, math.nan, 0.0])
    out = aggregate_loss(x, torch.tensor([1.0, 1.0, 0.0]), [2, 1], mode, **GLOBAL)
    assert math.isnan(out.item())


def test_length_one_response_per_sample():
    # Sample 3 alone: 6 / 1 / 4 samples = 1.5.
    x, mask, lengths = micro_batch([2])
    assert aggregate_loss(x, mask, lengths, "per_sample", num_global_samples=4).item() == pytest.approx(1.5)


def test_gradients_are_the_normalised_mask():
    # per_token: d/dx_t = m_t / 5. per_sample: m_t / (sum_t m of its sample) / 4.
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    aggregate_loss(x, mask, [2, 3], "per_token", num_global_tokens=5).backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.2, 0.2, 0.2, 0.0, 0.2]))
    x.grad = None
    aggregate_loss(x, mask, [2, 3], "per_sample", num_global_samples=4).backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.125, 0.125, 0.125, 0.0, 0.125]))
    # An all-masked sample (the second, length 1) gets gradient 0, not NaN.
    x.grad = None
    aggregate_loss(
        x, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]), [4, 1], "per_sample", num_global_samples=2
    ).backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.125, 0.125, 0.125, 0.125, 0.0]))


@pytest.mark.parametrize(
    ("mode", "kwargs", "missing"),
    [
        ("per_token", {}, "num_global_tokens"),
        ("per_sample", {"num_global_tokens": 3}, "num_global_samples"),
        ("seq_sum_const", {"num_global_samples": 2}, "max_response_len"),
    ],
)
def test_missing_global_normaliser_is_an_error(mode, kwargs, missing):
    with pytest.raises(ValueError, match=f"'{mode}' needs {missing} > 0, got None"):
        aggregate_loss(torch.ones(3), torch.ones(3), [3], mode, **kwargs)


def test_unknown_mode_and_mismatched_mask():
    with pytest.raises(ValueError, match="mode 'mean' is not one of per_token, per_sample, seq_sum_const"):
        aggregate_loss(torch.ones(3), torch.ones(3), [3], "mean", num_global_tokens=3)
    with pytest.raises(ValueError, match="loss mask"):
        aggregate_loss(torch.ones(3), torch.ones(2), [3], "per_token", num_global_tokens=3)


def test_masked_mean():
    # (1 + 2 + 3 + 5 + 6) / 5 = 3.4; inf under mask 0 ignored; empty mask -> 0.
    x, mask, _ = micro_batch([0, 1, 2, 3])
    assert masked_mean(x, mask).item() == pytest.approx(3.4)
    assert masked_mean(torch.ones(2), torch.zeros(2)).item() == 0.0


def test_sft_loss_with_aggregation():
    # loss = -logp = [0.5, 2.0, 1.0]; mask [1, 1, 0], lengths [2, 1]:
    # per_token (0.5 + 2) / 2 = 1.25; per_sample (1.25 + 0) / 2 = 0.625; grad per_token = -m / 2.
    log_probs = torch.tensor([-0.5, -2.0, -1.0], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0])
    loss_N = sft_loss(log_probs)
    torch.testing.assert_close(loss_N, torch.tensor([0.5, 2.0, 1.0]))
    per_sample = aggregate_loss(loss_N, mask, [2, 1], "per_sample", num_global_samples=2)
    assert per_sample.item() == pytest.approx(0.625)
    per_token = aggregate_loss(loss_N, mask, [2, 1], "per_token", num_global_tokens=2)
    assert per_token.item() == pytest.approx(1.25)
    per_token.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([-0.5, -0.5, 0.0]))
