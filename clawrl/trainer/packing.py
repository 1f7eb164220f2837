"""Plan which samples each data-parallel rank trains on, and how they are grouped into micro-batches.

The plan is a pure function of the sample lengths and the flags, so every rank computes the same plan with no
communication. Guarantees:
- samples are spread over ranks balancing token counts (longest first, to the least-loaded rank);
- with `--use-dynamic-batch-size`, each micro-batch holds at most `--max-tokens-per-gpu` tokens (first-fit
  decreasing), otherwise `--micro-batch-size` samples;
- every rank gets the same number of micro-batches (FSDP runs collectives in every forward and backward,
  so a rank with fewer micro-batches would hang the others); ranks short of micro-batches split their
  largest ones, and if nothing can be split they get empty micro-batches, run as a zero-weight dummy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PackingError(ValueError):
    """A sample or batch that cannot be packed under the given flags."""


@dataclass(kw_only=True)
class MicroBatchPlan:
    """Sample indices (into the step's sample list) per rank, per micro-batch: plan[rank][mb] -> [i, ...]."""

    per_rank: list[list[list[int]]]
    """per_rank[r][m] = indices of the samples in micro-batch m of rank r (possibly empty: a dummy)."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.per_rank[0])

    def samples_of(self, rank: int) -> list[int]:
        """All sample indices of one rank, in micro-batch order."""
        return [i for mb in self.per_rank[rank] for i in mb]


def plan_micro_batches(
    lengths: Sequence[int],
    dp_size: int,
    *,
    max_tokens_per_gpu: int | None = None,
    micro_batch_size: int = 1,
) -> MicroBatchPlan:
    """Assign samples (given their total token lengths) to ranks and micro-batches; see the module doc."""
    if dp_size < 1:
        raise PackingError(f"data-parallel size must be >= 1, got {dp_size}")
    if len(lengths) < dp_size:
        raise PackingError(
            f"{len(lengths)} samples cannot be spread over {dp_size} data-parallel ranks; "
            "raise --global-batch-size or use fewer trainer GPUs"
        )
    if max_tokens_per_gpu is not None:
        too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens_per_gpu]
        if too_long:
            i, n = too_long[0]
            raise PackingError(
                f"--max-tokens-per-gpu {max_tokens_per_gpu} is smaller than one sample "
                f"(sample {i} has {n} tokens); raise it to at least {max(n for _, n in too_long)}"
            )
    elif micro_batch_size < 1:
        raise PackingError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    per_rank_samples = _balance_over_ranks(lengths, dp_size)
    per_rank = [
        _pack_dynamic(idx, lengths, max_tokens_per_gpu)
        if max_tokens_per_gpu is not None
        else [idx[s : s + micro_batch_size] for s in range(0, len(idx), micro_batch_size)]
        for idx in per_rank_samples
    ]
    target = max(len(mbs) for mbs in per_rank)
    for mbs in per_rank:
        _split_until(mbs, target, lengths)
    return MicroBatchPlan(per_rank=per_rank)


def _balance_over_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Longest-first greedy: each sample goes to the rank with the fewest tokens (ties: fewest samples).

    Each rank's count is capped at ceil(n / dp), so no rank collects many short samples while others
    hold a few long ones (per-rank work has a per-sample part too). Token loads then differ by at most
    one sample's length (tests/unit/test_trainer_packing.py checks it on random batches).
    """
    cap = -(-len(lengths) // dp_size)
    loads = [[0, 0, r] for r in range(dp_size)]  # tokens, samples, rank
    assigned: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_ranks = [load for load in loads if load[1] < cap]
        load = min(open_ranks)
        load[0] += lengths[i]
        load[1] += 1
        assigned[load[2]].append(i)
    return [sorted(idx) for idx in assigned]


def _pack_dynamic(indices: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing into bins of at most `max_tokens` tokens; bins keep sample order inside."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _split_until(mbs: list[list[int]], target: int, lengths: Sequence[int]) -> None:
    """Split the micro-batch with the most tokens (that has >= 2 samples) until there are `target`."""
    while len(mbs) < target:
        splittable = [m for m in mbs if len(m) >= 2]
        if not splittable:
            mbs.extend([] for _ in range(target - len(mbs)))
            return
        big = max(splittable, key=lambda m: (sum(lengths[i] for i in m), -m[0]))
        half = len(big) // 2
        pos = mbs.index(big)
        mbs[pos : pos + 1] = [big[:half], big[half:]]
