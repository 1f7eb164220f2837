"""Batch-invariant kernels of clawrl/models/batch_invariant.py (--true-on-policy-mode), run by the Triton
interpreter on CPU (compiled on a GPU machine): each equals its eager definition, and row i's result is the
same bits whether computed in a batch of 1, 3 or 17 rows; the linear layer's columns are the same bits alone
or inside a packed weight (the engine's qkv_proj vs the trainer's q/k/v); attention reads the same keys
through a paged block table and through packed sequences with equal results. Also the model switch and the
gradients the trainer needs. Run by hand:

    .venv/bin/pytest -q tests/unit/test_batch_invariant.py
"""

import pytest
import torch
from interpreted_triton import DEVICE, replace_tests_if_triton_was_imported_too_early  # before triton

from clawrl.models import batch_invariant as bi
from clawrl.models import cublas_rows
from clawrl.models.attention import VarlenAttention
from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM
from clawrl.models.layers import RMSNorm, TrainKernelSwitch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_eager_and_is_row_and_column_invariant(dtype):
    x, w, b = randn(17, 40, dtype=dtype), randn(70, 40, dtype=dtype, seed=1), randn(70, dtype=dtype, seed=2)
    y = bi.linear(x, w, b)
    want = x.float() @ w.float().t() + b.float()
    # bf16: one output rounding (the interpreter truncates instead of rounding to nearest)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.13, "rtol": 1e-2}
    torch.testing.assert_close(y.float(), want, **tol)
    for rows in (slice(3, 4), slice(2, 5)):  # 1 and 3 rows vs 17
        assert torch.equal(bi.linear(x[rows], w, b), y[rows])
    # q/k/v cut from a packed qkv weight at offsets that are not tile multiples
    for cols in (slice(0, 24), slice(24, 40), slice(40, 70)):
        assert torch.equal(bi.linear(x, w[cols], b[cols]), y[:, cols])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_split_k_keeps_every_bit(dtype):
    # K = 100: four chunks of LINEAR_CHUNK_K (32 here), the last partial; 7 x 20 outputs is one tile, so the
    # shape's own choice splits (fewer programs than LINEAR_INTERPRETED_CORES)
    k_dim = 100
    x, w = randn(7, k_dim, dtype=dtype), randn(20, k_dim, dtype=dtype, seed=1, scale=0.1)
    b = randn(20, dtype=dtype, seed=2)
    assert bi.linear_splits(7, 20, k_dim, bi.LINEAR_TILES_DECODE, torch.device(DEVICE)) == 4
    whole = bi.linear_forward(x, w, b, split=False)
    torch.testing.assert_close(
        whole.float(), x.float() @ w.float().t() + b.float(), **({"atol": 1e-5, "rtol": 1e-5}
        if dtype == torch.float32 else {"atol": 0.05, "rtol": 1e-2})
    )  # fmt: skip
    assert torch.equal(bi.linear_forward(x, w, b, split=True), whole)
    assert torch.equal(bi.linear_forward(x, w, b), whole)  # the choice by shape: split
    assert torch.equal(bi.linear_forward(x, w, None, split=True), bi.linear_forward(x, w, None, split=False))
    # a row alone, in a batch too big to split, and columns cut from the packed weight: the same bits
    tall = torch.cat([x] + [randn(7, k_dim, dtype=dtype, seed=10 + i) for i in range(6)])  # 49 rows, 4 tiles
    assert bi.linear_splits(49, 20, k_dim, bi.LINEAR_TILES_DECODE, torch.device(DEVICE)) == 1
    assert torch.equal(bi.linear_forward(tall, w, b)[:7], whole)
    assert torch.equal(bi.linear_forward(x[2:3], w, b), whole[2:3])
    assert torch.equal(bi.linear_forward(x, w[5:17], b[5:17], split=True), whole[:, 5:17])


def test_linear_without_a_second_chunk_never_splits():
    assert bi.linear_splits(1, 8, bi.LINEAR_CHUNK_K, bi.LINEAR_TILES_DECODE, torch.device(DEVICE)) == 1
    assert bi.linear_splits(1, 8, bi.LINEAR_CHUNK_K + 1, bi.LINEAR_TILES_DECODE, torch.device(DEVICE)) == 2


def test_linear_gradients_are_eager():
    x, w, b = randn(5, 12).requires_grad_(), randn(7, 12, seed=1).requires_grad_(), randn(7, seed=2)
    b.requires_grad_()
    grads = torch.autograd.grad(bi.linear(x, w, b).pow(2).sum(), (x, w, b))
    x_, w_, b_ = (t.detach().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(torch.nn.functional.linear(x_, w_, b_).pow(2).sum(), (x_, w_, b_))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_rms_norm_matches_eager_and_is_row_invariant():
    x, w = randn(17, 3, 24, scale=3.0), randn(24, seed=1)
    y = bi.rms_norm(x, w, 1e-6)
    norm = RMSNorm(24, 1e-6).to(DEVICE)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(y, norm(x), atol=1e-6, rtol=1e-5)
    for rows in (slice(4, 5), slice(0, 3)):
        assert torch.equal(bi.rms_norm(x[rows], w, 1e-6), y[rows])


def test_log_probs_of_matches_log_softmax_and_is_row_invariant():
    generator = torch.Generator().manual_seed(3)
    logits, tokens = randn(17, 1100, scale=4.0), torch.randint(0, 1100, (17,), generator=generator).to(DEVICE)
    temps = torch.tensor([0.7] * 8 + [0.0] * 9, device=DEVICE)  # 0: a greedy row, reported at T = 1
    lp, _ = bi.log_probs_of(logits, tokens, temps)
    scaled = logits / torch.where(temps == 0, 1.0, temps)[:, None]
    want = torch.log_softmax(scaled.double(), -1).gather(1, tokens[:, None])[:, 0]
    # fp32 arithmetic: a couple of ulps of the value (log-probs down to ~-40 here, where an ulp is 3.8e-6)
    torch.testing.assert_close(lp.double(), want, atol=2e-6, rtol=3e-7)
    for rows in (slice(9, 10), slice(6, 9)):
        assert torch.equal(bi.log_probs_of(logits[rows], tokens[rows], temps[rows])[0], lp[rows])
    # The trainer passes one float; the engine a per-row tensor: the same op.
    assert torch.equal(bi.log_probs_of(logits[:8], tokens[:8], 0.7)[0], lp[:8])
    out = torch.empty(17, device=DEVICE)
    assert torch.equal(bi.sampled_log_probs(logits, tokens, temps, out=out), lp)


def test_log_probs_of_entropy_and_gradients():
    logits = randn(6, 300, scale=2.0).requires_grad_()
    tokens = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    lp, entropy = bi.log_probs_of(logits, tokens, 0.9, with_entropy=True)
    grads = torch.autograd.grad((lp * 0.3 + entropy * 0.7).sum(), logits)[0]
    ref_logits = logits.detach().requires_grad_()
    log_p = torch.log_softmax(ref_logits / 0.9, -1)
    ref_lp, ref_entropy = log_p.gather(1, tokens[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    ref_grads = torch.autograd.grad((ref_lp * 0.3 + ref_entropy * 0.7).sum(), ref_logits)[0]
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads, ref_grads, atol=1e-6, rtol=1e-4)


def packed_qkv(lengths, seed=0, heads=4, kv_heads=2, dim=16):
    total = sum(lengths)
    return (
        randn(total, heads, dim, seed=seed),
        randn(total, kv_heads, dim, seed=seed + 1),
        randn(total, kv_heads, dim, seed=seed + 2),
    )


def test_varlen_attention_matches_eager_and_is_batch_invariant():
    lengths = [7, 13, 1]  # 13 keys cross BLOCK_N chunks under the interpreter (8)
    q, k, v = packed_qkv(lengths)
    attn = VarlenAttention.from_lengths(lengths, device=DEVICE)
    out = bi.varlen_attention(q, k, v, attn.cu_seqlens, 0.25)
    torch.testing.assert_close(out, attn.forward(0, q, k, v, 0.25), atol=1e-6, rtol=1e-5)
    alone = VarlenAttention.from_lengths([13], device=DEVICE)
    assert torch.equal(bi.varlen_attention(q[7:20], k[7:20], v[7:20], alone.cu_seqlens, 0.25), out[7:20])


def test_segment_blocks_cover_each_token_once():
    # sequences of 3, 0 and 7 query tokens, then 2 padding tokens; programs of up to 4 tokens
    blocks = bi.segment_blocks(torch.tensor([0, 3, 3, 10], device=DEVICE), 12, 4)
    assert blocks.seq.numel() == 12 // 4 + 3 + 1  # the host's upper bound: no sync for the grid
    used = blocks.count > 0
    got = list(
        zip(blocks.seq[used].tolist(), blocks.token0[used].tolist(), blocks.count[used].tolist(), strict=True)
    )
    assert got == [(0, 0, 3), (2, 3, 4), (2, 7, 3), (2, 10, 2)]  # the padding tail: the last sequence's id
    assert blocks.count[~used].eq(0).all()


def test_a_rows_result_does_not_depend_on_the_tokens_sharing_its_program():
    lengths = [7, 13, 1]  # + 3 padding tokens
    q, k, v = packed_qkv([*lengths, 3], seed=6)
    cu = VarlenAttention.from_lengths(lengths, device=DEVICE).cu_seqlens
    num_tokens = q.shape[0]
    block_m = bi.attention_block_m(4, 2)
    pos, blocks = bi.packed_layout(cu, num_tokens, block_m)
    assert pos[-3:].eq(-1).all() and blocks.count.max() == block_m > 1
    first_rows = cu[:-1].to(torch.int64)
    together = bi.attention_forward(q, k, v, pos, blocks, first_rows, 0.25, page=None)
    seq = torch.searchsorted(cu[1:].to(torch.int64), torch.arange(num_tokens, device=DEVICE), right=True)
    alone = bi.attention_forward(q, k, v, pos, bi.token_blocks(seq.clamp(max=2)), first_rows, 0.25, page=None)
    assert torch.equal(together, alone)
    assert not together[-3:].any()  # padding rows: zeros
    torch.testing.assert_close(together[:21], VarlenAttention(cu, 13).forward(0, q, k, v, 0.25)[:21],
                               atol=1e-6, rtol=1e-5)  # fmt: skip


def test_paged_cache_gives_the_packed_result():
    """The engine's view: one sequence's 13 keys scattered over 4-token pages in a shuffled order; its
    last 5 tokens as a prefill chunk, and its last token as one decode row beside a padding row."""
    lengths = [13]
    q, k, v = packed_qkv(lengths, seed=4)
    packed = bi.varlen_attention(q, k, v, VarlenAttention.from_lengths(lengths).cu_seqlens.to(DEVICE), 0.25)
    page, blocks = 4, [5, 1, 7, 2]
    k_cache, v_cache = torch.zeros(9, page, 2, 16, device=DEVICE), torch.zeros(9, page, 2, 16, device=DEVICE)
    for pos in range(13):
        k_cache[blocks[pos // page], pos % page], v_cache[blocks[pos // page], pos % page] = k[pos], v[pos]
    table = torch.tensor([blocks, [0, 0, 0, 0]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(8, 13, device=DEVICE)
    assert bi.attention_block_m(4, 2) == 8  # 16 rows: 8 tokens x 2 query heads per KV head
    for block_m in (1, 2, 8):  # the chunk's 5 tokens in programs of 1, 2 or all 5 tokens
        blocks = bi.segment_blocks(torch.tensor([0, 5], device=DEVICE), 5, block_m)
        chunk = bi.attention_forward(q[8:13], k_cache.flatten(0, 1), v_cache.flatten(0, 1), pos, blocks, table,
                                     0.25, page=page)  # fmt: skip
        assert torch.equal(chunk, packed[8:13]), block_m
    decode_q = torch.stack([q[12], q[0]])
    decode = bi.attention_forward(decode_q, k_cache.flatten(0, 1), v_cache.flatten(0, 1),
                                  torch.tensor([12, -1], device=DEVICE),
                                  bi.token_blocks(torch.tensor([0, 1], device=DEVICE)), table, 0.25, page=page)  # fmt: skip
    assert torch.equal(decode[0], packed[12])
    assert torch.equal(decode[1], torch.zeros_like(decode[1]))  # padding row (no context)


def test_kv_cache_write_copies_each_token_to_its_slot():
    # k contiguous, v a strided view of a packed qkv row (the engine's); slot -1 writes nothing
    k, qkv = randn(4, 2, 8), randn(4, 3 * 16, seed=1)
    v = qkv[:, 32:].view(4, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8, device=DEVICE), torch.zeros(3, 4, 2, 8, device=DEVICE)
    slots = torch.tensor([5, 0, -1, 11], device=DEVICE)
    bi.kv_cache_write(k, v, slots, k_cache, v_cache)
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for tok, slot in ((0, 5), (1, 0), (3, 11)):
        assert torch.equal(k_rows[slot], k[tok]) and torch.equal(v_rows[slot], v[tok])
    written = {0, 5, 11}
    untouched = [i for i in range(12) if i not in written]
    assert not k_rows[untouched].any() and not v_rows[untouched].any()


def test_varlen_attention_gradients_are_eager():
    lengths = [5, 6]
    q, k, v = (t.requires_grad_() for t in packed_qkv(lengths, seed=8))
    cu = VarlenAttention.from_lengths(lengths, device=DEVICE).cu_seqlens
    grads = torch.autograd.grad(bi.varlen_attention(q, k, v, cu, 0.3).pow(2).sum(), (q, k, v))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = VarlenAttention(cu, 6)._segment_forward(*leaves, 0.3)
    for got, want in zip(grads, torch.autograd.grad(ref.pow(2).sum(), leaves), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def tiny_args(**overrides):
    shape = dict(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                 num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                 qk_norm=True, tie_word_embeddings=False)  # fmt: skip
    return ModelArgs(**{**shape, **overrides})


def test_enable_batch_invariant_switches_the_model_and_keeps_its_numbers():
    torch.manual_seed(0)
    model = CausalLM(tiny_args()).to(DEVICE)
    reference = CausalLM(tiny_args()).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    switched = bi.enable_batch_invariant(model)
    # 1 layer: q/k/v/o + gate/up/down + lm_head = 8 linears; 2 + 2 (q/k norms) + 1 norms; 1 attention
    assert switched == 8 + 5 + 1 and model.batch_invariant
    # RoPE and SiLU * up take the fused elementwise kernels (CPU tensors too, under the interpreter)
    switches = [m for m in model.modules() if isinstance(m, TrainKernelSwitch)]
    assert switches and all(m.kernel_devices == {"cuda", "cpu"} for m in switches)
    assert list(model.state_dict()) == list(reference.state_dict())
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4])
    attn = VarlenAttention.from_lengths([4, 5], device=DEVICE)
    hidden = model(ids, positions.to(DEVICE), attn)
    torch.testing.assert_close(hidden, reference(ids, positions.to(DEVICE), attn), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="not batch-invariant"):
        bi.attend(object(), 0, None, None, None, 1.0)
    if DEVICE == "cpu":  # no CUDA: no cuBLAS check ran, every linear keeps the Triton kernel
        assert set(bi.kernel_choices(model).values()) == {"triton"}
    assert bi.enable_batch_invariant(model) == 0  # a second call switches nothing more


def test_a_linear_with_cublas_blocks_skips_the_triton_kernel(monkeypatch):
    layer = torch.nn.Linear(16, 24).to(DEVICE)
    bi.enable_batch_invariant(layer)
    x = randn(70, 16, seed=3)
    triton_out = layer(x)
    layer.cublas_block_rows = 64  # what cublas_rows.choose_kernels sets for a group that passed its check
    monkeypatch.setattr(bi, "linear", lambda *a: pytest.fail("the Triton linear ran"))
    out = layer(x)
    torch.testing.assert_close(out, triton_out, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the cuBLAS blocks themselves, 64-row blocks
        assert torch.equal(out, cublas_rows.cublas_linear_forward(x, layer.weight, layer.bias, 64))


def test_enable_batch_invariant_refuses_moe():
    moe = tiny_args(arch="qwen3_moe", num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
    with pytest.raises(ValueError, match="dense models only"):
        bi.enable_batch_invariant(CausalLM(moe))


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
