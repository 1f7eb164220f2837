"""TIS / MIS weights, rejection sampling and train-rollout mismatch metrics against hand-computed numbers."""

import math

import pytest
import torch

from clawrl.algo import masked_mean, mis_weights, mismatch_metrics, rejection_sampling_mask, token_tis_weights

ATOL = 1e-5
LN = math.log


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_token_tis_weights_and_metrics():
    # ratio = exp(old - rollout) = [3, 0.5, 1, 1.5]; clamp to [0, 2] -> [2, 0.5, 1, 1.5].
    # tis_abs = |ratio - 1| = [2, 0.5, 0, 0.5]; ois = exp(log_probs - old) = [1.1, 1, 1, 1].
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    rollout = old - torch.tensor([LN(3.0), LN(0.5), 0.0, LN(1.5)])
    log_probs = old + torch.tensor([LN(1.1), 0.0, 0.0, 0.0])
    weights, metrics = token_tis_weights(log_probs, old, rollout, tis_clip=2.0, tis_clip_low=0.0)
    close(weights, [2.0, 0.5, 1.0, 1.5])
    close(metrics["tis"], [2.0, 0.5, 1.0, 1.5])
    close(metrics["tis_clipfrac"], [1.0, 0.0, 0.0, 0.0])
    close(metrics["tis_abs"], [2.0, 0.5, 0.0, 0.5])
    close(metrics["ois"], [1.1, 1.0, 1.0, 1.0])
    # With tis_clip_low 0.6 the 0.5 ratio is lifted to 0.6 and counts as clipped.
    weights, metrics = token_tis_weights(log_probs, old, rollout, tis_clip=2.0, tis_clip_low=0.6)
    close(weights, [2.0, 0.6, 1.0, 1.5])
    close(metrics["tis_clipfrac"], [1.0, 1.0, 0.0, 0.0])


def test_token_tis_weights_carry_no_gradient():
    old = torch.zeros(2, requires_grad=True)
    weights, _ = token_tis_weights(torch.zeros(2), old, torch.zeros(2))
    assert not weights.requires_grad


def test_token_tis_bad_bounds():
    with pytest.raises(ValueError, match="--tis-clip-low 2.0 / --tis-clip 1.0"):
        token_tis_weights(torch.zeros(1), torch.zeros(1), torch.zeros(1), tis_clip=1.0, tis_clip_low=2.0)


# Two samples, lengths [2, 2], mask [1, 1, 1, 0]; token ratios exp(old - rollout) = [3, 0.25, 1.5, 0.01].
#   sequence level  (sum of masked log ratios): sample 1 ln 3 + ln 0.25 = ln 0.75 -> 0.75; sample 2 ln 1.5 -> 1.5
#   geometric level (masked mean):             sample 1 ln(0.75) / 2 -> sqrt(0.75) = 0.8660254; sample 2 1.5
LENGTHS = [2, 2]
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0])
OLD = torch.tensor([-1.0, -1.0, -2.0, -0.5])
ROLLOUT = OLD - torch.tensor([LN(3.0), LN(0.25), LN(1.5), LN(0.01)])


def mis(**kwargs):
    return mis_weights(OLD, ROLLOUT, response_lengths=LENGTHS, loss_mask_N=MASK, **kwargs)


def rs(**kwargs):
    return rejection_sampling_mask(OLD, ROLLOUT, response_lengths=LENGTHS, loss_mask_N=MASK, **kwargs)


@pytest.mark.parametrize(
    ("level", "mode", "bounds", "weights", "changed"),
    [
        # token: truncate at 2 -> [2, 0.25, 1.5, 0.01]
        ("token", "truncate", {"upper_bound": 2.0}, [2.0, 0.25, 1.5, 0.01], [1, 0, 0, 0]),
        # token: clip to [1/2, 2] (lower defaults to 1/upper) -> [2, 0.5, 1.5, 0.5]
        ("token", "clip", {"upper_bound": 2.0}, [2.0, 0.5, 1.5, 0.5], [1, 1, 0, 1]),
        # token: mask outside [0.5, 2] -> [0, 0, 1.5, 0]
        ("token", "mask", {"upper_bound": 2.0}, [0.0, 0.0, 1.5, 0.0], [1, 1, 0, 1]),
        # sequence: ratios [0.75, 1.5] are below 2 -> unchanged
        ("sequence", "truncate", {"upper_bound": 2.0}, [0.75, 0.75, 1.5, 1.5], [0, 0, 0, 0]),
        # sequence: clip to [0.8, 1.2] -> [0.8, 1.2], both samples changed
        ("sequence", "clip", {"upper_bound": 1.2, "lower_bound": 0.8}, [0.8, 0.8, 1.2, 1.2], [1, 1, 1, 1]),
        # sequence: mask outside [0.8, 2]: sample 1 (0.75) zeroed
        ("sequence", "mask", {"upper_bound": 2.0, "lower_bound": 0.8}, [0.0, 0.0, 1.5, 1.5], [1, 1, 0, 0]),
        # geometric: truncate at 1.2 -> [0.8660254, 1.2]
        ("geometric", "truncate", {"upper_bound": 1.2}, [0.8660254, 0.8660254, 1.2, 1.2], [0, 0, 1, 1]),
    ],
)
def test_mis_weights(level, mode, bounds, weights, changed):
    out, metrics = mis(level=level, mode=mode, **bounds)
    close(out, weights)
    close(metrics["tis"], weights)
    close(metrics["tis_clipfrac"], [float(c) for c in changed])


def test_sequence_level_does_not_overflow():
    # 100 tokens with log ratio 10 each: sequence log ratio 1000 (exp would be inf); truncate gives exactly 2.
    old = torch.full((100,), 10.0)
    weights, _ = mis_weights(
        old,
        torch.zeros(100),
        response_lengths=[100],
        loss_mask_N=torch.ones(100),
        level="sequence",
        upper_bound=2.0,
    )
    close(weights, [2.0] * 100)


def test_mis_rejects_unknown_level_and_mode():
    with pytest.raises(ValueError, match="TIS/RS level 'batch' is not one of token, sequence, geometric"):
        mis(level="batch")
    with pytest.raises(ValueError, match="TIS mode 'cut' is not one of truncate, clip, mask"):
        mis(mode="cut")


@pytest.mark.parametrize(
    ("kwargs", "keep"),
    [
        # token level, [0.5, 2]: 3 and 0.25 out, 1.5 in, 0.01 out (a masked token; its keep value is unused)
        ({"level": "token", "lower_bound": 0.5, "upper_bound": 2.0}, [0, 0, 1, 0]),
        # sequence level, [0.8, 2]: sample 1 (0.75) rejected whole, sample 2 (1.5) kept
        ({"level": "sequence", "lower_bound": 0.8, "upper_bound": 2.0}, [0, 0, 1, 1]),
        # geometric, [0.8, 2]: 0.866 and 1.5 both kept
        ({"level": "geometric", "lower_bound": 0.8, "upper_bound": 2.0}, [1, 1, 1, 1]),
        # only an upper bound of 1.0 at sequence level: sample 2 (1.5) rejected
        ({"level": "sequence", "upper_bound": 1.0}, [1, 1, 0, 0]),
    ],
)
def test_rejection_sampling_bounds(kwargs, keep):
    out, metrics = rs(**kwargs)
    close(out, [float(k) for k in keep])
    close(metrics["rs_rejectfrac"], [1.0 - k for k in keep])


def test_rejection_sampling_veto():
    # Veto 0.3: sample 1 has a masked token with ratio 0.25 < 0.3 -> the whole sample goes, even though its
    # geometric ratio 0.866 is within bounds. Sample 2's 0.01 token is under mask 0 -> no veto.
    out, metrics = rs(level="geometric", lower_bound=0.8, upper_bound=2.0, veto_threshold=0.3)
    close(out, [0.0, 0.0, 1.0, 1.0])
    close(metrics["rs_veto"], [1.0, 1.0, 0.0, 0.0])
    # Veto alone (no bounds) gives the same keep mask.
    out, _ = rs(veto_threshold=0.3)
    close(out, [0.0, 0.0, 1.0, 1.0])


def test_rejection_sampling_bad_bounds():
    with pytest.raises(ValueError, match="lower bound 2.0 must be < upper bound 1.0"):
        rs(lower_bound=2.0, upper_bound=1.0)
    with pytest.raises(ValueError, match="veto threshold must be > 0, got 0"):
        rs(veto_threshold=0)


def test_mismatch_metrics():
    # delta = old - rollout = [ln 2, -ln 2, 0]:
    #   tis_abs |e^delta - 1| = [1, 0.5, 0]; abs diff = [0.6931472, 0.6931472, 0]
    #   k3 KL(rollout || train) = e^delta - 1 - delta = [2 - 1 - 0.6931472, 0.5 - 1 + 0.6931472, 0]
    #                                                  = [0.3068528, 0.1931472, 0]
    old = torch.tensor([0.0, 0.0, -1.0])
    rollout = torch.tensor([-LN(2.0), LN(2.0), -1.0])
    metrics = mismatch_metrics(old, rollout)
    close(metrics["tis_abs"], [1.0, 0.5, 0.0])
    close(metrics["train_rollout_logprob_abs_diff"], [0.6931472, 0.6931472, 0.0])
    close(metrics["mismatch_k3_kl"], [0.3068528, 0.1931472, 0.0])
    # train/train_rollout_logprob_abs_diff is the masked mean: mask [1, 1, 0] -> 0.6931472.
    mean = masked_mean(metrics["train_rollout_logprob_abs_diff"], torch.tensor([1.0, 1.0, 0.0]))
    assert mean.item() == pytest.approx(0.6931472, abs=1e-6)
