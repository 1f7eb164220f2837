"""Broadcast weight sync (split placement): a torch.distributed group of trainer rank 0 and every engine.

Rank 0 is the trainer (it hosts the group's TCPStore on a free port), engine i is rank 1 + i; gloo on CPU,
NCCL on GPU. The group is a standalone backend object (wire.py's `create_group`), not torch.distributed's
global group; its collectives are called on that object directly, each with a timeout.

Protocol:
    connect:  POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
              group_name, backend, timeout_s} to every engine, concurrently with the trainer's own join
              (each engine joins in a worker thread; its HTTP loop and engine thread keep running).
    per bucket: POST /update_weights_from_distributed {names, dtypes, shapes, group_name} to every engine
              (they start receiving), then one broadcast from rank 0 per flat dtype group (flat.py layout).
    finish:   POST /update_weights_from_distributed {names: [], group_name, finish: true, weight_version}.
    close:    POST /destroy_weights_update_group {group_name}.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import ipaddress
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from clawrl.weight_sync.base import InflightBucket, WeightSender, WeightSyncError, bucket_label
from clawrl.weight_sync.flat import describe_bucket, fill_flat, plan_flat_groups
from clawrl.weight_sync.wire import BACKENDS, broadcast_from_rank0, create_group


class BroadcastSender(WeightSender):
    """Trainer rank 0 of a broadcast group with the engines."""

    kind = "broadcast"

    def __init__(self, *, backend: str | None = None, master_address: str | None = None,
                 device: str | torch.device | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend not in BACKENDS:
            raise ValueError(f"weight sync backend must be one of {BACKENDS}, got {self.backend!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.master_address = master_address
        self.group_name = f"clawrl-weights-{uuid.uuid4().hex[:12]}"
        self._store: dist.TCPStore | None = None
        self._group: Any = None
        super().__init__(**kwargs)

    def _connect_transport(self) -> None:
        address = self.master_address or local_address_towards(self.urls)
        world_size = 1 + len(self.urls)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # Port 0: the store binds a free port itself (no race with other jobs for a pre-picked one).
        self._store = dist.TCPStore(
            address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        joins = {
            url: self.submit(
                url,
                "init_weights_update_group",
                master_address=address,
                master_port=self._store.port,
                rank_offset=1 + i,
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
            for i, url in enumerate(self.urls)
        }
        own = _in_daemon_thread(lambda: create_group(
            backend=self.backend, rank=0, world_size=world_size, group_name=self.group_name,
            timeout_s=self.timeout_s, store=self._store, device=self.device,
        ))  # fmt: skip
        self._group = self._wait_joined(joins, own)

    def _wait_joined(
        self, joins: dict[str, concurrent.futures.Future], own: concurrent.futures.Future
    ) -> Any:
        """The trainer's group once every rank joined; the first engine failure (named) otherwise."""
        pending = {*joins.values(), own}
        deadline = time.monotonic() + self.timeout_s + 30.0
        while pending:
            done, pending = concurrent.futures.wait(
                pending,
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=concurrent.futures.FIRST_EXCEPTION,
            )
            for url, future in joins.items():
                if future in done and future.exception() is not None:
                    self._result(url, future, f"init_weights_update_group (group {self.group_name})")
            if own in done and own.exception() is not None:
                raise WeightSyncError(f"weight sync: forming group {self.group_name} with {self.urls} failed: "
                                      f"{own.exception()}") from own.exception()  # fmt: skip
            if pending and time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"weight sync: group {self.group_name} not formed within {self.timeout_s:.0f} s"
                )
        return own.result()

    def _send_bucket(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> InflightBucket:
        started = time.perf_counter()
        names, dtypes, shapes = describe_bucket(bucket)
        groups = plan_flat_groups(names, dtypes, shapes)
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name}
        futures = {url: self.submit(url, "update_weights_from_distributed", **body) for url in self.urls}
        tensors = dict(bucket)
        what = bucket_label(index, bucket)
        check = functools.partial(self._first_engine_error, futures, f"receiving {what}", index)
        for group in groups:
            flat = torch.empty(group.numel, dtype=group.torch_dtype, device=self.device)
            fill_flat(group, flat, tensors)
            self._broadcast(flat, f"{what} ({group.dtype})", index, check)
        return self._inflight_bucket(index, what, futures, bucket, started)

    def _broadcast(self, payload: torch.Tensor, what: str, index: int, check: Callable[[], None]) -> None:
        """One broadcast of `payload` from rank 0 to every engine. `check` raises the first engine's own error
        (it names the engine); any other failure becomes one WeightSyncError naming `what` and the bucket."""
        try:
            broadcast_from_rank0(self._group, payload, self.timeout_s, check=check)
        except WeightSyncError:
            raise
        except Exception as error:
            # an engine that failed first explains the broken collective better than the collective itself
            check()
            raise WeightSyncError(f"weight sync: broadcast of {what} to {self.urls} failed: {error}",
                                  bucket=index) from error  # fmt: skip

    def _inflight_bucket(self, index: int, what: str, futures: dict[str, concurrent.futures.Future],
                  bucket: list[tuple[str, torch.Tensor]], started: float) -> InflightBucket:  # fmt: skip
        """The record of a bucket whose broadcasts are done and whose engine replies are awaited."""
        num_bytes = sum(t.numel() * t.element_size() for _, t in bucket)
        # nothing to release: the flat buffers are freed when the loop drops them
        return InflightBucket(index=index, what=what, futures=futures, release=lambda: None, num_bytes=num_bytes,
                              prepare_s=time.perf_counter() - started)  # fmt: skip

    def _finish_transport(self, version: str) -> dict[str, dict]:
        return self.call_all("update_weights_from_distributed", names=[], dtypes=[], shapes=[],
                             group_name=self.group_name, finish=True, weight_version=version)  # fmt: skip

    def _close_transport(self) -> None:
        if self._group is not None and self.urls:
            futures = [self.submit(url, "destroy_weights_update_group", group_name=self.group_name)
                       for url in self.urls]  # fmt: skip
            concurrent.futures.wait(futures, timeout=30.0)
        group, self._group, self._store = self._group, None, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()


def _in_daemon_thread(fn) -> concurrent.futures.Future:
    """Run fn in a daemon thread: a group join blocked on a dead peer must not keep the process alive."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, name="weight-sync-join", daemon=True).start()
    return future


def local_address_towards(urls: Sequence[str]) -> str:
    """This machine's address as the engines see it: loopback when they all are local, else the address
    of the interface that routes to the first of them (no packet is sent)."""
    hosts = [urlsplit(url).hostname or "127.0.0.1" for url in urls]
    if all(_is_loopback(host) for host in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], 9))
        return probe.getsockname()[0]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
