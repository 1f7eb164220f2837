"""The weight-sync interface: one sender per sync target, whatever the transport (interface only: the
transports subclass WeightSender in their own modules and register in clawrl/weight_sync/__init__.py).

    sender = make_sender("colocated", engine_urls=urls)    # or "broadcast" (split placement)
    sender.begin("3")                    # every engine pauses generation (requests in flight wait)
    for bucket in actor.weight_buckets(dtype):
        sender.send(bucket)              # [(HF name, tensor)], at most --update-weight-buffer-size bytes
    versions = sender.finish()           # engines flush the prefix cache, take weight_version "3", go on
    sender.close()

Only trainer rank 0 sends. `send` returns once the bucket is handed to the transport; up to
`max_inflight` buckets are in flight at once, so the trainer gathers bucket k+1 while the engines load
bucket k. A bucket's memory (shared-memory segment, CUDA buffer) is kept until every engine has
acknowledged it. Each engine gets its requests from one thread, in order.

`push_weights` (cycle.py) runs these steps for one sync on a trainer rank, and the optional checksum check.

Every wait has a deadline (`timeout_s`); every failure is a WeightSyncError naming the engine URL and the
bucket. After a failure the engines stay paused with partly updated weights: the job must stop, not
generate with them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 120.0
"""Deadline of each step of a sync (HTTP call, collective); below the engine's 300 s step watchdog."""


class WeightSyncError(RuntimeError):
    """A failed sync step; `url` is the engine (None when not engine-specific), `bucket` the bucket index."""

    def __init__(self, message: str, *, url: str | None = None, bucket: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.bucket = bucket


@dataclass
class InflightBucket:
    """A bucket handed to the transport, waiting for every engine's acknowledgement."""

    index: int
    """Bucket number within the sync (0-based)."""
    what: str
    """Short description for errors: size and first tensor."""
    futures: dict[str, concurrent.futures.Future]
    """Engine URL -> its pending reply."""
    release: Callable[[], None]
    """Frees the bucket's transport memory (unlink a segment, drop a CUDA buffer)."""
    num_bytes: int = 0
    """Bytes of tensor data in the bucket."""
    prepare_s: float = 0.0
    """Seconds spent staging the bucket (flatten, copy to shared memory, IPC handles, broadcast)."""
    sent_at: float = field(default_factory=time.perf_counter)
    """When the bucket was handed to the engines."""


class WeightSender:
    """Base of the transports: engine connections, pause/flip protocol, in-flight bookkeeping."""

    kind = ""

    def __init__(self, *, engine_urls: Sequence[str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_inflight: int = 2, client_factory: Callable[..., Any] | None = None) -> None:  # fmt: skip
        if timeout_s <= 0:
            raise ValueError(f"weight sync timeout_s must be > 0, got {timeout_s}")
        if max_inflight < 1:
            raise ValueError(f"weight sync max_inflight must be >= 1, got {max_inflight}")
        self.timeout_s = float(timeout_s)
        self.max_inflight = max_inflight
        self._client_factory = client_factory
        self.urls: list[str] = []
        self._clients: dict[str, Any] = {}
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._inflight: deque[InflightBucket] = deque()
        self._version: str | None = None
        self._num_buckets = 0
        self.stats: list[dict[str, float]] = []
        """Per bucket of the current/last sync: {"bytes", "prepare_s", "ack_s", "engine_open_s",
        "engine_load_s"} (ack_s: handed over -> every engine acknowledged, as seen when the sender next
        waits for it; engine_*: the slowest engine's own time to open/receive and to load the bucket)."""
        if engine_urls is not None:
            self.connect(engine_urls)

    # ------------------------------------------------------------------------------------------------ API

    def connect(self, engine_urls: Sequence[str]) -> None:
        """Open connections to the engines (once; broadcast also forms its process group here)."""
        if self.urls:
            raise WeightSyncError(f"{self.kind} sender is already connected to {self.urls}")
        urls = [str(url).rstrip("/") for url in engine_urls]
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"weight sync needs distinct engine URLs, got {list(engine_urls)}")
        factory = self._client_factory or _http_client
        self.urls = urls
        for i, url in enumerate(urls):
            self._clients[url] = factory(url, timeout=self.timeout_s + min(self.timeout_s, 30.0))
            self._pools[url] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"weight-sync-{i}")
        try:
            self._connect_transport()
        except BaseException:
            self.close()
            raise

    def begin(self, version: str) -> None:
        """Start a sync to weight version `version`: every engine pauses generation, keeping its requests."""
        if not self.urls:
            raise WeightSyncError(f"{self.kind} sender: call connect(engine_urls) before begin()")
        if self._version is not None:
            raise WeightSyncError(
                f"begin({version!r}): the sync to version {self._version!r} is not finished"
            )
        self.call_all("pause_generation", mode="in_place")
        self._version, self._num_buckets, self.stats = str(version), 0, []

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Hand one bucket of (HF name, tensor) to the engines; returns before they have loaded it."""
        if self._version is None:
            raise WeightSyncError(f"{self.kind} sender: send() outside begin()/finish()")
        if not bucket:
            return
        while len(self._inflight) >= self.max_inflight:
            self._retire(self._inflight[0])
        index = self._num_buckets
        self._num_buckets += 1
        self._inflight.append(self._send_bucket(index, list(bucket)))

    def finish(self) -> dict[str, str]:
        """Wait for every bucket, then flip every engine to the new version; returns url -> version."""
        if self._version is None:
            raise WeightSyncError(f"{self.kind} sender: finish() without begin()")
        while self._inflight:
            self._retire(self._inflight[0])
        version, self._version = self._version, None
        replies = self._finish_transport(version)
        versions = {url: str(reply.get("weight_version")) for url, reply in replies.items()}
        wrong = {url: v for url, v in versions.items() if v != version}
        if wrong:
            raise WeightSyncError(
                f"engines report weight versions {wrong} after a sync to version {version!r}"
            )
        return versions

    def close(self) -> None:
        """Free in-flight buckets, leave the transport, close connections (safe to call twice)."""
        while self._inflight:
            self._inflight.popleft().release()
        with contextlib.suppress(Exception):  # closing must not hide the error that made us close
            self._close_transport()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                client.close()
        self._pools.clear()
        self._clients.clear()
        self.urls = []
        self._version = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- engine calls

    def submit(self, url: str, route: str, **body: Any) -> concurrent.futures.Future:
        """Call client method `route` of one engine on its own thread (calls to an engine stay ordered)."""
        return self._pools[url].submit(getattr(self._clients[url], route), **body)

    def call_all(self, route: str, **body: Any) -> dict[str, dict]:
        """Call `route` on every engine at once and wait; url -> reply, or WeightSyncError naming the URL."""
        futures = {url: self.submit(url, route, **body) for url in self.urls}
        return {url: self._result(url, future, route) for url, future in futures.items()}

    def _result(
        self, url: str, future: concurrent.futures.Future, what: str, bucket: int | None = None
    ) -> Any:
        """The reply of one engine call; WeightSyncError naming the engine and `what` (which names the
        bucket, if any) when it failed or did not answer in time."""
        wait_s = self.timeout_s + 60.0  # beyond the client's own HTTP timeout, which reports first
        try:
            return future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(
                f"weight sync: engine {url} did not answer {what} within {wait_s:.0f} s",
                url=url,
                bucket=bucket,
            ) from None
        except Exception as error:
            raise WeightSyncError(
                f"weight sync: engine {url} failed {what}: {error}", url=url, bucket=bucket
            ) from error

    def _retire(self, entry: InflightBucket) -> None:
        """Wait for every engine's acknowledgement of `entry`, then free its memory."""
        try:
            replies = [
                self._result(url, f, f"loading {entry.what}", entry.index) for url, f in entry.futures.items()
            ]
        finally:
            self._inflight.remove(entry)
            entry.release()
        stats = {
            "bytes": float(entry.num_bytes),
            "prepare_s": entry.prepare_s,
            "ack_s": time.perf_counter() - entry.sent_at,
        }
        for key in ("open_s", "load_s"):  # the engines' own timing, slowest engine
            values = [float(r[key]) for r in replies if isinstance(r, dict) and key in r]
            if values:
                stats[f"engine_{key}"] = max(values)
        self.stats.append(stats)

    def _first_engine_error(
        self, futures: dict[str, concurrent.futures.Future], what: str, bucket: int
    ) -> None:
        """Raise the error of an engine whose call already failed (it explains a stuck collective)."""
        for url, future in futures.items():
            if future.done() and future.exception() is not None:
                self._result(url, future, what, bucket)

    # ----------------------------------------------------------------------------------- transport hooks

    def _connect_transport(self) -> None:
        """Set up the transport after the engine connections exist."""

    def _send_bucket(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> InflightBucket:
        raise NotImplementedError

    def _finish_transport(self, version: str) -> dict[str, dict]:
        raise NotImplementedError

    def _close_transport(self) -> None:
        """Leave the transport (process groups, ...)."""


def bucket_label(index: int, bucket: Sequence[tuple[str, torch.Tensor]]) -> str:
    num_bytes = sum(t.numel() * t.element_size() for _, t in bucket)
    return f"bucket {index} ({len(bucket)} tensors, {num_bytes / 2**20:.1f} MiB, first {bucket[0][0]!r})"


def _http_client(url: str, *, timeout: float) -> Any:
    from clawrl.engine.http.client import EngineClient

    return EngineClient(url, timeout=timeout)
