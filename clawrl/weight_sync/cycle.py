"""One weight sync from start to end, as each trainer rank runs it: gather, send, flip, optionally verify.

    transport = Transport(kind=plan.weight_transport, engine_urls=urls)      # driver, from the placement plan
    metrics = push_weights(transport if rank == 0 else None, actor.weight_buckets(dtype), "3",
                           checksums=lambda: actor.checksums(dtype))        # every rank, in lock step

Every rank iterates the buckets: gathering each sharded tensor is a collective that all ranks join in the
same order. Only rank 0 holds a sender: it pauses the engines (begin), hands them each bucket (send),
waits for every acknowledgement and flips their weight version (finish), and closes the sender whatever
happened. With `checksums` (--check-weight-update-equal) every rank then computes the trainer's per-tensor
checksums (a collective too) and rank 0 compares them with those of every engine it synced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from clawrl.weight_sync import SENDERS, make_sender, verify_engine_weights

Bucket = Sequence[tuple[str, torch.Tensor]]
"""(HF name, full tensor) pairs, at most --update-weight-buffer-size bytes."""


@dataclass(kw_only=True)
class Transport:
    """Where and how one sync sends: plain and picklable, built by the driver from the placement plan."""

    kind: str
    """A transport of SENDERS: "colocated" or "broadcast" (the plan's `weight_transport`)."""
    engine_urls: list[str]
    """The engines to sync: all of them, or one that was just restarted."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of the sender (timeout_s, max_inflight, backend, ...)."""

    def __post_init__(self) -> None:
        if self.kind not in SENDERS:
            raise ValueError(f"weight sync transport must be one of {tuple(SENDERS)}, got {self.kind!r}")
        self.engine_urls = list(self.engine_urls)


def push_weights(
    transport: Transport | None,
    buckets: Iterable[Bucket],
    version: str,
    *,
    checksums: Callable[[], Mapping[str, str]] | None = None,
) -> dict[str, float]:
    """One sync to weight version `version` on one trainer rank (`transport` on rank 0, None elsewhere).

    Returns perf/update_weights_bytes and perf/update_weights_time (connect to close, the version flip
    included) and, with `checksums`, perf/check_weight_update_time. Raises WeightSyncError naming the
    engine and bucket, or WeightMismatchError naming the engines and tensors that differ."""
    started = time.perf_counter()
    timed_buckets = _TimedIterator(buckets)
    num_bytes = _send_all(transport, timed_buckets, str(version))
    metrics = {
        "perf/update_weights_bytes": float(num_bytes),
        "perf/update_weights_time": time.perf_counter() - started,
        # Of which: producing the buckets (onload, gather, cast to the engine dtype) on this rank.
        "perf/update_weights_gather_time": timed_buckets.seconds,
    }
    if checksums is not None:
        started = time.perf_counter()
        trainer_checksums = checksums()  # every rank: the gather is collective
        if transport is not None:
            verify_engine_weights(transport.engine_urls, trainer_checksums, expected_version=str(version))
        metrics["perf/check_weight_update_time"] = time.perf_counter() - started
    return metrics


def _send_all(transport: Transport | None, buckets: Iterable[Bucket], version: str) -> int:
    """Bytes of every bucket; rank 0 sends them to the engines and flips their version."""
    if transport is None:
        return sum(_num_bytes(bucket) for bucket in buckets)
    sender = make_sender(transport.kind, engine_urls=transport.engine_urls, **transport.options)
    num_bytes = 0
    try:
        sender.begin(version)
        for bucket in buckets:
            sender.send(bucket)
            num_bytes += _num_bytes(bucket)
        sender.finish()
    finally:
        sender.close()  # frees in-flight buckets and leaves the broadcast group, also after a failure
    return num_bytes


class _TimedIterator:
    """Iterates `items`, adding up the seconds spent inside the producer (its generator's code)."""

    def __init__(self, items: Iterable[Bucket]):
        self._items = iter(items)
        self.seconds = 0.0

    def __iter__(self):
        return self

    def __next__(self) -> Bucket:
        started = time.perf_counter()
        try:
            return next(self._items)
        finally:
            self.seconds += time.perf_counter() - started


def _num_bytes(bucket: Bucket) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
