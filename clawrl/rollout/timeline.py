"""RolloutTimeline: when each request of one training rollout started, came back and was rewarded, and the
phases of the rollout those timestamps show (where a rollout's seconds go, beyond its total).

    timeline = RolloutTimeline(started=time.monotonic())
    timeline.add(sent, generated, rewarded)     # one span per generate-function call (GroupGenerator.sample)
    metrics = timeline.metrics(ended=time.monotonic())

A request is "in flight" from the moment the rollout hands it to the generate function until that function
returns (HTTP round trip, engine queueing and decoding included). With N requests and k = ceil(90% of N):

    perf/rollout_first_sample_time   rollout start -> the first generation came back
    perf/rollout_ramp_time           rollout start -> k requests in flight at once (how fast the batch fills)
    perf/rollout_steady_time         how long >= k requests were in flight (the batch decodes together)
    perf/rollout_tail_time           the k-th generation came back -> the last one came back
    perf/rollout_generate_time       rollout start -> the last generation came back
    perf/rollout_reward_time         sum of the reward calls' durations (they overlap generation: not wall time)
    perf/rollout_reward_tail_time    the last generation came back -> the last reward was computed (the reward
                                     on the critical path)
    perf/rollout_finish_time         the last generation or reward -> the rollout's end (grouping, batch, metrics)
    perf/rollout_max_in_flight       the most requests in flight at once (not a time)

Ramp and steady are left out when the rollout never had k requests in flight (e.g. an engine concurrency limit
below the batch): then max_in_flight says how full it got. All times are in seconds on one monotonic clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FULL_FRACTION = 0.9
"""Share of the rollout's requests that counts as "the whole batch" for ramp, steady and tail."""


@dataclass(kw_only=True)
class RequestSpan:
    """One generate-function call of a training rollout (monotonic seconds)."""

    sent: float
    """When the rollout handed the sample to the generate function."""
    generated: float
    """When the generate function returned."""
    rewarded: float | None = None
    """When the reward function returned (None: no reward was computed, e.g. an aborted sample)."""


@dataclass(kw_only=True)
class RolloutTimeline:
    """The request spans of one training rollout (filled by GroupGenerator, read by the RolloutManager)."""

    started: float
    """Monotonic time the rollout started."""
    spans: list[RequestSpan] = field(default_factory=list)
    """One per generate-function call, in the order they finished."""

    def add(self, sent: float, generated: float, rewarded: float | None = None) -> None:
        self.spans.append(RequestSpan(sent=sent, generated=generated, rewarded=rewarded))

    def metrics(self, ended: float) -> dict[str, float]:
        """The module docstring's perf/rollout_* phases; {} when no request was made."""
        if not self.spans:
            return {}
        generated = sorted(s.generated for s in self.spans)
        rewarded = [s.rewarded for s in self.spans if s.rewarded is not None]
        full = max(1, math.ceil(FULL_FRACTION * len(self.spans)))
        last = max([generated[-1], *rewarded])
        out = {
            "perf/rollout_first_sample_time": generated[0] - self.started,
            "perf/rollout_tail_time": generated[-1] - generated[full - 1],
            "perf/rollout_generate_time": generated[-1] - self.started,
            "perf/rollout_reward_time": sum(
                s.rewarded - s.generated for s in self.spans if s.rewarded is not None
            ),
            "perf/rollout_reward_tail_time": last - generated[-1],
            "perf/rollout_finish_time": ended - last,
        }
        first_full, steady, peak = _in_flight(self.spans, full)
        out["perf/rollout_max_in_flight"] = float(peak)
        if first_full is not None:
            out["perf/rollout_ramp_time"] = first_full - self.started
            out["perf/rollout_steady_time"] = steady
        return out


def _in_flight(spans: list[RequestSpan], full: int) -> tuple[float | None, float, int]:
    """(first time >= `full` requests were in flight or None, total time they were, peak count)."""
    # At equal times a return is counted before a send: a request is not in flight at its own end.
    events = sorted([(s.sent, 1) for s in spans] + [(s.generated, -1) for s in spans])
    count = peak = 0
    first_full, steady, since = None, 0.0, None
    for at, change in events:
        count += change
        peak = max(peak, count)
        if count >= full and since is None:
            since = at
            first_full = at if first_full is None else first_full
        elif count < full and since is not None:
            steady += at - since
            since = None
    return first_full, steady, peak
