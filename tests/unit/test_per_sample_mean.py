"""`per_sample_mean` (clawrl/trainer/rl_step.py), the rollout/* per-sample metrics (rollout/log_probs,
rollout/advantages, ...): each sample's masked mean, then the mean over samples, on hand-computed numbers;
a fully masked sample counts as a sample with mean 0; the result is the same function of the values whatever
their order, so equal log-probs give equal metrics (step 1's log_probs == ref_log_probs check relies on it)."""

from __future__ import annotations

import pytest
import torch

from clawrl.data.train_batch import TrainBatch
from clawrl.trainer.rl_step import per_sample_mean


def _batch(masks: list[list[int]]) -> TrainBatch:
    n = len(masks)
    return TrainBatch(rollout_id=0, tokens=[[1] * (len(m) + 2) for m in masks], response_lengths=[len(m) for m in masks],
                      loss_masks=masks, rewards=[0.0] * n, raw_rewards=[0.0] * n)  # fmt: skip


def test_hand_computed_with_a_masked_token_and_a_removed_sample():
    batch = _batch([[1, 1, 0], [1], [0, 0]])
    values = {0: torch.tensor([1.0, 3.0, 100.0]), 1: torch.tensor([-4.0]), 2: torch.tensor([7.0, 9.0])}
    # sample 0: (1 + 3) / 2 = 2; sample 1: -4; sample 2: nothing counted -> 0; mean over 3 samples
    assert per_sample_mean(values, batch, torch.device("cpu")) == pytest.approx((2.0 - 4.0 + 0.0) / 3)


def test_a_subset_of_samples_in_any_order():
    batch = _batch([[1] * 5, [1, 0, 1], [1] * 2, [1] * 7])
    values = {3: torch.arange(7.0), 1: torch.tensor([2.0, 50.0, 4.0])}  # this rank's samples only
    assert per_sample_mean(values, batch, torch.device("cpu")) == pytest.approx((3.0 + 3.0) / 2)
    reordered = {1: values[1], 3: values[3]}
    assert per_sample_mean(reordered, batch, torch.device("cpu")) == per_sample_mean(values, batch, "cpu")


def test_many_samples_match_the_per_sample_loop_and_equal_inputs_give_equal_outputs():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (256,), generator=gen).tolist()
    masks = [(torch.rand(n, generator=gen) > 0.1).int().tolist() for n in lengths]
    batch = _batch(masks)
    values = {i: torch.randn(n, generator=gen) for i, n in enumerate(lengths)}
    want = sum(
        float((values[i].double() * torch.tensor(m, dtype=torch.float64)).sum()) / max(sum(m), 1)
        for i, m in enumerate(masks)
    ) / len(masks)
    got = per_sample_mean(values, batch, torch.device("cpu"))
    assert got == pytest.approx(want, rel=1e-12)
    assert per_sample_mean({i: v.clone() for i, v in values.items()}, batch, torch.device("cpu")) == got
    assert per_sample_mean({}, batch, torch.device("cpu")) == 0.0
