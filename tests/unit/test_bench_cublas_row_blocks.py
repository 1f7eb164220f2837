"""bench/cublas_row_blocks.py checks and times the groups the model has: its groups and their counts per
forward are cublas_rows.linear_groups of a Qwen2.5-shaped model (the engine's packed one)."""

from __future__ import annotations

import collections

import pytest
import torch
from bench_scripts import load_bench, unload_bench

from clawrl.models import cublas_rows as cr
from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM


@pytest.fixture(scope="module")
def bench():
    yield load_bench("cublas_row_blocks")
    unload_bench("cublas_row_blocks")


@pytest.mark.parametrize("shape", ["0.5b", "1.5b"])
def test_the_bench_times_the_models_groups(bench, shape):
    hidden, heads, kv_heads, inter, layers = bench.SHAPES[shape]
    args = ModelArgs(
        arch="qwen2", hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=inter, vocab_size=bench.VOCAB, head_dim=hidden // heads, tie_word_embeddings=True,
        qkv_bias=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = CausalLM(args, fused=True)
    counts = collections.Counter(group for group, _ in cr.linear_groups(model))
    assert counts == collections.Counter(dict(bench.groups_of(shape).values()))
