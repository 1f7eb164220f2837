"""RolloutTimeline: when each request of one training rollout started, came back and was rewarded, and the
phases of the rollout those timestamps show (where a rollout's seconds go, beyond its total).

    timeline = RolloutTimeline(started=time.monotonic())
    timeline.add(sent, generated, rewarded)     # one span per generate-function call (GroupGenerator.sample)
    timeline.add_engine_call(sent, back, items) # one per /generate call of the default generate function
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

The answer path of the /generate calls, from the stamps a clawrl engine puts in each answer's meta_info
(received_at, finished_at, answered_at: time.monotonic() on the engine's host). One call is one HTTP request
(the default generate function sends a prompt group's samples as one batch); medians over the calls:

    perf/rollout_request_send_time     call sent -> the engine's handler had it (HTTP request, body parsing)
    perf/rollout_request_engine_time   handler had it -> the engine finished the call's last sample (queue,
                                       prefill, decode)
    perf/rollout_request_answer_time   engine finished -> the answer built (engine thread to event loop, text,
                                       per-item dicts)
    perf/rollout_request_return_time   answer built -> back in the generate function (JSON encoding, HTTP
                                       response, the client's parsing, the rollout's event loop)
    perf/rollout_last_answer_time      the call that came back last: engine finished -> back in the rollout
                                       (the answer path on the rollout's critical path)

They need the client and the engine on one host (Linux's CLOCK_MONOTONIC is shared by its processes) and
answers with the stamps (not an external SGLang server): otherwise they are left out, as they are when a
stamp is later than the client's own clock says possible (other hosts).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

FULL_FRACTION = 0.9
"""Share of the rollout's requests that counts as "the whole batch" for ramp, steady and tail."""
CLOCK_SLACK_S = 0.001
"""How far an engine stamp may fall outside the client's [sent, back] before the clocks count as unshared."""


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
class EngineCall:
    """One /generate call's answer path (monotonic seconds; received / finished / answered from the engine)."""

    sent: float
    received: float
    finished: float
    answered: float
    back: float

    @classmethod
    def of(cls, sent: float, back: float, items: Iterable[Any]) -> EngineCall | None:
        """From the call's answer items (dicts with meta_info); None when an item lacks a stamp."""
        stamps: dict[str, list[float]] = {"received_at": [], "finished_at": [], "answered_at": []}
        for item in items:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            for key, values in stamps.items():
                value = meta.get(key) if isinstance(meta, dict) else None
                if not isinstance(value, (int, float)):
                    return None
                values.append(float(value))
        if not stamps["received_at"]:
            return None
        return cls(sent=sent, received=min(stamps["received_at"]), finished=max(stamps["finished_at"]),
                   answered=max(stamps["answered_at"]), back=back)  # fmt: skip

    @property
    def shares_clock(self) -> bool:
        """Whether the stamps fit inside [sent, back] on the client's clock (same host)."""
        return self.sent - CLOCK_SLACK_S <= self.received <= self.answered <= self.back + CLOCK_SLACK_S


@dataclass(kw_only=True)
class RolloutTimeline:
    """The request spans of one training rollout (filled by GroupGenerator, read by the RolloutManager)."""

    started: float
    """Monotonic time the rollout started."""
    spans: list[RequestSpan] = field(default_factory=list)
    """One per generate-function call, in the order they finished."""
    engine_calls: list[EngineCall] = field(default_factory=list)
    """One per /generate call whose answer carried the engine's stamps."""

    def add(self, sent: float, generated: float, rewarded: float | None = None) -> None:
        self.spans.append(RequestSpan(sent=sent, generated=generated, rewarded=rewarded))

    def add_engine_call(self, sent: float, back: float, items: Iterable[Any]) -> None:
        """One /generate call sent at `sent` and answered with `items` at `back` (kept when stamped)."""
        call = EngineCall.of(sent, back, items)
        if call is not None:
            self.engine_calls.append(call)

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
        out.update(answer_path_metrics(self.engine_calls))
        return out


def answer_path_metrics(calls: list[EngineCall]) -> dict[str, float]:
    """The module docstring's perf/rollout_request_* and perf/rollout_last_answer_time; {} without calls or
    when any call's stamps do not fit the client's clock."""
    if not calls or not all(c.shares_clock for c in calls):
        return {}
    last = max(calls, key=lambda c: c.back)
    return {
        "perf/rollout_request_send_time": statistics.median(c.received - c.sent for c in calls),
        "perf/rollout_request_engine_time": statistics.median(c.finished - c.received for c in calls),
        "perf/rollout_request_answer_time": statistics.median(c.answered - c.finished for c in calls),
        "perf/rollout_request_return_time": statistics.median(c.back - c.answered for c in calls),
        "perf/rollout_last_answer_time": last.back - last.finished,
    }


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
