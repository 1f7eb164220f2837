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

shared_memory handle: {"name": "clawrl_w_<hex>", "nbytes": int}; cuda_ipc handle: see `encode_cuda_ipc`.
The last message of a sync has no tensors and "finish": true (see base.py).
"""

from __future__ import annotations

import base64
import contextlib
import math
import re
import time
import uuid
from multiprocessing import shared_memory
from typing import Any

import torch

from clawrl.weight_sync.base import InflightBucket, WeightSender, bucket_label
from clawrl.weight_sync.flat import (
    FlatGroup,
    describe_bucket,
    dtype_name,
    fill_flat,
    parse_dtype,
    plan_flat_groups,
)

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments
_SHM_NAME = re.compile(r"^clawrl_w_[0-9a-f]{32}$")
_IPC_FIELDS = (
    "tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_size_bytes",
    "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)  # fmt: skip
"""The arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor, in order."""


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
                name=f"clawrl_w_{uuid.uuid4().hex}", create=True, size=max(1, group.nbytes)
            )
            segment.close()  # we write through our own mapping below; the segment lives until unlink
            segments.append(segment)
            if group.numel:
                fill_flat(group, _map_segment(segment.name, group), tensors)
    except BaseException:
        release()
        raise
    handles = [{"name": s.name, "nbytes": g.nbytes} for s, g in zip(segments, groups, strict=True)]
    return "shared_memory", handles, release


def _map_segment(name: str, group: FlatGroup) -> torch.Tensor:
    """The segment `name` mapped (shared, writable) as a 1-D tensor of the group's dtype and length."""
    return torch.from_file(f"{SHM_DIR}/{name}", shared=True, size=group.numel, dtype=group.torch_dtype)


def open_shared_memory(handle: Any, group: FlatGroup) -> torch.Tensor:
    """Receiver: map the segment of a shared_memory handle; ValueError for a malformed handle."""
    if not isinstance(handle, dict) or not _SHM_NAME.match(str(handle.get("name", ""))):
        raise ValueError(
            f"handles: a shared_memory handle is {{'name': 'clawrl_w_<32 hex>', 'nbytes'}}, got {handle!r}"
        )
    if not isinstance(handle.get("nbytes"), int) or handle["nbytes"] < group.nbytes:
        raise ValueError(f"handles: segment {handle['name']} has nbytes={handle.get('nbytes')!r}, "
                         f"the {group.dtype} tensors need {group.nbytes}")  # fmt: skip
    if not group.numel:
        return torch.empty(0, dtype=group.torch_dtype)
    try:
        return _map_segment(handle["name"], group)
    except RuntimeError as error:  # torch reports a missing file as a RuntimeError
        raise ValueError(f"handles: cannot map shared-memory segment {handle['name']}: {error}") from None


# --------------------------------------------------------------------------------------------- CUDA IPC


def _stage_cuda(groups: list[FlatGroup], tensors: dict[str, torch.Tensor], device: torch.device):
    flats = [torch.empty(group.numel, dtype=group.torch_dtype, device=device) for group in groups]
    for group, flat in zip(groups, flats, strict=True):
        fill_flat(group, flat, tensors)
    # The handle carries an event recorded after these copies: the engine's reads wait for them.
    handles = [encode_cuda_ipc(flat) for flat in flats]
    return "cuda_ipc", handles, flats.clear


def encode_cuda_ipc(tensor: torch.Tensor) -> dict[str, Any]:
    """A CUDA tensor as a JSON-safe IPC handle: torch's rebuild arguments, bytes as base64, the device
    also by UUID (processes may number the same GPU differently under CUDA_VISIBLE_DEVICES)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(tensor.detach())
    if rebuild is not rebuild_cuda_tensor or len(args) != len(_IPC_FIELDS):
        raise RuntimeError(
            f"torch {torch.__version__}: reduce_tensor changed its CUDA format; update encode_cuda_ipc"
        )
    fields = dict(zip(_IPC_FIELDS, args, strict=True))
    return {
        "device": int(fields["device"]),
        "device_uuid": str(torch.cuda.get_device_properties(fields["device"]).uuid),
        "size": list(fields["size"]), "stride": list(fields["stride"]), "offset": int(fields["offset"]),
        "dtype": dtype_name(fields["dtype"]),
        "handle": _b64(fields["handle"]),
        "storage_size_bytes": int(fields["storage_size_bytes"]),
        "storage_offset_bytes": int(fields["storage_offset_bytes"]),
        "ref_counter_handle": _b64(fields["ref_counter_handle"]),
        "ref_counter_offset": int(fields["ref_counter_offset"]),
        "event_handle": _b64(fields["event_handle"]),
        "event_sync_required": bool(fields["event_sync_required"]),
    }  # fmt: skip


def open_cuda_ipc(handle: Any, group: FlatGroup, default_device: torch.device) -> torch.Tensor:
    """Receiver: the CUDA tensor behind an IPC handle (must be opened by another process than its maker)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        dtype = parse_dtype(handle["dtype"], field_name="handles[].dtype")
        args = (
            torch.Tensor, tuple(handle["size"]), tuple(handle["stride"]), int(handle["offset"]),
            torch.UntypedStorage, dtype, _local_device(handle, default_device), _unb64(handle["handle"]),
            int(handle["storage_size_bytes"]), int(handle["storage_offset_bytes"]), False,
            _unb64(handle["ref_counter_handle"]), int(handle["ref_counter_offset"]),
            _unb64(handle["event_handle"]), bool(handle["event_sync_required"]),
        )  # fmt: skip
    except (KeyError, TypeError) as error:
        raise ValueError(f"handles: malformed cuda_ipc handle ({error!r})") from None
    if dtype != group.torch_dtype or math.prod(handle["size"]) < group.numel:
        raise ValueError(f"handles: cuda_ipc tensor {handle['dtype']}{handle['size']} does not hold the bucket's "
                         f"{group.numel} {group.dtype} elements")  # fmt: skip
    return rebuild_cuda_tensor(*args)


def _local_device(handle: dict, default_device: torch.device) -> int:
    """This process's index of the handle's GPU, matched by UUID (processes may number GPUs differently)."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == handle.get("device_uuid"):
            return index
    raise ValueError(
        f"handles: the trainer's GPU {handle.get('device_uuid')} is not visible to this engine (it sees "
        f"{torch.cuda.device_count()} GPU(s), engine device {default_device}): colocated sync needs the sending "
        "trainer rank on the engine's own GPU"
    )


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(bytes(data)).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
