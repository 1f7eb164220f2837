"""Broadcast weight sync in SGLang's own payloads: what an SGLang v0.5 server (or a clawrl engine) takes.

Used for engines clawrl did not start (`--rollout-external-engine-addrs`, clawrl/cluster/external_engines.py).
The group is formed as in broadcast.py (trainer rank 0 hosts the TCP store, engine i is rank 1 + i; gloo on
CPU, NCCL on GPU); the messages are SGLang's, field for field, as slime sends them:

    begin:      POST /pause_generation {"mode": "in_place"}         (SGLang before 0.5.3 ignores mode: abort)
    connect:    POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
                group_name, backend}
    per bucket: POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache: false}
                then one broadcast from rank 0 per tensor, in `names` order (SGLang's receive loop)
    finish:     POST /update_weights_from_distributed {names: [], ..., weight_version, flush_cache: true}
                (the version flips, the prefix cache is flushed), POST /continue_generation, and
                GET /get_weight_version to confirm the version
    close:      POST /destroy_weights_update_group {group_name}

    sender = make_sender("sglang_distributed", engine_urls=["http://10.0.0.5:30000"])
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from clawrl.weight_sync.base import InflightBucket, bucket_label
from clawrl.weight_sync.broadcast import BroadcastSender
from clawrl.weight_sync.flat import describe_bucket


def sglang_client(url: str, *, timeout: float) -> Any:
    """An HTTP client of `url` whose weight-update methods send SGLang's request bodies exactly."""
    from clawrl.engine.http.client import EngineClient

    class SglangClient(EngineClient):
        def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                      world_size: int, group_name: str, backend: str = "nccl",
                                      timeout_s: float | None = None, timeout: float | None = None) -> Any:  # fmt: skip
            # timeout_s is clawrl's extension: SGLang has no such field (its group uses its own default)
            body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                    "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
            return self._call("POST", "/init_weights_update_group", body, timeout=timeout)

        def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                            shapes: list[list[int]], group_name: str, flush_cache: bool = True,
                                            weight_version: str | None = None,
                                            timeout: float | None = None) -> Any:  # fmt: skip
            body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                    "flush_cache": flush_cache}  # fmt: skip
            if weight_version is not None:
                body["weight_version"] = weight_version
            return self._call("POST", "/update_weights_from_distributed", body, timeout=timeout)

    return SglangClient(url, timeout=timeout)


class SglangDistributedSender(BroadcastSender):
    """Trainer rank 0 of a broadcast group with SGLang-compatible engines (module docstring)."""

    kind = "sglang_distributed"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("client_factory", sglang_client)
        super().__init__(**kwargs)

    def _send_bucket(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> InflightBucket:
        started = time.perf_counter()
        names, dtypes, shapes = describe_bucket(bucket)
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                "flush_cache": False}  # fmt: skip
        futures = {url: self.submit(url, "update_weights_from_distributed", **body) for url in self.urls}
        what = bucket_label(index, bucket)
        check = functools.partial(self._first_engine_error, futures, f"receiving {what}", index)
        for name, tensor in bucket:
            payload = tensor.detach().to(self.device).contiguous()
            self._broadcast(payload, f"{name!r} in {what}", index, check)
        return self._inflight_bucket(index, what, futures, bucket, started)

    def _finish_transport(self, version: str) -> dict[str, dict]:
        self.call_all("update_weights_from_distributed", names=[], dtypes=[], shapes=[],
                      group_name=self.group_name, flush_cache=True, weight_version=version)  # fmt: skip
        self.call_all("continue_generation")
        return self.call_all("get_weight_version")
