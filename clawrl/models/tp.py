"""Tensor parallelism for the decoder (the Megatron layout): one rank's shard of a CausalLM, and its group.

    tp = TensorParallel.join(rank=r, size=2, address="127.0.0.1", port=port, backend="gloo")
    model = load_sharded_model(model_dir, tp, device="cpu", dtype=torch.float32)   # this rank's shard
    hidden = model(input_ids, positions, attn)   # every rank in lock step: the layers all-reduce inside

What each of the N ranks holds, for each decoder layer:
- q/k/v (packed qkv_proj) and gate/up (packed gate_up_proj): column-parallel — rank r keeps its rows
  (heads r*Hq/N .. (r+1)*Hq/N - 1, MLP columns r*I/N ..), so attention runs on its own heads only;
- o_proj and down_proj: row-parallel — rank r keeps the matching input columns and computes a partial sum;
  `RowParallelLinear` adds the N partial sums (`TensorParallel.reduce`) before the bias, so every rank
  holds the same full hidden state afterwards;
- embedding, norms, LM head: replicated (every rank can compute the logits; the engine does it on rank 0).

The rank's model is `CausalLM` built from `local_args` (its head and MLP counts), so every shape is the
shard's shape; each sharded parameter's weight loader takes the FULL HF tensor and keeps its rank's slice
(`ShardOnLoad`), so checkpoint loading and live weight updates (full tensors from the trainer) are one path.

Head counts: num_attention_heads must divide by N. KV heads are split when num_key_value_heads divides by
N, and replicated when N divides by num_key_value_heads (rank r then keeps KV head r * Hkv // N, the one
its query heads read); anything else is one error naming the flag and the head counts. MoE layers are not
sharded yet (an error).

Numerics: a column-parallel rank computes exactly the columns of the full matmul (same inputs, same
reduction over the hidden size). A row-parallel sum is split in N parts and added in rank order, which
differs from the one-process sum by float rounding; `emulate_split_sums(model, N)` makes a one-process
model add the same N parts in the same order, the exact reference for a TP=N engine (tests compare both).
On CPU (gloo) the reduction is an all-gather then a sum in rank order (every rank adds identically); on
GPU (NCCL) an all-reduce, which for N = 2 is the same a + b and for N > 2 sums in NCCL's order.

Shapes: N = tokens, H = hidden size, Hq / Hkv = query / KV heads, D = head_dim, I = intermediate size.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clawrl.models.config import ModelArgs, load_model_args
from clawrl.models.loader import PackedWeightLoader, iter_safetensors, load_weights, safetensors_weight_map

TP_FLAG = "--rollout-num-gpus-per-engine / --tp-size"
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}


@dataclass(kw_only=True, eq=False)
class TensorParallel:
    """One rank's place in a tensor-parallel group and the collectives the sharded layers run."""

    rank: int
    """This process's rank, 0 .. size - 1 (rank 0 schedules and samples in the engine)."""
    size: int
    """Number of ranks the model is sharded over."""
    group: Any = None
    """torch ProcessGroupGloo / ProcessGroupNCCL for activations and weights; None when size == 1."""
    control: Any = None
    """ProcessGroupGloo for host-side messages (same as `group` on CPU)."""
    backend: str = "gloo"
    """"gloo" (CPU tensors) or "nccl" (CUDA tensors)."""
    timeout_s: float = 600.0
    """Deadline of every collective on `group`."""

    @classmethod
    def join(cls, *, rank: int, size: int, address: str, port: int, backend: str, timeout_s: float = 600.0,
             control_timeout_s: float = 7 * 86400.0) -> TensorParallel:  # fmt: skip
        """Form (rank 0 hosts the store at address:port) or join the group; blocks until all ranks joined.
        The control group's long deadline is an idle engine's wait for its next step, not a hang."""
        store = dist.TCPStore(address, port, size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        control = dist.ProcessGroupGloo(
            dist.PrefixStore("tp-control", store), rank, size, datetime.timedelta(seconds=control_timeout_s)
        )
        if backend == "gloo":
            group = control
        else:
            group = dist.ProcessGroupNCCL(
                dist.PrefixStore("tp-data", store), rank, size, datetime.timedelta(seconds=timeout_s)
            )
        tp = cls(rank=rank, size=size, group=group, control=control, backend=backend, timeout_s=timeout_s)
        tp._store = store  # rank 0 hosts the store: it must live as long as the group
        return tp

    def reduce(self, partial_NH: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial [N, H], identical on every rank."""
        if self.size == 1:
            return partial_NH
        if self.backend == "nccl":
            self.group.allreduce([partial_NH]).wait()
            return partial_NH
        parts = [torch.empty_like(partial_NH) for _ in range(self.size)]
        self.group.allgather([parts], [partial_NH.contiguous()]).wait()
        return _ordered_sum(parts)

    def broadcast(self, tensor: torch.Tensor, *, control: bool = False) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's `tensor` (in place); `control` uses the host-side group."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        (self.control if control else self.group).broadcast([tensor], opts).wait()
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on every rank), in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return parts

    def broadcast_json(self, value: Any = None) -> Any:
        """Rank 0's JSON-able `value` on every rank (the host-side group; other ranks pass nothing)."""
        size = torch.zeros(1, dtype=torch.int64)
        payload = json.dumps(value).encode() if self.rank == 0 else b""
        size[0] = len(payload)
        self.broadcast(size, control=True)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else None
        if data is None:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.broadcast(data, control=True)
        return json.loads(bytes(data.tolist()).decode())

    def slices(self, args: ModelArgs) -> dict[str, tuple[int, int]]:
        """(start, size) of this rank's rows of q, of k/v, and of the MLP columns, in the full tensors."""
        check_shardable(args, self.size)
        q_local = args.num_heads // self.size * args.head_dim
        kv_heads = max(args.num_kv_heads // self.size, 1)
        first_kv = self.rank * args.num_kv_heads // self.size
        mlp_local = args.intermediate_size // self.size
        return {
            "q": (self.rank * q_local, q_local),
            "kv": (first_kv * args.head_dim, kv_heads * args.head_dim),
            "mlp": (self.rank * mlp_local, mlp_local),
        }

    def hf_slice(self, name: str, args: ModelArgs) -> tuple[int, int, int] | None:
        """(dim, start, size) of this rank's part of the full HF tensor `name`; None if it is replicated."""
        parts = name.rsplit(".", 2)
        if len(parts) != 3 or ".layers." not in f".{parts[0]}":
            return None
        module, attr = parts[1], parts[2]
        if module in _COLUMN:
            return (0, *self.slices(args)[_COLUMN[module]])
        if module in _ROW and attr == "weight":
            return (1, *self.slices(args)[_ROW[module]])
        return None


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... left to right: the same rounding on every rank and in the emulation."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def check_shardable(args: ModelArgs, size: int) -> None:
    """Raise one ValueError naming the flag and the counts when `args` cannot be split over `size` ranks."""
    if size not in (1, 2, 4, 8):
        raise ValueError(f"{TP_FLAG} {size}: tensor parallelism supports 1, 2, 4 or 8 ranks")
    kv_ok = args.num_kv_heads % size == 0 or size % args.num_kv_heads == 0
    problems = []
    if args.num_heads % size:
        problems.append(f"num_attention_heads={args.num_heads} is not a multiple of {size}")
    if not kv_ok:
        problems.append(
            f"num_key_value_heads={args.num_kv_heads} neither divides nor is a multiple of {size}"
        )
    if args.intermediate_size % size:
        problems.append(f"intermediate_size={args.intermediate_size} is not a multiple of {size}")
    if args.num_experts and size > 1:
        problems.append(f"arch {args.arch!r} has MoE layers, which are not sharded yet")
    if problems:
        raise ValueError(f"{TP_FLAG} {size}: the model cannot be split: " + "; ".join(problems))


def local_args(args: ModelArgs, size: int) -> ModelArgs:
    """The shapes one rank's CausalLM is built with: its query heads, KV heads and MLP width."""
    check_shardable(args, size)
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // size,
        num_kv_heads=max(args.num_kv_heads // size, 1),
        intermediate_size=args.intermediate_size // size,
    )


class RowParallelLinear(nn.Linear):
    """y = sum over parts of x_part @ W_part^T (parts added in order), then + bias.

    Distributed: this rank's input columns are one part, the others come from `tp.reduce`. Emulation
    (`tp` None, `num_parts` N): one process splits its full input in N parts and adds them in the same order."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TensorParallel | None,
                 num_parts: int = 1, device=None, dtype=None) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.tp, self.num_parts = tp, num_parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            out = self.tp.reduce(F.linear(x, self.weight))
        else:
            pairs = zip(x.chunk(self.num_parts, -1), self.weight.chunk(self.num_parts, -1), strict=True)
            out = _ordered_sum([F.linear(x_part, w_part) for x_part, w_part in pairs])
        return out if self.bias is None else out + self.bias


def _swap_row_parallel(model: nn.Module, make: Callable[[nn.Linear], RowParallelLinear]) -> None:
    """Replace every layer's o_proj and dense down_proj by `make(old)` (same parameter names)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = make(attn.o_proj)
        if hasattr(mlp, "down_proj"):
            mlp.down_proj = make(mlp.down_proj)


def _row_parallel_like(linear: nn.Linear, tp: TensorParallel | None, num_parts: int) -> RowParallelLinear:
    layer = RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, tp=tp,
                              num_parts=num_parts, device=linear.weight.device, dtype=linear.weight.dtype)  # fmt: skip
    if linear.weight.device.type != "meta":
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
    return layer


def emulate_split_sums(model: nn.Module, num_parts: int) -> nn.Module:
    """Make a full (one-process) CausalLM add its o_proj / down_proj sums in `num_parts` parts, in rank
    order: the exact arithmetic of a TP=num_parts engine, without processes (its reference). In place."""
    check_shardable(model.args, num_parts)
    _swap_row_parallel(model, lambda old: _row_parallel_like(old, None, num_parts))
    model._apply(lambda t: t)  # re-attach the weight loaders to the new parameters
    return model


class ShardOnLoad:
    """Weight loader of a sharded parameter: narrows the full incoming tensor to this rank's slice, then
    hands it to the parameter's own loader (`inner`: plain copy, or packed q/k/v / gate/up rows)."""

    def __init__(self, inner: Callable, slices: dict[Any, tuple[int, int, int]]) -> None:
        self.inner = inner
        self.slices = slices
        """shard id (None for an unpacked parameter) -> (dim, start, size) in the full tensor."""

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id in self.slices:
            dim, start, size = self.slices[shard_id]
            if loaded.shape[dim] < start + size:
                raise ValueError(
                    f"tensor of shape {tuple(loaded.shape)} has no rows {start}..{start + size - 1} on dim {dim} "
                    "for this tensor-parallel rank (a full, unsharded tensor is expected)"
                )
            loaded = loaded.narrow(dim, start, size)
        self.inner(param, loaded, shard_id)


class PackedShardOnLoad(ShardOnLoad, PackedWeightLoader):
    """ShardOnLoad around a packed loader: still a PackedWeightLoader, so loading checks every shard and
    hf_state_dict splits the (local) packed rows back into q/k/v and gate/up."""

    @property
    def shard_offsets(self) -> dict:
        """The packed layout (local rows) of the wrapped loader."""
        return self.inner.shard_offsets


@dataclass(kw_only=True, eq=False)
class ShardPlan:
    """Attached to a sharded CausalLM (`model.tp_shard`): re-wraps its weight loaders after `_apply`."""

    tp: TensorParallel
    """This rank's group."""
    full_args: ModelArgs
    """The unsharded model's shapes (the HF tensors' shapes)."""

    def attach_loaders(self, model: nn.Module) -> None:
        packed = getattr(model, "packed_modules", {})
        for name, param in model.named_parameters():
            prefix, module, attr = (name.rsplit(".", 2) + ["", ""])[:3]
            members = packed.get(module, [(module, None)])
            slices = {}
            for member, shard_id in members:
                where = self.tp.hf_slice(f"{prefix}.{member}.{attr}", self.full_args)
                if where is not None:
                    slices[shard_id] = where
            if slices:
                kind = (
                    PackedShardOnLoad if isinstance(param.weight_loader, PackedWeightLoader) else ShardOnLoad
                )
                param.weight_loader = kind(param.weight_loader, slices)


def shard_model(model: nn.Module, tp: TensorParallel, full_args: ModelArgs) -> nn.Module:
    """Turn a CausalLM built from `local_args(full_args, tp.size)` into rank tp.rank's shard: row-parallel
    o_proj / down_proj, and loaders that keep this rank's slice of full tensors. In place."""
    _swap_row_parallel(model, lambda old: _row_parallel_like(old, tp, 1))
    model.tp_shard = ShardPlan(tp=tp, full_args=full_args)
    model._apply(lambda t: t)  # attach the loaders (base ones first, then the sharding wrappers)
    return model


def load_sharded_model(model_dir: str | Path, tp: TensorParallel, *, device: torch.device | str,
                       dtype: torch.dtype, fused: bool = True) -> nn.Module:  # fmt: skip
    """This rank's shard of the checkpoint at `model_dir` (every rank reads the full files, keeps its part)."""
    from clawrl.models.decoder import CausalLM

    full = load_model_args(model_dir)
    with torch.device("meta"):
        model = CausalLM(local_args(full, tp.size), fused=fused)
    shard_model(model, tp, full)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    load_weights(model, iter_safetensors(model_dir), files=safetensors_weight_map(model_dir))
    return model


def full_hf_tensors(model: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Every rank (collective): the full HF tensors of a sharded model, gathered from all ranks' slices."""
    from clawrl.models.hf_io import hf_state_dict

    full_args = model.tp_shard.full_args
    out = {}
    for name, local in hf_state_dict(model).items():
        where = tp.hf_slice(name, full_args)
        if where is None:
            out[name] = local
            continue
        dim = where[0]
        parts = tp.allgather(local)
        peers = [dataclasses.replace(tp, rank=r).hf_slice(name, full_args) for r in range(tp.size)]
        shape = list(local.shape)
        shape[dim] = max(start + size for _, start, size in peers)
        full = local.new_empty(shape)
        for part, (_, start, size) in zip(parts, peers, strict=True):
            full.narrow(dim, start, size).copy_(part)  # replicated KV heads: equal copies overwrite
        out[name] = full
    return out
