"""Flat buckets: the layout both ends of a weight sync agree on, from names, dtypes and shapes alone.

A bucket of (HF name, tensor) pairs travels as ONE flat tensor per dtype instead of one message per tensor:
for each dtype, in order of first appearance in the bucket, a 1-D tensor holding that dtype's tensors in
bucket order, each starting at an offset aligned to ALIGN_BYTES (aligned starts keep the receiver's copies
on vectorised paths). The receiver recomputes the same layout from the metadata it is sent
(`plan_flat_groups`), so only names, dtypes and shapes cross the wire, never offsets.

    groups = plan_flat_groups(names, dtypes, shapes)
    for group in groups:
        flat = torch.empty(group.numel, dtype=group.torch_dtype)
        fill_flat(group, flat, tensors_by_name)          # sender
        named = list(unflatten(group, flat))             # receiver: views into `flat`, no copy
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

ALIGN_BYTES = 256
"""Every tensor of a flat group starts at a multiple of this many bytes."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a weight sync may carry, by the name used on the wire."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("bfloat16"); ValueError for dtypes weight sync does not carry."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise ValueError(f"weight sync cannot send tensors of dtype {dtype} (supported: {', '.join(DTYPES)})")
    return name


def parse_dtype(name: str, *, field_name: str = "dtypes") -> torch.dtype:
    """torch dtype of a wire name; ValueError naming the field and the bad value."""
    if name not in DTYPES:
        raise ValueError(f"{field_name}: unknown dtype {name!r} (expected one of {', '.join(DTYPES)})")
    return DTYPES[name]


@dataclass(kw_only=True)
class FlatGroup:
    """The tensors of one dtype in a bucket, laid out in one flat 1-D tensor."""

    dtype: str
    """Wire name of the dtype ("bfloat16")."""
    names: list[str] = field(default_factory=list)
    """HF names, in bucket order."""
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    """Shape of each tensor."""
    offsets: list[int] = field(default_factory=list)
    """Start of each tensor in the flat tensor, in elements."""
    numel: int = 0
    """Length of the flat tensor in elements (the last tensor's end, unpadded)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def _append(self, name: str, shape: tuple[int, ...]) -> None:
        align = max(1, ALIGN_BYTES // self.torch_dtype.itemsize)
        offset = -(-self.numel // align) * align  # round up to the alignment
        self.names.append(name)
        self.shapes.append(shape)
        self.offsets.append(offset)
        self.numel = offset + math.prod(shape)


def plan_flat_groups(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[FlatGroup]:
    """The flat layout of a bucket described by parallel lists; ValueError naming the bad field."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    groups: dict[str, FlatGroup] = {}
    seen: set[str] = set()
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names[{i}] must be a non-empty string, got {name!r}")
        if name in seen:
            raise ValueError(f"names[{i}] = {name!r} appears twice in one bucket")
        seen.add(name)
        parse_dtype(dtype, field_name=f"dtypes[{i}]")
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"shapes[{i}] (of {name!r}) must be a list of ints >= 0, got {shape!r}")
        groups.setdefault(dtype, FlatGroup(dtype=dtype))._append(name, tuple(shape))
    return list(groups.values())


def describe_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of a bucket of (name, tensor) pairs: the metadata the receiver gets."""
    names = [name for name, _ in bucket]
    dtypes = [dtype_name(tensor.dtype) for _, tensor in bucket]
    shapes = [list(tensor.shape) for _, tensor in bucket]
    return names, dtypes, shapes


def fill_flat(group: FlatGroup, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the group's tensors into `flat` (1-D, group.numel elements of the group's dtype)."""
    assert flat.dtype == group.torch_dtype and flat.numel() >= group.numel, (
        "flat buffer does not fit the group"
    )
    with torch.no_grad():
        for name, shape, offset in zip(group.names, group.shapes, group.offsets, strict=True):
            flat[offset : offset + math.prod(shape)].view(shape).copy_(tensors[name])


def unflatten(group: FlatGroup, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) for every tensor of the group; no copies."""
    if flat.numel() < group.numel:
        raise ValueError(
            f"flat {group.dtype} tensor has {flat.numel()} elements, the bucket needs {group.numel}"
        )
    for name, shape, offset in zip(group.names, group.shapes, group.offsets, strict=True):
        yield name, flat[offset : offset + math.prod(shape)].view(shape)
