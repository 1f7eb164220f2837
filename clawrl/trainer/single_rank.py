"""How the trainer wraps its module: FSDP2, or (world size 1) the fast path without FSDP2.

FSDP2 pays its per-parameter hooks and its all-gather copies (fp32 shard -> bf16 unsharded parameter, bf16
gradient -> fp32 sharded gradient) even with one rank. The fast path instead keeps a plain module whose
parameters ARE in the compute dtype, and an fp32 master copy beside it:

    wrapped = wrap_for_training(model, mesh, compute_dtype=torch.bfloat16, single_rank=True,
                                activation_checkpointing=False)
    optimizer = build_adamw(wrapped.master.parameters(), ...)
    wrapped.zero_grad(optimizer)
    for each micro-batch:
        wrapped.before_backward(is_last=...); loss.backward(); wrapped.after_backward(is_first=...)
    clip_grad_norm(wrapped.master, ...); optimizer.step(); wrapped.after_step()

`wrapped.compute` runs forward and backward; `wrapped.master` holds the trained weights at full precision
(what the optimizer steps, a checkpoint saves and an export reads; same parameter names). `FsdpModel`
(clawrl/trainer/fsdp.py) has the same interface, its `compute` and `master` being the one FSDP2 module.

The fast path's numerics are FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` at one
rank, so both give the same update up to the gradient norm's last bit:
- the compute parameters are the round-to-nearest bf16 of the fp32 master (FSDP2 casts the same way when
  it gathers), refreshed after every optimizer step and every load;
- each micro-batch's bf16 gradients (autograd sums a tied weight's two uses in bf16, as under FSDP2) are
  cast to fp32 and summed across micro-batches in fp32, as FSDP2 does when it defers the reduction;
- clipping and AdamW read fp32 gradients and update fp32 master weights.
With an fp32 compute dtype (CPU) the master IS the compute module: a plain module and a plain AdamW.

Layout (bf16): the trainable master parameters are views into one flat fp32 buffer and their bf16 copies
views into one flat bf16 buffer, so refreshing the copies is one cast kernel. The gradients live in two
persistent flat buffers (bf16 for autograd to accumulate into, fp32 for the optimizer), reused every step:
no allocation per step. Frozen parameters (LoRA's base) keep an fp32 master too, as under FSDP2, so a
merged export is exact. Bytes per trainable parameter: 2 + 4 (weights) + 2 + 4 (gradients) + 8 (AdamW).
For colocated training only the master goes to host memory (`offload_tensors`): the bf16 copies and the
gradients are freed (`release`) and rebuilt from the master after onload (`restore`).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from clawrl.trainer.fsdp import FsdpModel, apply_activation_checkpointing, apply_fsdp

log = logging.getLogger(__name__)


def use_single_rank(flag: bool | None, world_size: int) -> bool:
    """Whether the trainer takes the fast path: `flag` (--fast-single-rank / --no-fast-single-rank) when
    given, else on exactly when the trainer has one rank."""
    if flag and world_size > 1:
        raise ValueError(
            f"--fast-single-rank needs a trainer of one rank, this one has {world_size} "
            "(--actor-num-nodes x --actor-num-gpus-per-node); drop the flag to shard with FSDP2"
        )
    chosen = world_size == 1 if flag is None else flag
    if world_size == 1:
        how = "the fast path, no FSDP2" if chosen else "FSDP2 (--no-fast-single-rank)"
        log.info("trainer: one rank, %s", how)
    return chosen


def wrap_for_training(model: nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype, single_rank: bool,
                      activation_checkpointing: bool) -> FsdpModel | SingleRankModel:  # fmt: skip
    """`model` (fp32, on its device) ready to train: the fast path or FSDP2 over `mesh`."""
    if not single_rank:
        if activation_checkpointing:
            apply_activation_checkpointing(model)
        return FsdpModel(apply_fsdp(model, mesh, compute_dtype=compute_dtype), world_size=mesh.size())
    wrapped = SingleRankModel(model, compute_dtype=compute_dtype)
    if activation_checkpointing:  # on the compute module: its forward is the one that runs
        apply_activation_checkpointing(wrapped.compute)
    return wrapped


class SingleRankModel:
    """A module in the compute dtype plus its fp32 master (see the module docstring)."""

    def __init__(self, model: nn.Module, *, compute_dtype: torch.dtype):
        self.master = model
        """The fp32 weights: the optimizer's parameters, the checkpoint's and the export's source."""
        params = _unique_params(model)
        self._trainable = [p for p in params if p.requires_grad]
        self._grads: tuple[torch.Tensor, torch.Tensor] | None = None
        """(bf16, fp32) flat gradient buffers, or None until the first backward / after `release`."""
        self._released = False
        if compute_dtype == torch.float32:
            assert all(p.dtype == torch.float32 for p in params), "the master weights must be fp32"
            self.compute = model
            """The module that runs forward and backward (the master itself when the dtypes agree)."""
            return
        self._master_flat = _flatten_into(self._trainable, torch.float32)
        self._compute_flat = self._master_flat.to(compute_dtype)
        copies = {
            id(p): nn.Parameter(v, requires_grad=True) for p, v in _views(self._compute_flat, self._trainable)
        }
        frozen = [p for p in params if not p.requires_grad]
        copies.update(
            {id(p): nn.Parameter(p.detach().to(compute_dtype), requires_grad=False) for p in frozen}
        )
        self._compute_params = [copies[id(p)] for p in self._trainable]
        self._frozen = [(p, copies[id(p)]) for p in frozen]
        # A deep copy whose parameters are the bf16 copies (ties kept: one copy per master parameter) and
        # whose buffers are the master's own (rotary caches stay fp32, as FSDP2 leaves buffers alone).
        memo = {**copies, **{id(b): b for b in model.buffers()}}
        self.compute = copy.deepcopy(model, memo)

    @property
    def aliased(self) -> bool:
        """True when the compute module is the master (fp32 compute): nothing to cast or copy."""
        return self.compute is self.master

    # ------------------------------------------------------------------------------------------ step
    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Start an optimizer step. The fp32 gradients are overwritten by the first micro-batch, so the
        bf16 path keeps its buffers (no allocation per step); a plain fp32 module drops its gradients."""
        if self.aliased:
            optimizer.zero_grad(set_to_none=True)

    def before_backward(self, *, is_last: bool) -> None:
        """Before a micro-batch's backward: the bf16 gradient buffer is zero and is each parameter's `.grad`,
        so autograd accumulates into it in place."""
        del is_last  # the fast path reduces nothing: every micro-batch is handled alike
        if self.aliased:
            return
        if self._grads is None:
            self._grads = (torch.zeros_like(self._compute_flat), torch.zeros_like(self._master_flat))
            _attach(self._compute_params, self._grads[0])
        elif any(p.grad is None for p in self._compute_params):  # someone set them to None: re-attach
            _attach(self._compute_params, self._grads[0])
        self._grads[0].zero_()

    def after_backward(self, *, is_first: bool) -> None:
        """After a micro-batch's backward: its bf16 gradients, cast to fp32, start or join the step's sum."""
        if self.aliased:
            return
        grad16, grad32 = self._grads
        if is_first:
            grad32.copy_(grad16)
        else:
            grad32.add_(grad16)
        if any(p.grad is None for p in self._trainable):
            _attach(self._trainable, grad32)

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer stepped the master: the compute parameters become its bf16 rounding."""
        if not self.aliased:
            self._compute_flat.copy_(self._master_flat)

    @torch.no_grad()
    def after_load(self) -> None:
        """After the master's weights were replaced (checkpoint load): refresh every compute parameter."""
        self.after_step()
        for master, compute in [] if self.aliased else self._frozen:
            compute.copy_(master)

    # ------------------------------------------------------------------------------------------ memory
    def offload_tensors(self) -> list[torch.Tensor]:
        """The tensors whose bytes must survive an offload: the master's parameters and buffers (the bf16
        copies are rebuilt from them, see `release` / `restore`)."""
        return [*self.master.parameters(), *self.master.buffers()]

    def release(self) -> None:
        """Free the gradient buffers and the compute copies (call before the master goes to host memory,
        so the allocator's blocks are returned to the driver with it)."""
        self._drop_grads()
        if self.aliased or self._released:
            return
        for t in [self._compute_flat, *(c for _, c in self._frozen)]:
            t.untyped_storage().resize_(0)
        self._released = True

    @torch.no_grad()
    def restore(self) -> None:
        """Reallocate the compute copies freed by `release` and refill them from the master (onloaded)."""
        if not self._released:
            return
        for t in [self._compute_flat, *(c for _, c in self._frozen)]:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        self._released = False
        self.after_load()

    def restore_nbytes(self) -> int:
        """Device bytes `restore` allocates (the compute copies; 0 when they were not released)."""
        if not self._released:
            return 0
        return sum(t.numel() * t.element_size() for t in [self._compute_flat, *(c for _, c in self._frozen)])

    def release_grads(self) -> None:
        """Free the gradient buffers only (the compute copies stay: a weight sync may still read them)."""
        self._drop_grads()

    def _drop_grads(self) -> None:
        for p in self._trainable if self.aliased else [*self._trainable, *self._compute_params]:
            p.grad = None
        self._grads = None


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter once (a tied weight under its first name), in `named_parameters` order."""
    return [p for _, p in model.named_parameters()]


def _flatten_into(params: list[nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
    """One flat `dtype` buffer holding `params`, which become views into it (same objects, same values)."""
    device = params[0].device if params else torch.device("cpu")
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
    with torch.no_grad():
        for p, view in _views(flat, params):
            view.copy_(p)
            p.data = view
    return flat


def _views(flat: torch.Tensor, params: list[torch.Tensor]):
    """(param, the slice of `flat` shaped like it) pairs, packed in order."""
    offset = 0
    for p in params:
        yield p, flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()


def _attach(params: list[torch.Tensor], flat_grad: torch.Tensor) -> None:
    """Make each parameter's `.grad` its slice of `flat_grad`."""
    for p, view in _views(flat_grad, params):
        p.grad = view
