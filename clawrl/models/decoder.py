"""CausalLM: the Qwen2/Qwen2.5, Qwen3 and Llama decoder family, once, with HF parameter names; Qwen3-MoE and
Qwen2-MoE swap the MLP of their MoE layers for clawrl.models.moe.SparseMoeBlock.

The same module serves both execution modes: the trainer runs it over
packed full sequences (`VarlenAttention`, autograd), the engine over a paged KV cache (its own
AttentionBackend). The model sees flat tokens only and never branches on tensor values, so a forward can
be captured in a CUDA graph.

    model = CausalLM(args)                      # HF names: state_dict() keys == checkpoint keys
    model = CausalLM(args, fused=True)          # engine fast path: self_attn.qkv_proj, mlp.gate_up_proj
    hidden = model(input_ids, positions, attn)  # [N] ids, [N] positions -> [N, hidden] (final norm applied)
    logits = model.compute_logits(hidden[last]) # [M, hidden] -> [M, vocab]

Shapes: N = tokens, Hq / Hkv = query / key-value heads, D = head_dim.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from clawrl.models.attention import AttentionBackend
from clawrl.models.config import ModelArgs
from clawrl.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, TrainKernelSwitch, apply_rotary_qk
from clawrl.models.loader import PackedWeightLoader, default_weight_loader
from clawrl.models.moe import SparseMoeBlock


class Attention(TrainKernelSwitch, nn.Module):
    """Projections, optional q/k norm (Qwen3) and RoPE; the attention itself is the backend's."""

    batch_invariant: bool = False
    """Set by clawrl.models.batch_invariant.enable_batch_invariant: attention through its kernel."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, fused: bool):
        super().__init__()
        self.layer_idx, self.fused = layer_idx, fused
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        if fused:
            self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(args.hidden_size, self.q_size, bias=args.qkv_bias)
            self.k_proj = nn.Linear(args.hidden_size, self.kv_size, bias=args.qkv_bias)
            self.v_proj = nn.Linear(args.hidden_size, self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.attention_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def qkv_shard_offsets(self) -> dict[str, tuple[int, int]]:
        """Rows of q, k and v inside the packed qkv_proj (its weight loader's layout)."""
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.fused:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_qk(q, k, cos, sin, fused=self.use_train_kernels(q))
        if self.batch_invariant:  # --true-on-policy-mode: one attention kernel for engine and trainer
            from clawrl.models.batch_invariant import attend

            out = attend(attn, self.layer_idx, q, k, v, self.scale)
        else:
            out = attn.forward(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, fused: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx, fused=fused)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(args, fused=fused)
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias, fused=fused)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """HF's `model.` submodule: embedding, decoder layers, final norm (+ the RoPE tables, not saved)."""

    def __init__(self, args: ModelArgs, *, fused: bool):
        super().__init__()
        # nn.Embedding's own normal_ init on the meta device (where models are built before loading a
        # checkpoint) imports torch._dynamo: ~1.5 s of every engine and trainer start. Pass the table and
        # initialise it only when it holds real memory.
        table = torch.empty(args.vocab_size, args.hidden_size)
        if not table.is_meta:
            nn.init.normal_(table)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(args, i, fused=fused) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling
        )


class CausalLM(nn.Module):
    """Decoder + LM head. fused=False: exact HF parameter names; fused=True: packed qkv and gate_up."""

    packed_modules = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    """Packed module name -> the HF modules it holds, with their shard ids (used by load and export)."""

    def __init__(self, args: ModelArgs, *, fused: bool = False):
        super().__init__()
        self.args, self.fused = args, fused
        self.model = DecoderModel(args, fused=fused)
        # A tied head reuses the embedding; building its own weight on meta avoids a throwaway allocation.
        with torch.device("meta") if args.tie_word_embeddings else contextlib.nullcontext():
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._tie_and_attach_loaders()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions [N] -> final-normed hidden states [N, hidden_size]."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, attn)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden_size] -> logits [M, vocab_size] (in the model's dtype)."""
        return self.lm_head(hidden)

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> CausalLM:
        """Materialise a meta-built model on `device` (uninitialised weights) with valid RoPE tables."""
        # Not nn.Module.to_empty: its empty_like of a meta tensor runs torch's Python reference, which
        # imports sympy (~0.8 s of an engine's start-up, which needs no sympy otherwise); torch.empty does not.
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=recurse)
        self.model.rotary_emb.reset_cache()
        return self

    def _apply(self, fn, recurse: bool = True):
        # Module._apply may replace Parameter objects (meta -> real device in to_empty, for one): that
        # drops attributes such as `weight_loader` and unties lm_head from the embedding. Restore both.
        super()._apply(fn, recurse)
        self._tie_and_attach_loaders()
        if getattr(self, "tp_shard", None) is not None:  # a tensor-parallel shard (clawrl/models/tp.py)
            self.tp_shard.attach_loaders(self)  # keeps this rank's slice of the full tensors it is given
        return self

    def _tie_and_attach_loaders(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for param in self.parameters():
            param.weight_loader = default_weight_loader
        if not self.fused:
            return
        for layer in self.model.layers:
            qkv_loader = PackedWeightLoader(layer.self_attn.qkv_shard_offsets())
            for param in layer.self_attn.qkv_proj.parameters():
                param.weight_loader = qkv_loader
        # Every gated MLP (the dense one, each routed expert, a shared expert) packs [gate; up] its own size.
        for mlp in self.modules():
            if isinstance(mlp, GatedMLP):
                intermediate = mlp.down_proj.in_features
                gate_up_loader = PackedWeightLoader({0: (0, intermediate), 1: (intermediate, intermediate)})
                for param in mlp.gate_up_proj.parameters():
                    param.weight_loader = gate_up_loader
