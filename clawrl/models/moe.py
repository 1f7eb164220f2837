"""Mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE: a softmax top-k router over gated SiLU experts.

`SparseMoeBlock` takes the place of the dense MLP in the decoder layers `ModelArgs.is_moe_layer` selects.
Parameter names are the on-disk HF names, so checkpoints load and weight syncs apply without renaming:

    mlp.gate.weight                              router [E, hidden]
    mlp.experts.{e}.gate_proj/up_proj/down_proj  routed expert e (gate_up_proj when the model is fused)
    mlp.shared_expert.*, mlp.shared_expert_gate  Qwen2-MoE only: an always-on expert, scaled by a sigmoid gate

Routing follows transformers: probabilities = softmax(router logits) in fp32, the top-k of them kept (and
renormalised to sum 1 when `norm_topk_prob`), cast back to the activation dtype; a token's output is the
weighted sum of its k experts' outputs. Experts run one at a time on the rows routed to them
(index_select / index_add_), in ascending expert order. That costs one host sync per layer (the per-expert
counts) and one small GEMM per expert; the perf lever is a grouped GEMM over the sorted rows. While a CUDA
graph is being captured the block runs every expert densely on every row instead (weights zero where not
routed): no host sync, same values, E / k times the expert FLOPs.

Load balancing: `record_router_logits(model)` collects each MoE layer's router logits during a forward and
`load_balancing_loss(logits, top_k)` turns them into transformers' auxiliary loss (Switch Transformer):

    with record_router_logits(model) as router_logits:
        hidden = model(input_ids, positions, attn)
    aux = load_balancing_loss(router_logits, top_k=model.args.num_experts_per_tok)

Shapes: N = tokens, H = hidden size, E = routed experts, k = experts per token, L = MoE layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from clawrl.models.config import ModelArgs
from clawrl.models.layers import GatedMLP


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert); [N, H] -> [N, H]."""

    def __init__(self, args: ModelArgs, *, fused: bool):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(args.hidden_size, args.moe_intermediate_size, bias=False, fused=fused)
            for _ in range(args.num_experts)
        )
        self.has_shared_expert = args.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = GatedMLP(
                args.hidden_size, args.shared_expert_intermediate_size, bias=False, fused=fused
            )
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        self.router_logits_sink: list[torch.Tensor] | None = None
        """Set by `record_router_logits`: each forward appends its router logits [N, E] here."""

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        logits_NE = self.gate(x_NH)
        if self.router_logits_sink is not None:
            self.router_logits_sink.append(logits_NE)
        weights_Nk, experts_Nk = route(logits_NE, self.top_k, norm_topk_prob=self.norm_topk_prob)
        if x_NH.is_cuda and torch.cuda.is_current_stream_capturing():
            out_NH = self.dense_experts(x_NH, weights_Nk, experts_Nk)
        else:
            out_NH = self.sparse_experts(x_NH, weights_Nk, experts_Nk)
        if self.has_shared_expert:
            out_NH = out_NH + torch.sigmoid(self.shared_expert_gate(x_NH)) * self.shared_expert(x_NH)
        return out_NH

    def sparse_experts(self, x_NH, weights_Nk, experts_Nk) -> torch.Tensor:
        """Each expert on only the rows routed to it; results index_add_-ed into zeros."""
        out_NH = torch.zeros_like(x_NH)
        flat_experts = experts_Nk.reshape(-1)
        # Assignments (token, slot) sorted by expert; a stable sort keeps tokens in order within an expert.
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()  # the one host sync
        flat_weights = weights_Nk.reshape(-1)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = order[start : start + count]
                tokens = rows // self.top_k
                y = expert(x_NH.index_select(0, tokens)) * flat_weights.index_select(0, rows)[:, None]
                out_NH.index_add_(0, tokens, y.to(out_NH.dtype))
            start += count
        return out_NH

    def dense_experts(self, x_NH, weights_Nk, experts_Nk) -> torch.Tensor:
        """Every expert on every row, weighted by its routing weight (zero where not routed): no host sync,
        so a CUDA graph can capture it. Adding exact zeros leaves the sparse path's sums unchanged."""
        dense_NE = torch.zeros(
            x_NH.shape[0], self.num_experts, dtype=weights_Nk.dtype, device=x_NH.device
        ).scatter(1, experts_Nk, weights_Nk)
        out_NH = torch.zeros_like(x_NH)
        for e, expert in enumerate(self.experts):
            out_NH = out_NH + expert(x_NH) * dense_NE[:, e : e + 1]
        return out_NH


def route(logits_NE: torch.Tensor, top_k: int, *, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [N, k] in the logits' dtype, expert ids [N, k]) from router logits [N, E]."""
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    top_probs_Nk, experts_Nk = torch.topk(probs_NE, top_k, dim=-1)
    if norm_topk_prob:
        top_probs_Nk = top_probs_Nk / top_probs_Nk.sum(dim=-1, keepdim=True)
    return top_probs_Nk.to(logits_NE.dtype), experts_Nk


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """transformers' MoE auxiliary loss over the given rows of every MoE layer (pass only real tokens):

        E * sum_e f_e * P_e,   f_e = (top-k assignments to e) / rows,   P_e = mean router probability of e,

    both pooled over all layers' rows together (as transformers does), fp32. Gradients flow through P only.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    probs_RE = torch.softmax(torch.cat([t.float() for t in router_logits]), dim=-1)
    num_rows, num_experts = probs_RE.shape
    chosen_Rk = torch.topk(probs_RE, top_k, dim=-1).indices
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=probs_RE.device)
    counts_E.index_add_(0, chosen_Rk.reshape(-1), torch.ones(chosen_Rk.numel(), device=probs_RE.device))
    fraction_E = counts_E / max(num_rows, 1)
    mean_prob_E = probs_RE.sum(dim=0) / max(num_rows, 1)
    return num_experts * (fraction_E * mean_prob_E).sum()


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The MoE blocks of `model`, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every MoE layer's forward appends its router logits [N, E] to the yielded list
    (with autograd history, so a loss built from them trains the routers). Dense models yield []."""
    sink: list[torch.Tensor] = []
    blocks = moe_blocks(model)
    for block in blocks:
        block.router_logits_sink = sink
    try:
        yield sink
    finally:
        for block in blocks:
            block.router_logits_sink = None


def moe_aux_loss_metric(model: nn.Module, router_logits: Sequence[torch.Tensor], weight: float):
    """`weight` * the load-balancing loss of one forward, detached (a micro-batch's share of a step's
    token-weighted mean); None for a dense model or a forward without MoE rows."""
    args = getattr(model, "args", None)
    if not router_logits or args is None or not getattr(args, "is_moe", False):
        return None
    return (load_balancing_loss(router_logits, args.num_experts_per_tok) * weight).detach()
