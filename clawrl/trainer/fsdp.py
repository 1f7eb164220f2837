"""Apply FSDP2 to a decoder: one `fully_shard` unit per transformer block, plus the root.

The model knows nothing about distribution (torchtitan's rule): this module and the single-rank fast path
(clawrl/trainer/single_rank.py, which chooses between the two) are the only places that do.
On GPU parameters stay fp32 (the optimizer's master weights) and are cast to bf16 for compute, with fp32
gradient reduction; on CPU everything is fp32. `FsdpModel` gives an FSDP2 module the trainer's interface
(the same as `SingleRankModel`'s): `compute` and `master` are the one sharded module.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


def build_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """A 1-D data-parallel mesh over all trainer ranks."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype) -> nn.Module:
    """Shard `model.model.layers[i]` each, then the root (embedding, final norm, LM head)."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        # The last block is gathered again right away by backward: keep it unsharded after forward. With
        # one rank resharding saves only the bf16 compute copy, and regathering costs a cast per block.
        reshard = mesh.size() > 1 and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class FsdpModel:
    """An FSDP2-wrapped module behind the trainer's interface (see clawrl/trainer/single_rank.py)."""

    def __init__(self, model: nn.Module, *, world_size: int):
        self.compute = self.master = model
        self.world_size = world_size

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def before_backward(self, *, is_last: bool) -> None:
        """With one rank, keep the bf16 parameters and accumulate fp32 gradients across micro-batches and
        "reduce" (a copy into the sharded fp32 gradients) once, after the last: the same fp32 sums in the
        same order, without a parameter cast and a gradient copy per micro-batch. With several ranks each
        micro-batch's gradients are reduce-scattered as they come (no full-size gradients per rank)."""
        if self.world_size == 1:
            self.compute.set_requires_gradient_sync(is_last)
            self.compute.set_reshard_after_backward(is_last)

    def after_backward(self, *, is_first: bool) -> None:
        """Nothing: FSDP2's own hooks have moved the gradients."""

    def after_step(self) -> None:
        """Nothing: the next forward gathers (and casts) the updated shards."""

    def after_load(self) -> None:
        """Nothing: the shards were loaded in place."""

    def offload_tensors(self) -> list[torch.Tensor]:
        """Parameter shards and buffers (gathered parameters are freed first, not copied)."""
        reshard_all(self.master)
        return [*self.master.parameters(), *self.master.buffers()]

    def release(self) -> None:
        """Nothing beyond the optimizer's zero_grad: the shards are all there is."""

    def release_grads(self) -> None:
        """Nothing beyond the optimizer's zero_grad (see `release`)."""

    def restore(self) -> None:
        """Nothing (see `release`)."""

    def restore_nbytes(self) -> int:
        """Device bytes `restore` allocates: none."""
        return 0


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap every decoder block's forward in non-reentrant activation checkpointing, names unchanged."""
    for layer in model.model.layers:
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    # Keyword arguments too: transformers' decoder layers (--model-impl hf) take most inputs by keyword.
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def reshard_all(model: nn.Module) -> None:
    """Free every unsharded parameter so `model.parameters()` are the sharded DTensors again.

    After a forward the root and the last block (every block with one rank, see apply_fsdp) keep their
    gathered parameters; code that reads or writes the shards in place (reference swap, export,
    checkpoint, offload) must reshard first, or it would see full-size (and, on GPU, bf16) tensors.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
