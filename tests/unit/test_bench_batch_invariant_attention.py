"""bench/batch_invariant_attention.py: its shapes are the benchmarked models' attention, and its fp32
reference (keys gathered through the shuffled page table, causal mask per row) is what the kernel computes:
checked on CPU with the kernel under the Triton interpreter."""

from __future__ import annotations

import sys

import pytest
import torch
from bench_scripts import load_bench, unload_bench
from interpreted_triton import replace_tests_if_triton_was_imported_too_early  # before triton

from clawrl.models import batch_invariant as bi


@pytest.fixture(scope="module")
def bench():
    yield load_bench("batch_invariant_attention")
    unload_bench("batch_invariant_attention")


@pytest.mark.parametrize("shape", ["0.5b", "1.5b"])
def test_shapes_are_the_engine_benchmarks_models(bench, shape):
    engine = load_bench("engine_throughput")
    try:
        s = engine.SHAPES[shape]
        want = (s["num_heads"], s["num_kv_heads"], s["hidden_size"] // s["num_heads"], s["num_layers"])
    finally:
        unload_bench("engine_throughput")
    assert bench.SHAPES[shape] == want


def test_reference_is_the_kernels_attention_over_the_paged_cache(bench):
    batch, prompt, heads, kv_heads, dim = 3, 21, 4, 2, 16  # 21 positions over two 16-slot pages
    k_cache, v_cache, table = bench.paged_cache(batch, prompt, kv_heads, dim, device="cpu")
    q = torch.randn(batch * prompt, heads, dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    seq = torch.arange(batch).repeat_interleave(prompt)
    pos = torch.arange(prompt).repeat(batch)
    starts = torch.arange(0, batch * prompt + 1, prompt)
    blocks = bi.segment_blocks(starts, batch * prompt, bi.attention_block_m(heads, kv_heads))
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    got = bi.attention_forward(q, k_rows, v_rows, pos, blocks, table, 0.25, page=bench.PAGE)
    want = bench.reference(q, k_cache, v_cache, table, pos, seq, 0.25)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)  # one bf16 rounding of the output
    alone = bi.attention_forward(q, k_rows, v_rows, pos, bi.token_blocks(seq), table, 0.25, page=bench.PAGE)
    assert torch.equal(got, alone)


def test_a_run_without_cuda_says_it_needs_one(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["batch_invariant_attention.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main()


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
