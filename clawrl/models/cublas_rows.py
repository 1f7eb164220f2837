"""cuBLAS for `--true-on-policy-mode`'s matmuls, where a check at model set-up shows it keeps every row's bits.

The batch-invariant Triton linear (clawrl/models/batch_invariant.py) fixes its reduction order by K alone,
so the engine's decode batch and the trainer's packed micro-batch get the same bits from it; it runs at
1.3-1.7x cuBLAS's time. cuBLAS picks its kernel (tiles, split-K) by the shape, so in general the bits of a
row follow the row count. But for a given (K, N, dtype) on a given GPU, a row's bits may well be the same
at every row count in a range: then a call whose row count is always inside that range can take cuBLAS.

The contract (`cublas_linear_forward`): rows are padded with zeros to a multiple of ROW_QUANTUM and cut into blocks
of at most `block_rows` rows, each block one `torch.mm` / `torch.addmm` into its slice of the output. Every
call therefore multiplies 64, 128, ..., block_rows rows. `rows_check` runs exactly those products on random
data and accepts a group of layers only if every row gets the bits of the `block_rows`-row product:

    - the head m rows and the tail m rows of the block, for every multiple m of ROW_QUANTUM (a row keeps its
      bits whichever rows are beside it and at whatever offset of a multiple of 64 it sits),
    - the block's rows permuted (at any offset),
    - each part of a packed weight (q/k/v, gate/up) alone, against its columns of the packed product (the
      engine packs them, the trainer does not),
    - inside a CUDA graph (the engine's decode step) at every checked row count.

A group that fails keeps the Triton kernel. (Measured on an H100: every 0.5B / 1.5B group passes but the
down_proj, whose long K cuBLAS splits at 64-192 rows; K cut into 2048-element chunks, each an fp32-output
product added in order, passes the check but runs slower than the Triton linear, so it is not used.) The
verdict depends on the shapes, the dtype and the GPU, never on the weights' values, and is computed the same
way by the engine and the trainer, so both take the same kernel for a layer. It is cached per process. Not covered: a global cuBLAS setting changed between the check
and the run (torch.backends.cuda.matmul.*); both sides run with the defaults.

Shapes: M = rows, K = input features, N = output features.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import nn

ROW_QUANTUM = 64
"""A cuBLAS call's rows are a multiple of this (zero rows appended)."""
MAX_BLOCK_ROWS = 4096
BLOCK_OUTPUT_ELEMENTS = 1 << 28
"""A block's output is at most this many elements (an LM head of 152k columns: 1024-row blocks, 311 MB in
bf16), which bounds the check's temporaries and the padding copies."""


class LinearGroup(NamedTuple):
    """Layers that must take the same kernel: the parts of a packed weight, or one layer alone."""

    k_dim: int
    widths: tuple[int, ...]
    """N of each part (q, k, v / gate, up), in their packed order."""
    has_bias: bool


def block_rows(num_cols: int) -> int:
    """Rows per cuBLAS block for an output of `num_cols` columns: the largest power of two times
    ROW_QUANTUM within MAX_BLOCK_ROWS and BLOCK_OUTPUT_ELEMENTS."""
    rows = MAX_BLOCK_ROWS
    while rows > ROW_QUANTUM and rows * num_cols > BLOCK_OUTPUT_ELEMENTS:
        rows //= 2
    return rows


def _product(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, out_MN: torch.Tensor):
    """The one cuBLAS call of a block (the check runs this same call)."""
    if bias_N is None:
        torch.mm(x_MK, weight_NK.t(), out=out_MN)
    else:
        torch.addmm(bias_N, x_MK, weight_NK.t(), out=out_MN)


def cublas_linear_forward(
    x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, rows_per_block: int
) -> torch.Tensor:
    """[M, K] @ [N, K]^T (+ bias) -> [M, N]: rows padded to ROW_QUANTUM, blocks of `rows_per_block`."""
    num_rows, k_dim = x_MK.shape
    num_cols = weight_NK.shape[0]
    padded = -(-num_rows // ROW_QUANTUM) * ROW_QUANTUM
    if padded != num_rows or not x_MK.is_contiguous():
        x_pad = x_MK.new_zeros(padded, k_dim)
        x_pad[:num_rows] = x_MK
        x_MK = x_pad
    out = torch.empty(padded, num_cols, dtype=x_MK.dtype, device=x_MK.device)
    weight_NK = weight_NK.contiguous()
    if padded <= rows_per_block:  # one block (every decode step): no slicing
        _product(x_MK, weight_NK, bias_N, out)
        return out if padded == num_rows else out[:num_rows]
    for start in range(0, padded, rows_per_block):
        stop = min(start + rows_per_block, padded)
        _product(x_MK[start:stop], weight_NK, bias_N, out[start:stop])
    return out[:num_rows]


class KernelLinear(torch.autograd.Function):
    """x [M, K] @ weight [N, K]^T (+ bias) by `forward_fn(x, weight, bias, *args)` (a kernel whose bits
    matter); the backward is plain torch (gradients need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, x_MK, weight_NK, bias_N, forward_fn, args):
        ctx.save_for_backward(x_MK, weight_NK)
        ctx.has_bias = bias_N is not None
        return forward_fn(x_MK, weight_NK, bias_N, *args)

    @staticmethod
    def backward(ctx, grad_MN):
        x_MK, weight_NK = ctx.saved_tensors
        grad_x = grad_MN @ weight_NK if ctx.needs_input_grad[0] else None
        grad_w = grad_MN.t() @ x_MK if ctx.needs_input_grad[1] else None
        grad_b = grad_MN.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """True when a gradient will flow through these inputs (else a kernel's autograd.Function is skipped:
    ~35 us of host time per call on a 2-core CPU, which the engine's eager prefill pays per layer)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def kernel_linear(x_MK, weight_NK, bias_N, forward_fn, *args) -> torch.Tensor:
    """KernelLinear where a gradient is needed, else `forward_fn` itself (the same bits)."""
    if needs_autograd(x_MK, weight_NK, bias_N):
        return KernelLinear.apply(x_MK, weight_NK, bias_N, forward_fn, args)
    return forward_fn(x_MK, weight_NK, bias_N, *args)


def cublas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows_per_block: int
) -> torch.Tensor:
    """F.linear by the checked cuBLAS blocks: x [..., K], weight [N, K] -> [..., N]."""
    out = kernel_linear(x.reshape(-1, x.shape[-1]), weight, bias, cublas_linear_forward, rows_per_block)
    return out.view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------------- groups
def linear_groups(model: nn.Module) -> list[tuple[LinearGroup, list[nn.Linear]]]:
    """Every nn.Linear of `model` (subclasses included) in its group: a packed qkv_proj / gate_up_proj is
    one group, and so are the separate q/k/v and gate/up layers that it packs; any other layer is its own."""
    packed_modules = getattr(model, "packed_modules", {})  # CausalLM's: packed name -> [(part name, shard)]
    grouped: list[tuple[LinearGroup, list[nn.Linear]]] = []
    seen: set[int] = set()
    for parent in model.modules():
        for packed_name, parts in packed_modules.items():
            packed = getattr(parent, packed_name, None)
            if isinstance(packed, nn.Linear):
                widths = _packed_widths(parent, packed, len(parts))
                grouped.append((LinearGroup(packed.in_features, widths, packed.bias is not None), [packed]))
                seen.add(id(packed))
                continue
            layers = [getattr(parent, name, None) for name, _ in parts]
            if all(isinstance(layer, nn.Linear) for layer in layers):
                widths = tuple(layer.out_features for layer in layers)
                grouped.append(
                    (LinearGroup(layers[0].in_features, widths, layers[0].bias is not None), layers)
                )
                seen.update(id(layer) for layer in layers)
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in seen:
            group = LinearGroup(module.in_features, (module.out_features,), module.bias is not None)
            grouped.append((group, [module]))
    return grouped


def _packed_widths(parent: nn.Module, packed: nn.Linear, num_parts: int) -> tuple[int, ...]:
    if hasattr(parent, "qkv_shard_offsets"):  # decoder.Attention: q, k, v of their own sizes
        return tuple(size for _, size in parent.qkv_shard_offsets().values())
    return (packed.out_features // num_parts,) * num_parts  # gate / up: equal halves


# -------------------------------------------------------------------------------------------------- check
_VERDICTS: dict[tuple, bool] = {}


def rows_check(
    group: LinearGroup, dtype: torch.dtype, device: torch.device, *, graphs: bool | None = None
) -> bool:  # fmt: skip
    """True if cuBLAS gives every row of this group's products the same bits at every row count a call can
    have (module docstring); cached per (group, dtype, device name). `graphs` (default: on CUDA) repeats
    the row counts inside CUDA graphs."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = (group, dtype, name, device.type)
    if key not in _VERDICTS:
        _VERDICTS[key] = _run_rows_check(
            group, dtype, device, device.type == "cuda" if graphs is None else graphs
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the check's temporaries (up to ~0.6 GB for an LM head)
    return _VERDICTS[key]


def _run_rows_check(
    group: LinearGroup, dtype: torch.dtype, device: torch.device, graphs: bool
) -> bool:  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(1234)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device=device).mul(scale).to(dtype)

    num_cols = sum(group.widths)
    rows = block_rows(num_cols)
    x = rand(rows, group.k_dim)
    weight = rand(num_cols, group.k_dim, scale=group.k_dim**-0.5)
    bias = rand(num_cols) if group.has_bias else None
    bounds = [0]
    for width in group.widths:
        bounds.append(bounds[-1] + width)
    parts = [
        (slice(lo, hi), weight[lo:hi].contiguous(), None if bias is None else bias[lo:hi].contiguous())
        for lo, hi in itertools.pairwise(bounds)
    ] if len(group.widths) > 1 else []  # fmt: skip

    def product(x_MK, weight_NK, bias_N):
        out = torch.empty(x_MK.shape[0], weight_NK.shape[0], dtype=dtype, device=device)
        _product(x_MK, weight_NK, bias_N, out)
        return out

    reference = product(x, weight, bias)
    perm = torch.randperm(rows, generator=generator, device=device)
    if not torch.equal(product(x[perm].contiguous(), weight, bias), reference[perm]):
        return False
    for num_rows in range(ROW_QUANTUM, rows + 1, ROW_QUANTUM):
        head, tail = x[:num_rows], x[rows - num_rows :]
        if not torch.equal(product(head, weight, bias), reference[:num_rows]):
            return False
        if not torch.equal(product(tail, weight, bias), reference[rows - num_rows :]):
            return False
        for cols, weight_part, bias_part in parts:
            if not torch.equal(product(head, weight_part, bias_part), reference[:num_rows, cols]):
                return False
    return not graphs or _graphs_check(x, weight, bias, parts, reference, product)


def _graphs_check(x, weight, bias, parts, reference, product) -> bool:
    """The head products (packed and parts) captured in one CUDA graph per row count, replayed."""
    rows = x.shape[0]
    stream = torch.cuda.Stream(device=x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):  # warm-up outside the capture (cuBLAS handle and workspace)
        product(x[:ROW_QUANTUM], weight, bias)
    torch.cuda.current_stream(x.device).wait_stream(stream)
    for num_rows in range(ROW_QUANTUM, rows + 1, ROW_QUANTUM):
        graph = torch.cuda.CUDAGraph()
        head = x[:num_rows]
        with torch.cuda.graph(graph):  # its own pool, freed with the graph and its outputs
            outs = [product(head, weight, bias)] + [product(head, w, b) for _, w, b in parts]
        graph.replay()
        torch.cuda.synchronize(x.device)
        if not torch.equal(outs[0], reference[:num_rows]):
            return False
        for (cols, _, _), out in zip(parts, outs[1:], strict=True):
            if not torch.equal(out, reference[:num_rows, cols]):
                return False
        del graph, outs
    return True


def group_kernel(group: LinearGroup, dtype: torch.dtype, device: torch.device) -> str:
    """`"cublas"` where the group passes the check on this CUDA device, else "triton"."""
    return "cublas" if device.type == "cuda" and rows_check(group, dtype, device) else "triton"


def choose_kernels(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[LinearGroup, str]:
    """Run the check for each distinct group of `model` and set each layer's `cublas_block_rows` (0: the
    Triton kernel). Returns each group's group_kernel."""
    kernels: dict[LinearGroup, str] = {}
    for group, layers in linear_groups(model):
        if group not in kernels:
            kernels[group] = group_kernel(group, dtype, device)
        for layer in layers:
            layer.cublas_block_rows = block_rows(sum(group.widths)) if kernels[group] == "cublas" else 0
    return kernels
