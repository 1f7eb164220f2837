"""bench/batch_invariant_linear.py times the matmuls the model runs: its (K, N) per matmul are the fused
engine model's Linear layers (same shapes), and the step total counts each layer's four once per layer."""

from __future__ import annotations

import sys

import pytest
import torch
from bench_scripts import load_bench, unload_bench

from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM


@pytest.fixture(scope="module")
def bench():
    yield load_bench("batch_invariant_linear")
    unload_bench("batch_invariant_linear")


@pytest.mark.parametrize("shape", ["tiny", "0.5b", "1.5b"])
def test_matmul_shapes_are_the_fused_models_linears(bench, shape):
    mats, num_layers = bench.model_shapes(shape)
    s = sys.modules["engine_throughput"].SHAPES[shape]  # loaded by model_shapes
    args = ModelArgs(
        arch="qwen2", hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
        num_kv_heads=s["num_kv_heads"], intermediate_size=s["intermediate_size"], vocab_size=s["vocab_size"],
        head_dim=s["hidden_size"] // s["num_heads"], tie_word_embeddings=False, qkv_bias=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = CausalLM(args, fused=True)
    layer = model.model.layers[0]
    linears = {
        "qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
        "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj, "lm_head": model.lm_head,
    }  # fmt: skip
    assert num_layers == len(model.model.layers)
    assert mats == {name: (m.in_features, m.out_features) for name, m in linears.items()}


def test_a_run_without_cuda_says_it_needs_one(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["batch_invariant_linear.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main()
