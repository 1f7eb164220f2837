"""GPU memory that can be given back and taken again at the same virtual addresses (CUDA's virtual memory
management, through the driver API).

A colocated engine hands its GPU memory to the trainer for every train step. Freeing tensors and
allocating new ones later moves their addresses, and every captured CUDA graph holds addresses: the graphs
then had to be captured again after each hand-over (~1 s at 0.5B on an H200), and the weights had to be
copied to the host and back. A `StableBuffer` reserves a virtual address range once and maps physical
memory into it; `release()` unmaps and frees the physical memory (the driver's free memory goes up by the
buffer's size) while the addresses stay reserved, and `resume()` maps fresh physical memory at the same
addresses. Tensors viewing the buffer stay valid Python objects throughout; their contents do not survive a
release, and touching them while released is an illegal memory access, so owners guard their use.

    buf = StableBuffer(nbytes, device)          # mapped, contents undefined
    k = buf.view(0, (layers, blocks, 16, 2, 64), torch.bfloat16)
    buf.release()                                # physical memory back to the driver; k must not be used
    buf.resume()                                 # same addresses, new (undefined) contents

Only Linux with a CUDA driver (libcuda.so.1); `stable_memory_available()` says whether it works here.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED: plain device memory
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ALIGNMENT = 256  # bytes between tensors packed into one buffer (what the caching allocator guarantees)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaMemoryError(RuntimeError):
    """A driver call failed (out of memory on resume, most often); the message names the call and the size."""


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str, nbytes: int) -> None:
    if result == 0:
        return
    text = ctypes.c_char_p()
    _driver().cuGetErrorString(result, ctypes.byref(text))
    reason = text.value.decode() if text.value else f"CUresult {result}"
    raise CudaMemoryError(f"{call} of {nbytes / 2**30:.2f} GiB failed: {reason}")


@functools.cache
def stable_memory_available() -> bool:
    """Whether CUDA is usable and the driver exports the virtual memory management calls."""
    if not torch.cuda.is_available():
        return False
    try:
        lib = _driver()
        return all(hasattr(lib, name) for name in ("cuMemCreate", "cuMemMap", "cuMemAddressReserve"))
    except OSError:
        return False


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the alignment of tensors packed into one buffer."""
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


class _CudaArray:
    """The smallest object torch.as_tensor turns into a CUDA tensor without a copy."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }  # fmt: skip


class StableBuffer:
    """One virtual address range on one device with physical memory mapped in or not (module docstring)."""

    def __init__(self, nbytes: int, device: torch.device | str):
        self.device = torch.device(device)
        assert self.device.type == "cuda", "StableBuffer holds CUDA memory"
        torch.cuda.init()
        self._ordinal = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.nbytes = nbytes
        with torch.cuda.device(self._ordinal):
            torch.cuda.synchronize()  # makes the device's primary context current on this thread
            self._prop = _AllocationProp(
                type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, self._ordinal)
            )
            granularity = ctypes.c_size_t()
            _check(_driver().cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self._prop), _GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity", nbytes)  # fmt: skip
            self.mapped_bytes = max(1, math.ceil(nbytes / granularity.value)) * granularity.value
            address = ctypes.c_uint64()
            _check(_driver().cuMemAddressReserve(
                ctypes.byref(address), ctypes.c_size_t(self.mapped_bytes), ctypes.c_size_t(0),
                ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve", self.mapped_bytes)  # fmt: skip
        self.address = address.value
        self._handle: int | None = None
        self.resume()
        self.tensor = torch.as_tensor(_CudaArray(self.address, self.nbytes), device=self.device)
        """The whole buffer as uint8 [nbytes]; views of it stay valid across release/resume."""

    @property
    def is_mapped(self) -> bool:
        """False between release() and resume()."""
        return self._handle is not None

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` starting `offset` bytes into the buffer."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        assert offset % _ALIGNMENT == 0 and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        return self.tensor[offset : offset + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Wait for the device, then unmap and free the physical memory (no-op when released)."""
        if self._handle is None:
            return
        with torch.cuda.device(self._ordinal):
            torch.cuda.synchronize()  # no kernel may still read or write these pages
            _check(_driver().cuMemUnmap(ctypes.c_uint64(self.address), ctypes.c_size_t(self.mapped_bytes)),
                   "cuMemUnmap", self.mapped_bytes)  # fmt: skip
            _check(_driver().cuMemRelease(ctypes.c_uint64(self._handle)), "cuMemRelease", self.mapped_bytes)
        self._handle = None

    def resume(self) -> None:
        """Map fresh physical memory at the same addresses (no-op when mapped); contents are undefined."""
        if self._handle is not None:
            return
        handle = ctypes.c_uint64()
        size = ctypes.c_size_t(self.mapped_bytes)
        lib = _driver()
        with torch.cuda.device(self._ordinal):
            torch.cuda.synchronize()
            _check(lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), ctypes.c_uint64(0)),
                   "cuMemCreate (allocating the physical memory)", self.mapped_bytes)  # fmt: skip
            try:
                _check(lib.cuMemMap(ctypes.c_uint64(self.address), size, ctypes.c_size_t(0), handle,
                                    ctypes.c_uint64(0)), "cuMemMap", self.mapped_bytes)  # fmt: skip
                access = _AccessDesc(
                    location=_Location(_LOCATION_DEVICE, self._ordinal), flags=_ACCESS_READ_WRITE
                )
                _check(lib.cuMemSetAccess(ctypes.c_uint64(self.address), size, ctypes.byref(access),
                                          ctypes.c_size_t(1)), "cuMemSetAccess", self.mapped_bytes)  # fmt: skip
            except CudaMemoryError:
                lib.cuMemUnmap(ctypes.c_uint64(self.address), size)
                lib.cuMemRelease(handle)
                raise
        self._handle = handle.value


def move_parameters_into(module: torch.nn.Module, device: torch.device) -> StableBuffer:
    """Copy every parameter of `module` (each shared one once) into one new StableBuffer and point the
    parameters at it; the old storage is freed. Buffers (RoPE tables) stay where they are."""
    params = list({id(p): p for p in module.parameters()}.values())
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += aligned(param.numel() * param.element_size())
    buffer = StableBuffer(max(total, 1), device)
    with torch.no_grad():
        for param, offset in zip(params, offsets, strict=True):
            view = buffer.view(offset, tuple(param.shape), param.dtype)
            view.copy_(param.data)
            param.data = view
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the parameters' old blocks
    return buffer
