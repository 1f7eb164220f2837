"""Move the trainer's device memory to host memory and back (colocated training, `--colocate`).

When trainer and engine share a GPU, the trainer must give its memory back while the engine generates.
`HostOffload` copies the bytes of every storage behind the given tensors (parameter shards, optimizer
state, reference-weight shards) into host buffers, then resizes each device storage to 0 bytes; `onload`
resizes them back and copies the bytes in. The tensors, their views and FSDP2's bookkeeping stay the same
Python objects pointing at the same storages (FSDP itself frees unsharded parameters this way), so nothing
is re-registered and the optimizer, the reference bank and the DTensor parameters keep working unchanged.

Host buffers are pinned on CUDA (copies run as DMA, all queued before one synchronisation) and kept for the
next offload, since pinning memory is slow. The same code runs on CPU, where it only moves bytes between
two host buffers (dropped again at onload), so the CPU tests exercise the real mechanism.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostOffload:
    """Host copies of a set of storages; `offload(tensors)` then `onload()` restores them bit for bit."""

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        """The storages of the last offload (kept after onload, for `offload_again`)."""
        self._host: list[torch.Tensor | None] = []
        self.is_offloaded = False

    @property
    def offloaded_nbytes(self) -> int:
        """Bytes an `onload()` would allocate on the device (0 when nothing is offloaded)."""
        return sum(h.numel() for h in self._host) if self.is_offloaded else 0

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of `tensors` to host and free them on their device; returns the bytes moved."""
        return self._offload(_unique_storages(tensors))

    def offload_again(self) -> int:
        """Offload the same storages as the last `offload` (after a temporary `onload`)."""
        return self._offload(self._storages)

    @torch.no_grad()
    def _offload(self, storages: list[torch.UntypedStorage]) -> int:
        if self.is_offloaded:
            raise RuntimeError("offload() called twice without onload() in between")
        fixed = [st for st in storages if not st.resizable()]
        if fixed:  # e.g. shared with numpy or memory-mapped: checked before anything is touched
            raise RuntimeError(
                f"cannot offload: {len(fixed)} of {len(storages)} storages are not resizable "
                f"(first: {fixed[0].nbytes()} bytes on {fixed[0].device})"
            )
        self._host = [_host_buffer(self._host, i, st) for i, st in enumerate(storages)]
        for st, host in zip(storages, self._host, strict=True):
            host.copy_(_bytes_of(st), non_blocking=host.is_pinned())
        _synchronize(storages)  # the copies must land before the device memory is released
        for st in storages:
            st.resize_(0)
        self._storages = storages
        self.is_offloaded = True
        if any(st.device.type == "cuda" for st in storages):
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the engine
        return sum(h.numel() for h in self._host)

    @torch.no_grad()
    def onload(self) -> None:
        """Reallocate every offloaded storage on its device and copy its bytes back."""
        if not self.is_offloaded:
            raise RuntimeError("onload() called without a preceding offload()")
        for st, host in zip(self._storages, self._host, strict=True):
            st.resize_(host.numel())
            _bytes_of(st).copy_(host, non_blocking=host.is_pinned())
        _synchronize(self._storages)
        # Pinned buffers are kept for the next offload (pinning is slow); plain host buffers would only
        # double the host memory of the state they copied.
        self._host = [h if h.is_pinned() else None for h in self._host]
        self.is_offloaded = False


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of `device` as its driver counts them (every process's allocations); None off CUDA,
    where host memory is not accounted for here."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


def device_reserved(device: torch.device) -> int:
    """Bytes this process's allocator holds on `device` (0 off CUDA)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each non-empty storage once, in first-seen order (views and tied weights share one)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(st)
    return out


def _bytes_of(st: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def _host_buffer(previous: list[torch.Tensor | None], index: int, st: torch.UntypedStorage) -> torch.Tensor:
    """Reuse the (pinned) buffer of the same slot from the last offload when it has the right size."""
    kept = previous[index] if index < len(previous) else None
    if kept is not None and kept.numel() == st.nbytes():
        return kept
    return torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=st.device.type == "cuda")


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    for device in {st.device for st in storages if st.device.type == "cuda"}:
        torch.cuda.synchronize(device)
