"""Weights of the (sharded) training model: a reference-weight bank, bucketed export, checksums.

Reference weights (`--ref-load`) live as a second copy of each rank's parameter SHARD on the training device,
swapped into the model in place for the reference forward and swapped back after. With FSDP a rank holds
1/world_size of the model, so the reference costs one more shard per rank, not a full model; the swap is a
device-local copy (milliseconds) instead of a host round trip. This is slime's "weight backup" idea without
a second model object.

Weight export for sync gathers one parameter at a time (`DTensor.full_tensor()`, a collective every rank
joins in the same order) and yields buckets of at most `--update-weight-buffer-size` bytes, so a device never
holds more than the bucket beyond its own shard. A LoRA policy exports merged weights under the base names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from clawrl.models.lora import LoRALinear, is_adapter_param, lora_modules, merge_weight
from clawrl.trainer.fsdp import reshard_all
from clawrl.weight_sync.checksum import tensor_checksum  # noqa: F401  (moved there; still importable here)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the parameter itself when not sharded)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


class WeightBank:
    """A copy of every parameter shard of a model, swappable into it in place."""

    def __init__(self, model: nn.Module):
        self.names = [name for name, _ in model.named_parameters()]
        self.shards = [local_tensor(p).detach().clone() for _, p in model.named_parameters()]

    def load_(self, named_full: dict[str, torch.Tensor], model: nn.Module, *, source: str) -> None:
        """Fill the bank from full (unsharded) tensors, keeping this rank's slice of each.

        `source` (e.g. the --ref-load directory) names where the tensors come from in the error raised when
        they do not fit the model (another architecture or other sizes).
        """
        found = {name: tuple(t.shape) for name, t in named_full.items()}
        problem = architecture_mismatch(full_shapes(model), found, ignore=_aliases(model))
        if problem:
            raise ValueError(f"{source}: the weights do not fit the policy model: {problem}")
        for i, (name, param) in enumerate(model.named_parameters()):
            full = named_full[name].to(self.shards[i].dtype)
            self.shards[i].copy_(_slice_like(param, full))

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module):
        """Run the body with the bank's weights in `model`; the model's own weights are back afterwards."""
        reshard_all(model)
        params = [p for _, p in model.named_parameters()]
        _exchange(params, self.shards)
        try:
            yield
        finally:
            reshard_all(model)
            _exchange(params, self.shards)


def full_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """HF name -> full (unsharded) shape of every parameter; a DTensor's `shape` is the global one."""
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def _aliases(model: nn.Module) -> set[str]:
    """Names that only repeat a parameter (a tied lm_head.weight) or buffers old checkpoints carry."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return (every - set(full_shapes(model))) | {"*rotary_emb.inv_freq"}


def architecture_mismatch(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], *, ignore: set[str] = frozenset()
) -> str | None:
    """None if `found` has exactly the tensors of `expected` with the same shapes, else what differs.

    `ignore` holds extra names allowed in `found` ("*suffix" matches any name ending in suffix).
    """

    def ignored(name: str) -> bool:
        return name in ignore or any(p.startswith("*") and name.endswith(p[1:]) for p in ignore)

    problems = [
        f"{name!r} has shape {list(found[name])}, the model's is {list(shape)}"
        for name, shape in expected.items()
        if name in found and tuple(found[name]) != tuple(shape)
    ]
    problems += [f"no tensor {name!r}" for name in expected if name not in found]
    problems += [
        f"unexpected tensor {name!r}" for name in found if name not in expected and not ignored(name)
    ]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more differences)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more + " -- is it a checkpoint of another architecture or size?"


def _exchange(params: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, shard in zip(params, shards, strict=True):
            live = local_tensor(param)
            held = live.clone()
            live.copy_(shard)
            shard.copy_(held)


def _slice_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of `full` that this rank holds for `param` (dim-0 sharding, as FSDP2 does)."""
    if not isinstance(param, DTensor):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements).to_local()


def iter_full_tensors(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter, gathered one at a time; every rank must iterate.

    The tensors never alias the live parameters (with one rank, or a dtype that needs no conversion, the
    gather would hand back the parameter's own storage): a consumer may keep, share or pin them freely.
    A LoRA model yields its merged weights (W + scaling * B @ A) under the base layers' names and no
    adapter tensors: what an engine without adapters loads (see `_merged_param`).
    """
    reshard_all(model)
    adapted = {f"{path}.weight": module for path, module in lora_modules(model)}
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue
        local = param.detach() if name not in adapted else _merged_param(adapted[name])
        if dtype is not None:
            local = local.to(dtype)
        full = local.full_tensor() if isinstance(local, DTensor) else local
        if full.untyped_storage().data_ptr() == local_tensor(param).untyped_storage().data_ptr():
            full = full.clone()
        yield name, full


def _merged_param(module: LoRALinear) -> torch.Tensor:
    """The merged weight of a LoRA layer, sharded like its base weight (a DTensor under FSDP).

    FSDP2 shards W [out, in] and B [out, r] on dim 0 in the same row chunks (equal dim-0 sizes), so this
    rank's merged rows are W_local + s * B_local @ A with A gathered whole (r x in: small); the base
    weight is never gathered at full precision just to be merged.
    """
    weight, lora_A, lora_B = (p.detach() for p in (module.weight, module.lora_A.weight, module.lora_B.weight))
    if not isinstance(weight, DTensor):
        return merge_weight(weight, lora_A, lora_B, module.scaling)
    full_A = lora_A.full_tensor() if isinstance(lora_A, DTensor) else lora_A
    merged = merge_weight(weight.to_local(), full_A, local_tensor(lora_B), module.scaling)
    return DTensor.from_local(
        merged, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
        stride=weight.stride(),
    )  # fmt: skip


def iter_adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every LoRA adapter parameter, gathered one at a time (collective)."""
    reshard_all(model)
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            local = param.detach()
            yield name, (local.full_tensor() if isinstance(local, DTensor) else local.clone())


def iter_weight_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
