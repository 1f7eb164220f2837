"""The decoder's forward for the engine's GPU step, on the model's own parameters, with fused Triton kernels.

Same math as `CausalLM.forward` (clawrl/models/decoder.py) — the kernels in triton_ops.py reproduce the eager
ops' rounding — but ~10 kernels per layer instead of ~40, which is what a decode step at batch 256 is made
of once CUDA graphs remove the launch cost:

    norm(x + residual) | qkv GEMM | RoPE + KV-cache write | paged attention | o GEMM | norm(x + residual)
    | gate_up GEMM | silu * up | down GEMM

The residual stream is carried separately and added inside the next norm (`add_rmsnorm`), so `x + attn(...)`
and `x + mlp(...)` cost no kernel of their own. Qwen3's q/k norms run as the model's RMSNorm modules before
RoPE. Needs a model built with `fused=True` (packed qkv_proj and gate_up_proj).

Shapes: N = tokens, H = hidden size, Hq / Hkv = query / KV heads, D = head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clawrl.engine.kv_cache import KVCache
from clawrl.engine.paged_attention import TritonPagedAttention
from clawrl.engine.triton_ops import add_rmsnorm, rotary_cache_write, silu_and_mul
from clawrl.models.decoder import Attention, CausalLM


def fused_forward(
    model: CausalLM,
    input_ids_N: torch.Tensor,
    positions_N: torch.Tensor,
    attention: TritonPagedAttention,
    kv_cache: KVCache,
) -> torch.Tensor:
    """input_ids, positions [N] -> final-normed hidden states [N, H]; writes the step's K/V into kv_cache.

    `attention.begin(...)` must have been called with this step's layout (its slot mapping is used here).
    """
    assert model.fused, "fused_forward needs CausalLM(args, fused=True)"
    batch = attention.batch
    assert batch is not None, "attention.begin() must be called before the forward"
    rotary = model.model.rotary_emb
    x = model.model.embed_tokens(input_ids_N)
    residual = None
    for layer in model.model.layers:
        norm = layer.input_layernorm
        hidden, residual = add_rmsnorm(x, residual, norm.weight, norm.eps)
        attn = layer.self_attn
        q = _qkv_rope_cache(attn, hidden, positions_N, rotary, batch.slot_mapping_N, kv_cache)
        out = attention.attend(attn.layer_idx, q, attn.scale)
        x = F.linear(out.view(out.shape[0], attn.q_size), attn.o_proj.weight, attn.o_proj.bias)
        norm = layer.post_attention_layernorm
        hidden, residual = add_rmsnorm(x, residual, norm.weight, norm.eps)
        mlp = layer.mlp
        gate_up = F.linear(hidden, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        x = F.linear(silu_and_mul(gate_up), mlp.down_proj.weight, mlp.down_proj.bias)
    norm = model.model.norm
    hidden, _ = add_rmsnorm(x, residual, norm.weight, norm.eps)
    return hidden


def _qkv_rope_cache(attn: Attention, hidden, positions_N, rotary, slot_mapping_N, kv_cache: KVCache):
    """Project to q/k/v, rotate q (returned, [N, Hq, D]) and write rotated k and v into the layer's cache."""
    num_tokens = hidden.shape[0]
    qkv = F.linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(num_tokens, attn.num_heads, attn.head_dim)
    k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    rotary_cache_write(
        q, k, v, positions_N, rotary.cos_cache, rotary.sin_cache, slot_mapping_N,
        kv_cache.k[attn.layer_idx], kv_cache.v[attn.layer_idx],
    )  # fmt: skip
    return q
