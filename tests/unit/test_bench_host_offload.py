"""bench/host_offload.py moves the tensors a colocated trainer moves: its parameter list is the real model's
(same shapes, same count), and a CPU run of the script reports every timing."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench, unload_bench

from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM


@pytest.fixture(scope="module")
def host_offload():
    yield load_bench("host_offload")
    unload_bench("host_offload")


@pytest.mark.parametrize("shape", ["tiny", "0.5b"])
def test_parameter_shapes_are_the_models(host_offload, shape):
    s = host_offload.SHAPES[shape]
    args = ModelArgs(
        arch="qwen2", hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
        num_kv_heads=s["kv_heads"], intermediate_size=s["inter"], vocab_size=s["vocab"],
        head_dim=s["hidden"] // s["heads"], tie_word_embeddings=True, qkv_bias=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = CausalLM(args)
    real = sorted(tuple(p.shape) for p in model.parameters())
    assert sorted(host_offload.parameter_shapes(shape)) == real


def test_cpu_run_reports_every_timing(host_offload, tmp_path):
    result = host_offload.measure("tiny", "cpu", repeats=2)
    for key in ("offload_s", "onload_s", "onload_allocations_s", "one_buffer_h2d_s", "one_buffer_d2h_s"):
        assert result[key] > 0, key
    expected = (
        sum(4 * 4 * torch.Size(d).numel() for d in host_offload.parameter_shapes("tiny")) * 7 / 8
    )  # 3 fp32 + 1 bf16
    assert result["gbytes"] == pytest.approx(expected / 1e9)
