"""ModelArgs from HF configs (transformers 5 and 4.x layouts), unsupported features as clear errors, and the
small layers (RMSNorm, RoPE incl. Llama-3 scaling) against hand-computed numbers and transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from clawrl.models.config import ModelArgs, load_model_args
from clawrl.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, rope_inv_freq

# Llama-3.1-8B's config.json as transformers 4.x wrote it (legacy rope_scaling + torch_dtype).
LLAMA31_LEGACY = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

# Qwen2.5-0.5B-Instruct's config.json (4.x layout).
QWEN25_LEGACY = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_llama31_legacy_config():
    args = ModelArgs.from_hf_config(LLAMA31_LEGACY)
    assert (args.arch, args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (
        "llama",
        32,
        32,
        8,
        128,
    )
    assert args.rope_theta == 500000.0 and args.rms_norm_eps == 1e-5
    assert args.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert args.eos_token_ids == [128001, 128008, 128009] and args.bos_token_id == 128000
    assert args.torch_dtype == "bfloat16" and not args.tie_word_embeddings
    assert not (args.qkv_bias or args.attention_bias or args.mlp_bias or args.qk_norm)


def test_qwen25_legacy_config_has_qkv_bias_only():
    args = ModelArgs.from_hf_config(QWEN25_LEGACY)
    assert (args.arch, args.head_dim, args.num_kv_heads, args.rope_theta) == ("qwen2", 64, 2, 1e6)
    assert args.qkv_bias and not args.attention_bias and not args.qk_norm
    assert args.tie_word_embeddings and args.rope_scaling is None and args.eos_token_ids == [151645]


@pytest.mark.parametrize(
    "config, expected",
    [
        (Qwen3Config(head_dim=96, attention_bias=True), dict(arch="qwen3", head_dim=96, qk_norm=True, qkv_bias=True, attention_bias=True)),
        (Qwen2Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2), dict(arch="qwen2", head_dim=32, qkv_bias=True, attention_bias=False)),
        (LlamaConfig(mlp_bias=True, rope_theta=12345.0), dict(arch="llama", mlp_bias=True, rope_theta=12345.0, rope_scaling=None)),
    ],
)  # fmt: skip
def test_transformers5_configs(config, expected):
    args = ModelArgs.from_hf_config(config.to_dict())
    assert {key: getattr(args, key) for key in expected} == expected


def test_load_model_args_merges_generation_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_LEGACY))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert load_model_args(tmp_path).eos_token_ids == [151645, 151643]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, r"model_type='mistral' is not implemented natively"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"RoPE scaling type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"use_sliding_window": True}, r"use_sliding_window=true is not supported"),
        ({"num_key_value_heads": 3}, r"num_heads=14 is not a multiple of num_kv_heads=3"),
        ({"vocab_size": None}, r"missing required field\(s\) \['vocab_size'\]"),
    ],
)
def test_unsupported_configs_name_file_and_value(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_LEGACY, **change}))
    with pytest.raises(ValueError, match=message) as e:
        load_model_args(tmp_path)
    assert str(e.value).startswith(f"{tmp_path}/config.json: ")


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: file not found"):
        load_model_args(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: not valid JSON"):
        load_model_args(tmp_path)


def test_llama3_inv_freq_by_hand():
    """head_dim 4, theta 10000: inv_freq = [1, 0.01], wavelengths [2*pi, 200*pi]. With context 16, low 1,
    high 4: 2*pi lies in [16/4, 16/1] (blended), 200*pi > 16 (divided by factor 8)."""
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    blend = (16 / (2 * math.pi) - 1) / (4 - 1)
    expected = torch.tensor([(1 - blend) / 8 + blend, 0.01 / 8])
    assert torch.allclose(rope_inv_freq(4, 10000.0, scaling), expected, rtol=1e-6, atol=0)
    assert torch.allclose(rope_inv_freq(4, 10000.0, None), torch.tensor([1.0, 0.01]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_inv_freq_equals_transformers(rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type == "llama3":
        rope.update(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        )
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_scaling=rope)
    expected = LlamaRotaryEmbedding(config).inv_freq
    args = ModelArgs.from_hf_config(config.to_dict())
    assert torch.equal(rope_inv_freq(128, args.rope_theta, args.rope_scaling), expected)


def test_rotary_rotates_pairs_by_position_angle():
    """head_dim 2 (one pair), inv_freq 1: position p rotates (x1, x2) by angle p."""
    rope = RotaryEmbedding(head_dim=2, max_positions=8, theta=10000.0, scaling=None)
    positions = torch.tensor([0, 1, 3])
    cos, sin = rope(positions)
    x = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 2.0]]])  # [N=3, H=1, D=2]
    out = apply_rotary(x, cos, sin)
    expected = torch.tensor(
        [[[1.0, 0.0]], [[math.cos(1), math.sin(1)]], [[-2 * math.sin(3), 2 * math.cos(3)]]]
    )
    assert torch.allclose(out, expected, atol=1e-6)


def test_rmsnorm_by_hand_and_dtype_handling():
    norm = RMSNorm(2, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0]))
    rms = math.sqrt((3**2 + 4**2) / 2)
    assert torch.allclose(norm(torch.tensor([[3.0, 4.0]])), torch.tensor([[3 / rms, 8 / rms]]), rtol=1e-6)
    # bf16 input: statistics in fp32, normalised value rounded to bf16 before the weight (as transformers).
    x = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
    normalised = (torch.tensor([[3.0, 4.0]]) / rms).to(torch.bfloat16)
    assert torch.equal(
        norm.to(torch.bfloat16)(x), normalised * torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    )
