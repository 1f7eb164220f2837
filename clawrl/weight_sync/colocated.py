"""Colocated weight sync: trainer and engine on the same machine (and device), tensors passed by handle.

Per bucket, one flat tensor per dtype (clawrl.weight_sync.flat) is written into memory the engine can map:
- CPU tensors: a fresh POSIX shared-memory segment per dtype (/dev/shm). The engine maps it, builds views,
  copies them into its parameters and acknowledges; the sender then unlinks the segment.
- CUDA tensors: a fresh CUDA buffer per dtype, shared as a CUDA IPC handle (torch's `reduce_tensor`,
  sent as JSON, no pickle). The engine opens the handle, copies device to device straight into its fused
  parameters, synchronizes, acknowledges; only then does the sender drop the buffer. A fresh buffer per
  bucket (never a reused one) means no bucket can overwrite memory an engine is still reading.

Wire format, `POST /update_weights_from_tensor`:

    {"transport": "shared_memory" | "cuda_ipc", "names": [...], "dtypes": [...], "shapes": [[...], ...],
     "handles": [one per flat dtype group, in layout order], "finish": false, "weight_version": null}

The handles, and the engine's code that opens them, are in wire.py. The last message of a sync has no
tensors and "finish": true (see base.py).
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing import shared_memory

import torch

from clawrl.weight_sync.base import InflightBucket, WeightSender, bucket_label
from clawrl.weight_sync.flat import FlatGroup, describe_bucket, fill_flat, plan_flat_groups
from clawrl.weight_sync.wire import encode_cuda_ipc, map_segment, new_segment_name


class ColocatedSender(WeightSender):
    """Passes buckets by shared-memory segment (CPU tensors) or CUDA IPC handle (CUDA tensors)."""

    kind = "colocated"

    def _send_bucket(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> InflightBucket:
        started = time.perf_counter()
        names, dtypes, shapes = describe_bucket(bucket)
        groups = plan_flat_groups(names, dtypes, shapes)
        tensors = dict(bucket)
        device = _single_device(bucket)
        if device.type == "cuda":
            transport, handles, release = _stage_cuda(groups, tensors, device)
        else:
            transport, handles, release = _stage_shared_memory(groups, tensors)
        body = {
            "transport": transport,
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "handles": handles,
        }
        prepare_s = time.perf_counter() - started
        futures = {url: self.submit(url, "update_weights_from_tensor", **body) for url in self.urls}
        num_bytes = sum(t.numel() * t.element_size() for _, t in bucket)
        return InflightBucket(
            index=index, what=bucket_label(index, bucket), futures=futures, release=release,
            num_bytes=num_bytes, prepare_s=prepare_s,
        )  # fmt: skip

    def _finish_transport(self, version: str) -> dict[str, dict]:
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # reclaim CUDA buffers whose IPC references the engines have dropped
        return self.call_all("update_weights_from_tensor", transport="shared_memory", names=[], dtypes=[],
                             shapes=[], handles=[], finish=True, weight_version=version)  # fmt: skip


def _single_device(bucket: list[tuple[str, torch.Tensor]]) -> torch.device:
    devices = {tensor.device for _, tensor in bucket}
    if len(devices) != 1:
        raise ValueError(f"a weight-sync bucket must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


# --------------------------------------------------------------------------------------- shared memory


def _stage_shared_memory(groups: list[FlatGroup], tensors: dict[str, torch.Tensor]):
    """Write each group into a fresh segment; returns (transport, handles, release)."""
    segments: list[shared_memory.SharedMemory] = []

    def release() -> None:
        for segment in segments:
            with contextlib.suppress(FileNotFoundError):  # already unlinked
                segment.unlink()
        segments.clear()

    try:
        for group in groups:
            segment = shared_memory.SharedMemory(
                name=new_segment_name(), create=True, size=max(1, group.nbytes)
            )
            segment.close()  # we write through our own mapping below; the segment lives until unlink
            segments.append(segment)
            if group.numel:
                fill_flat(group, map_segment(segment.name, group), tensors)
    except BaseException:
        release()
        raise
    handles = [{"name": s.name, "nbytes": g.nbytes} for s, g in zip(segments, groups, strict=True)]
    return "shared_memory", handles, release


# --------------------------------------------------------------------------------------------- CUDA IPC


def _stage_cuda(groups: list[FlatGroup], tensors: dict[str, torch.Tensor], device: torch.device):
    flats = [torch.empty(group.numel, dtype=group.torch_dtype, device=device) for group in groups]
    for group, flat in zip(groups, flats, strict=True):
        fill_flat(group, flat, tensors)
    # The handle carries an event recorded after these copies: the engine's reads wait for them.
    handles = [encode_cuda_ipc(flat) for flat in flats]
    return "cuda_ipc", handles, flats.clear
