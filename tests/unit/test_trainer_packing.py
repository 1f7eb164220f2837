"""Micro-batch plans: hand-worked examples and the invariants on random batches.

Invariants: every sample exactly once; token budget (or micro-batch size) respected; the same number of
micro-batches on every rank; tokens balanced over ranks; empty (dummy) micro-batches only on a rank where no
micro-batch holds two samples, i.e. where nothing could be split instead.
"""

import random

import pytest

from clawrl.trainer.packing import PackingError, plan_micro_batches


def test_hand_worked_balance_and_first_fit():
    # Longest first to the least-loaded rank: 10 -> r0, 8 -> r1, 6 -> r1 (8 < 10), 4 -> r0 (10 < 14).
    # Budget 12: r0 = {10, 4} and r1 = {8, 6} each need two bins.
    plan = plan_micro_batches([10, 8, 6, 4], 2, max_tokens_per_gpu=12)
    assert plan.per_rank == [[[0], [3]], [[1], [2]]]
    assert plan.num_micro_batches == 2 and plan.samples_of(1) == [1, 2]


def test_rank_short_of_micro_batches_splits_its_largest():
    # Samples per rank are capped at ceil(5/2) = 3: 20 -> r0, 5, 5, 5 -> r1 (cap reached), 5 -> r0.
    # r0 = {3, 4} needs 2 bins of <= 20; r1 = {0, 1, 2} fits one bin of 15, split in halves to match.
    plan = plan_micro_batches([5, 5, 5, 5, 20], 2, max_tokens_per_gpu=20)
    assert plan.per_rank == [[[3], [4]], [[0], [1, 2]]]


def test_dummy_micro_batch_only_when_nothing_can_be_split():
    # r0 = {30} (one bin), r1 = {20, 20} (two bins of 30): r0 has a single one-sample bin -> an empty one.
    plan = plan_micro_batches([20, 20, 30], 2, max_tokens_per_gpu=30)
    assert plan.per_rank == [[[2], []], [[0], [1]]]


def test_fixed_micro_batch_size():
    plan = plan_micro_batches([3, 9, 4, 7, 5], 1, micro_batch_size=2)
    assert plan.per_rank == [[[0, 1], [2, 3], [4]]]
    plan = plan_micro_batches([3, 9, 4, 7, 5, 6], 2, micro_batch_size=2)
    assert all(len(mb) <= 2 for mbs in plan.per_rank for mb in mbs)
    assert [len(mbs) for mbs in plan.per_rank] == [2, 2]


@pytest.mark.parametrize("seed", range(40))
def test_invariants_on_random_batches(seed):
    rng = random.Random(seed)
    dp = rng.choice([1, 2, 3, 4])
    lengths = [rng.randint(1, 100) for _ in range(rng.randint(dp, 24))]
    budget = rng.choice([None, max(lengths), max(lengths) + rng.randint(0, 150)])
    plan = plan_micro_batches(lengths, dp, max_tokens_per_gpu=budget, micro_batch_size=rng.randint(1, 4))

    everything = sorted(i for r in range(dp) for i in plan.samples_of(r))
    assert everything == list(range(len(lengths)))
    assert len({len(mbs) for mbs in plan.per_rank}) == 1
    for mbs in plan.per_rank:
        if budget is not None:
            assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)
        if any(not mb for mb in mbs):
            assert all(len(mb) <= 1 for mb in mbs)
    loads = [sum(lengths[i] for i in plan.samples_of(r)) for r in range(dp)]
    counts = [len(plan.samples_of(r)) for r in range(dp)]
    assert max(counts) <= -(-len(lengths) // dp)  # at most ceil(n / dp) samples per rank
    # Longest-first greedy: no rank carries more than one (longest) sample's tokens beyond another.
    assert max(loads) - min(loads) <= max(lengths)


def test_a_too_long_sample_names_the_flag_and_the_length():
    with pytest.raises(PackingError) as info:
        plan_micro_batches([12, 40, 7, 41], 2, max_tokens_per_gpu=32)
    assert str(info.value) == (
        "--max-tokens-per-gpu 32 is smaller than one sample (sample 1 has 40 tokens); raise it to at least 41"
    )


def test_other_bad_inputs():
    with pytest.raises(PackingError, match="3 samples cannot be spread over 4 data-parallel ranks"):
        plan_micro_batches([1, 2, 3], 4)
    with pytest.raises(PackingError, match="data-parallel size must be >= 1, got 0"):
        plan_micro_batches([1, 2, 3], 0)
    with pytest.raises(PackingError, match="--micro-batch-size must be >= 1, got 0"):
        plan_micro_batches([1, 2, 3], 1, micro_batch_size=0)
