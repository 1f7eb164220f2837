"""Triton paged attention (decode with and without split-K, prefill over a cached prefix) against the fp32 torch
definition, on ragged contexts crossing blocks, GQA group 7 and block_size 16. Run by the Triton interpreter
on CPU (compiled kernels on a GPU machine)."""

import pytest
import torch
from interpreted_triton import (  # before clawrl.engine.triton_*: sets TRITON_INTERPRET
    DEVICE,
    replace_tests_if_triton_was_imported_too_early,
)

from clawrl.engine.runner.triton_attention import (
    decode_num_splits,
    paged_attention_reference,
    paged_decode_attention,
    paged_prefill_attention,
    plan_prefill_tiles,
    prefill_block_m,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def paged_cache(ctx_lens, *, num_kv_heads, head_dim, page, dtype, seed=0):
    """Random K/V in a cache of shuffled blocks, and each sequence's block table (width padded)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // page) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3  # a few blocks nobody owns: they must never be read
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(device=DEVICE, dtype=dtype)
    v_cache = torch.randn(shape, generator=generator).to(device=DEVICE, dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(ctx_lens), max(blocks_needed) + 2, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = order[used : used + n]
        used += n
    return k_cache, v_cache, tables.to(DEVICE)


def query(num_tokens, num_heads, head_dim, dtype, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(device=DEVICE, dtype=dtype)


def bounds(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference_gqa7_ragged(dtype, num_splits):
    ctx_lens = [1, 16, 17, 70, 0, 130]  # one key, exactly one block, crossing blocks, padding row
    k_cache, v_cache, tables = paged_cache(ctx_lens, num_kv_heads=2, head_dim=64, page=16, dtype=dtype)
    q = query(len(ctx_lens), 14, 64, dtype)
    scale = 64**-0.5
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(ctx_lens, device=DEVICE), scale, num_splits=num_splits
    )
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, bounds([1] * len(ctx_lens)), ctx_lens, scale
    )
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert not out[4].any()  # a sequence without context (CUDA-graph padding) gives zeros


def test_decode_head_dim_not_a_power_of_two_and_one_kv_head():
    ctx_lens = [5, 33]
    k_cache, v_cache, tables = paged_cache(ctx_lens, num_kv_heads=1, head_dim=40, page=8, dtype=torch.float32)
    q = query(2, 3, 40, torch.float32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(ctx_lens, device=DEVICE), 0.3)
    want = paged_attention_reference(q, k_cache, v_cache, tables, [0, 1, 2], ctx_lens, 0.3)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_prefix_and_mixed_decode(dtype):
    # fresh prompt; chunk after a 16-token cached prefix; a decode token; a long chunk after 3 cached tokens
    query_lens, ctx_lens = [20, 9, 1, 37], [20, 25, 48, 40]
    k_cache, v_cache, tables = paged_cache(ctx_lens, num_kv_heads=2, head_dim=64, page=16, dtype=dtype)
    query_start = bounds(query_lens)
    q = query(query_start[-1], 14, 64, dtype)
    tile_seq, tile_first = plan_prefill_tiles(query_lens, prefill_block_m(14, 2))
    assert prefill_block_m(14, 2) == 16 and tile_seq == [0, 0, 1, 2, 3, 3, 3]
    as_tensor = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    out = paged_prefill_attention(
        q, k_cache, v_cache, tables, as_tensor(query_start), as_tensor(ctx_lens),
        as_tensor(tile_seq), as_tensor(tile_first), 0.125,
    )  # fmt: skip
    want = paged_attention_reference(q, k_cache, v_cache, tables, query_start, ctx_lens, 0.125)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_num_splits_fills_the_multiprocessors():
    h200 = 132
    assert decode_num_splits(256, 2, h200) == 1
    assert decode_num_splits(64, 2, h200) == 4  # 128 programs -> 512
    assert decode_num_splits(8, 2, h200) == 16
    assert decode_num_splits(1, 2, h200) == 16  # capped
    assert decode_num_splits(4, 2, num_sms=4) == 1


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
