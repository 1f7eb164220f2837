"""Partial rollouts (--partial-rollout) and the weight-staleness bound (--max-weight-staleness).

When a rollout has its --rollout-batch-size groups, the over-sampled groups still in flight are aborted on
the engines. Each aborted request comes back with the tokens it had generated so far (token ids, rollout
log-probs, loss mask, and the weight version of that segment in `Sample.weight_versions`). With
--partial-rollout those groups go back to the data source's buffer instead of being thrown away:

    rollout k:    collect ... abort leftovers -> requeue(leftovers, k)   (metadata["start_rollout_id"] = k)
    rollout k+1:  take_groups(...) serves the buffer first -> prepare_resume() -> generate continues
                  from prompt + partial response (the default generate sends `sample.tokens`)

so a finished resumed sample holds every segment: tokens and log-probs concatenated, one weight version
per segment (["3", "4"]: started on version 3, finished on 4). Samples of a leftover group that had
already finished keep their response and reward and are not generated again.

Staleness. The loops keep the trainer's weight version equal to the id of the rollout it trains next
(rollout k is trained by weights after k updates), so a sample of rollout k is `k - oldest version` stale.
A resumed group whose oldest segment is already more than --max-weight-staleness K versions behind is
dropped when it is taken from the buffer (counted in rollout/partial/dropped_stale_groups; its prompt stays
consumed) and a fresh group takes its place. Freshly generated samples never exceed K: in train-async they
are up to --update-weights-interval N versions stale (0 in train), and the flag rules require K >= N (and
K >= 2 in train-async, 1 in train: a sample resumed one rollout later is one version staler than it was
fresh, so a smaller K would drop nearly every partial one). If one does anyway, `check_staleness` raises one error instead of training on it. Versions that
are not integers (an external engine's names) carry no order and are not checked.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from clawrl.data.sample import Sample, Status

START_ROLLOUT_KEY = "start_rollout_id"  # slime's metadata key: the rollout that started a requeued sample


@dataclass(kw_only=True)
class PartialStats:
    """What partial rollouts did in one rollout (logged as rollout/partial/*)."""

    num_requeued_groups: int = 0
    """Leftover groups put back into the buffer at the end of the rollout."""
    num_resumed_samples: int = 0
    """Samples taken from the buffer that had response tokens from an earlier rollout."""
    num_dropped_stale_groups: int = 0
    """Buffered groups dropped because their oldest segment was more than K versions stale."""


def oldest_version(sample: Sample) -> int | None:
    """The oldest integer weight version among the sample's segments (None: none, or not integers)."""
    try:
        versions = [int(v) for v in sample.weight_versions]
    except ValueError:
        return None
    return min(versions) if versions else None


def staleness(sample: Sample, policy_version: int) -> int | None:
    """How many versions the sample's oldest segment is behind `policy_version` (None when unknown)."""
    oldest = oldest_version(sample)
    return None if oldest is None else policy_version - oldest


def prepare_resume(sample: Sample, *, mask_offpolicy: bool) -> bool:
    """Make an ABORTED sample generate again, continuing its partial response; True if it had one.

    With `mask_offpolicy` the tokens it already has get loss mask 0 (slime's
    --mask-offpolicy-in-partial-rollout). Finished samples are left alone (they are not generated again).
    """
    if sample.status != Status.ABORTED:
        return False
    sample.status = Status.PENDING
    if mask_offpolicy and sample.response_length:
        sample.loss_mask = [0] * sample.response_length
    return sample.response_length > 0


def take_groups(
    get_samples: Callable[[int], list[list[Sample]]],
    num_groups: int,
    *,
    policy_version: int | None,
    max_staleness: int | None,
    mask_offpolicy: bool,
    stats: PartialStats,
) -> list[list[Sample]]:
    """`num_groups` groups from the data source (buffer first), requeued ones made ready to resume and the
    too-stale ones replaced by further groups."""
    taken: list[list[Sample]] = []
    while len(taken) < num_groups:
        groups = get_samples(num_groups - len(taken))
        assert groups, "the data source handed out no groups"
        for group in groups:
            if _too_stale(group, policy_version, max_staleness):
                stats.num_dropped_stale_groups += 1
                continue
            stats.num_resumed_samples += sum(prepare_resume(s, mask_offpolicy=mask_offpolicy) for s in group)
            taken.append(group)
    return taken


def _too_stale(group: list[Sample], policy_version: int | None, max_staleness: int | None) -> bool:
    if policy_version is None or max_staleness is None:
        return False
    lags = [staleness(s, policy_version) for s in group]
    return any(lag is not None and lag > max_staleness for lag in lags)


def requeue(groups: list[list[Sample]], rollout_id: int, add_samples: Callable, stats: PartialStats) -> None:
    """Put leftover groups back into the buffer, each sample tagged with the rollout that started it."""
    for group in groups:
        for sample in group:
            sample.metadata.setdefault(START_ROLLOUT_KEY, rollout_id)
    add_samples(groups)
    stats.num_requeued_groups += len(groups)


def check_staleness(samples: list[Sample], policy_version: int, max_staleness: int) -> None:
    """Raise if a sample about to be trained is more than `max_staleness` versions behind the trainer."""
    for sample in samples:
        lag = staleness(sample, policy_version)
        if lag is not None and lag > max_staleness:
            raise RuntimeError(
                f"sample {sample.index} was generated by weight versions {sample.weight_versions}, {lag} "
                f"behind the trainer's version {policy_version}: more than --max-weight-staleness "
                f"{max_staleness}. The engines serve older weights than the loop allows; this is a bug "
                "in the loop's weight sync (or the engines' versions were changed outside clawrl)"
            )


def staleness_metrics(samples: list[Sample], policy_version: int | None) -> dict[str, float]:
    """rollout/weight_staleness/{max,mean} over samples with integer versions; {} when none has one."""
    if policy_version is None:
        return {}
    lags = [lag for lag in (staleness(s, policy_version) for s in samples) if lag is not None]
    if not lags:
        return {}
    return {
        "rollout/weight_staleness/max": float(max(lags)),
        "rollout/weight_staleness/mean": statistics.fmean(lags),
    }


def partial_metrics(stats: PartialStats) -> dict[str, float]:
    """rollout/partial/* of one rollout (only logged with --partial-rollout)."""
    return {
        "rollout/partial/requeued_groups": float(stats.num_requeued_groups),
        "rollout/partial/resumed_samples": float(stats.num_resumed_samples),
        "rollout/partial/dropped_stale_groups": float(stats.num_dropped_stale_groups),
    }
