"""Rejection sampling (the mask of --use-rs) and the sequence-level overflow bound, against hand-computed numbers.
The --custom-tis-function-path functions have their own file, test_mismatch_functions.py."""

import math

import pytest
import torch

from clawrl.algo import rejection_sampling_mask

ATOL = 1e-5
LN = math.log


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Two samples, lengths [2, 2], mask [1, 1, 1, 0]; token ratios exp(old - rollout) = [3, 0.25, 1.5, 0.01].
#   sequence level  (sum of masked log ratios): sample 1 ln 3 + ln 0.25 = ln 0.75 -> 0.75; sample 2 ln 1.5 -> 1.5
#   geometric level (masked mean):             sample 1 ln(0.75) / 2 -> sqrt(0.75) = 0.8660254; sample 2 1.5
LENGTHS = [2, 2]
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0])
OLD = torch.tensor([-1.0, -1.0, -2.0, -0.5])
ROLLOUT = OLD - torch.tensor([LN(3.0), LN(0.25), LN(1.5), LN(0.01)])


def rs(**kwargs):
    return rejection_sampling_mask(OLD, ROLLOUT, response_lengths=LENGTHS, loss_mask_N=MASK, **kwargs)


def test_sequence_level_does_not_overflow():
    # 100 tokens with log ratio 10 each: sequence log ratio 1000 (exp would be inf); truncate gives exactly 2.
    from types import SimpleNamespace

    from clawrl.algo.tis import mis_function

    args = SimpleNamespace(use_tis=True, tis_level="sequence", tis_mode="truncate", tis_upper_bound=2.0,
                           tis_lower_bound=None, tis_batch_normalize=False, use_rs=False)  # fmt: skip
    pg, _, metrics = mis_function(args, pg_loss=torch.ones(100), train_log_probs=[torch.full((100,), 10.0)],
                                  rollout_log_probs=[torch.zeros(100)], loss_masks=[torch.ones(100)],
                                  response_lengths=[100])  # fmt: skip
    close(pg, [2.0] * 100)
    assert torch.isfinite(metrics["mis_tis_weight_before_bound"]).all()


def test_rejection_rejects_unknown_level():
    with pytest.raises(ValueError, match="TIS/RS level 'batch' is not one of token, sequence, geometric"):
        rs(level="batch")


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
