"""Every Triton kernel of the GPU path compiles for an H100/H200 (sm_90) with the arguments its wrapper passes.

No GPU is needed: in a subprocess (without TRITON_INTERPRET) each kernel launch of the wrappers is replaced by
`triton.compile(..., target=sm_90)` down to a cubin, using Triton's bundled ptxas. The interpreter, which the
numerical tests use on CPU, accepts things the compiler rejects (dtype mixing in tl.dot, shapes under 16,
loop-carried type changes); this catches those before a GPU run does. Run by hand:

    .venv/bin/python tests/unit/test_triton_compile.py
"""

import os

import pytest
from sm90_compile import compiling_for_sm90, run_compile_script


def compile_all_kernels() -> list[str]:
    """Drive every wrapper with 0.5B-shaped CPU tensors; each launch compiles for sm_90 instead of running."""
    with compiling_for_sm90() as compiled:
        _drive_all_kernels()
    return compiled


def _drive_all_kernels() -> None:
    import torch

    from clawrl.engine.runner import triton_attention as attention
    from clawrl.engine.runner import triton_ops as ops
    from clawrl.models.layers import RotaryEmbedding

    n, hq, hkv, d, page, hidden, vocab = 8, 14, 2, 64, 16, 896, 151936
    for dtype in (torch.bfloat16, torch.float32):
        k_cache = torch.zeros(10, page, hkv, d, dtype=dtype)
        q = torch.zeros(n, hq + 2 * hkv, d, dtype=dtype)[:, :hq]  # a strided view, like the fused qkv
        tables = torch.zeros(n, 4, dtype=torch.int32)
        lens = torch.ones(n, dtype=torch.int64)
        for splits in (1, 4):
            attention.paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.125, num_splits=splits)
        starts = torch.arange(n + 1)
        attention.paged_prefill_attention(q, k_cache, k_cache, tables, starts, lens, lens, lens, 0.125)
    x = torch.zeros(n, hidden, dtype=torch.bfloat16)
    ops.add_rmsnorm(x, None, torch.ones(hidden, dtype=torch.bfloat16), 1e-6)
    ops.add_rmsnorm(x, x.clone(), torch.ones(hidden, dtype=torch.bfloat16), 1e-6)
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    qkv = torch.zeros(n, hq + 2 * hkv, d, dtype=torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    cache = torch.zeros(10, page, hkv, d, dtype=torch.bfloat16)
    ops.rotary_cache_write(q, k, v, lens, rope.cos_cache, rope.sin_cache, lens, cache, cache)
    ops.silu_and_mul(torch.zeros(n, 2 * 4864, dtype=torch.bfloat16))
    logits = torch.zeros(n, vocab, dtype=torch.bfloat16)
    for sample in (False, True):
        ops.sample_rows(logits, lens, torch.ones(n), lens, lens, torch.ones(n), sample=sample)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    compiled = run_compile_script(__file__)
    assert sorted(set(compiled)) == [
        "_add_rmsnorm_kernel", "_decode_kernel", "_merge_splits_kernel", "_prefill_kernel",
        "_rotary_cache_kernel", "_sample_merge_kernel", "_sample_partial_kernel", "_silu_and_mul_kernel",
    ]  # fmt: skip
    assert len(compiled) == 16


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.exit("run without TRITON_INTERPRET", returncode=2)
    print(" ".join(compile_all_kernels()))
