"""What crosses between trainer rank 0 and an engine in a weight sync, with the code BOTH ends run on it.

The senders (colocated.py, broadcast.py) and the engine's receiver (clawrl/engine/weight_receiver.py) import
this module and flat.py (the bucket layout and dtype names); the receiver imports no sender. Three ways a
flat bucket tensor (flat.py) reaches an engine:

- shared memory (colocated, CPU): a POSIX segment named `clawrl_w_<32 hex>` under /dev/shm, one per dtype
  group; handle {"name": ..., "nbytes": int}. The sender creates and later unlinks it; the engine maps it.
- CUDA IPC (colocated, GPU): a CUDA buffer shared by torch's IPC handle, sent as JSON (bytes in base64, no
  pickle), the GPU also named by UUID; see `encode_cuda_ipc`.
- a broadcast group (split placement): a standalone gloo/NCCL process group of trainer rank 0 (rank 0, the
  root of every broadcast) and the engines (ranks 1..N); see `create_group` and `broadcast_from_rank0`.

    segment = new_segment_name(); flat = map_segment(segment, group)        # sender, after creating it
    flat = open_shared_memory({"name": segment, "nbytes": group.nbytes}, group)   # engine
    handle = encode_cuda_ipc(flat); flat = open_cuda_ipc(handle, group, device)   # sender / engine
"""

from __future__ import annotations

import base64
import datetime
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from clawrl.weight_sync.flat import FlatGroup, dtype_name, parse_dtype

HANDLE_KINDS = ("shared_memory", "cuda_ipc")
"""The `transport` values of POST /update_weights_from_tensor (colocated sync)."""
BACKENDS = ("gloo", "nccl")
"""Process-group backends of the broadcast sync."""
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments
SHM_PREFIX = "clawrl_w_"
"""Every weight-sync segment's name starts with this (tests and cleanup look for it)."""
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}[0-9a-f]{{32}}$")
_IPC_FIELDS = (
    "tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_size_bytes",
    "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)  # fmt: skip
"""The arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor, in order."""


# --------------------------------------------------------------------------------------- shared memory


def new_segment_name() -> str:
    """A fresh segment name; only names of this form are opened by an engine."""
    return f"{SHM_PREFIX}{uuid.uuid4().hex}"


def map_segment(name: str, group: FlatGroup) -> torch.Tensor:
    """The segment `name` mapped (shared, writable) as a 1-D tensor of the group's dtype and length;
    FileNotFoundError when it does not exist.

    Opened without O_CREAT first, then mapped through /proc/self/fd: torch.from_file would re-create a
    segment the sender has already unlinked (after a failed sync it frees buckets still in flight), leaving
    a zero-filled file behind in /dev/shm and loading its zeros."""
    fd = os.open(f"{SHM_DIR}/{name}", os.O_RDWR)
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=group.numel, dtype=group.torch_dtype)
    finally:
        os.close(fd)  # the mapping keeps the memory alive


def open_shared_memory(handle: Any, group: FlatGroup) -> torch.Tensor:
    """Receiver: map the segment of a shared_memory handle; ValueError for a malformed handle."""
    if not isinstance(handle, dict) or not _SHM_NAME.match(str(handle.get("name", ""))):
        raise ValueError(
            f"handles: a shared_memory handle is {{'name': '{SHM_PREFIX}<32 hex>', 'nbytes'}}, got {handle!r}"
        )
    if not isinstance(handle.get("nbytes"), int) or handle["nbytes"] < group.nbytes:
        raise ValueError(f"handles: segment {handle['name']} has nbytes={handle.get('nbytes')!r}, "
                         f"the {group.dtype} tensors need {group.nbytes}")  # fmt: skip
    if not group.numel:
        return torch.empty(0, dtype=group.torch_dtype)
    try:
        return map_segment(handle["name"], group)
    except (OSError, RuntimeError) as error:  # missing segment, or torch failing to map it
        raise ValueError(f"handles: cannot map shared-memory segment {handle['name']}: {error}") from None


# --------------------------------------------------------------------------------------------- CUDA IPC


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


# ------------------------------------------------------------------------------------ broadcast group


def create_group(*, backend: str, rank: int, world_size: int, group_name: str, timeout_s: float,
                 store: dist.Store | None = None, master_address: str = "", master_port: int = 0,
                 device: torch.device | None = None) -> Any:  # fmt: skip
    """Join (rank > 0) or form (rank 0, with its `store`) a standalone group; blocks until every rank has
    joined or `timeout_s` passes. Returns the backend object whose collectives we call.

    Standalone (a backend object on a `PrefixStore`, not torch.distributed's global group): the trainer
    already has its default group for FSDP, an engine may hold several such groups, and tests run every
    rank in one process."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    group = dist.ProcessGroupNCCL(prefixed, rank, world_size, timeout)
    if device is not None and hasattr(group, "eager_connect_single_device"):
        group.eager_connect_single_device(device)  # form the communicator now, not at the first bucket
    return group


def broadcast_from_rank0(group: Any, tensor: torch.Tensor, timeout_s: float, *,
                         check: Callable[[], None] | None = None) -> None:  # fmt: skip
    """Broadcast `tensor` from rank 0 into every rank's `tensor`; blocks the CPU until done or timeout.

    `check` is called while waiting; it raises to abandon the wait (e.g. a peer already reported failure,
    so the collective can only time out)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    work = group.broadcast([tensor], opts)
    if check is not None:
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"broadcast not completed within {timeout_s:.0f} s")
            time.sleep(0.0002)
    work.wait(timeout)  # raises the collective's error, if any
