"""--true-on-policy-mode on a GPU in bf16: the trainer's recomputed log-probs of sampled tokens equal the
engine's bit for bit.

- kernels: the batch-invariant linear gives row i the same bits in batches of 1..300 rows, and the columns
  of a packed qkv weight the same bits as the separate q/k/v weights (the assumption its docstring states);
  attention over a paged cache equals attention over packed sequences; log_probs_of is row-invariant.
- end to end: the engine (CUDA graphs, bf16, batch-invariant runner) samples 64 sequences of a random-weight
  Qwen2 model of moderate size (and 16 of a Qwen3 one, q/k norms); the trainer's log-prob pass
  (rl_step.forward_log_probs, native non-fused model, packed micro-batches of several sequences) gives
  `torch.equal` log-probs; the default trainer path on the same sequences does not (the test can fail).
- cuBLAS where checked (clawrl/models/cublas_rows.py): for the Qwen2.5-0.5B and 1.5B matmuls, the set-up
  check's verdict on this GPU is printed, and for each group that passes, the padded row blocks give a row
  the same bits at row counts and offsets the check never ran (1, 3, 77, 1000 rows, at offset 5), across
  block boundaries, and each part of a packed weight its columns' bits. The end-to-end test runs with the
  kernels the check chose and with the Triton linear everywhere (CLAWRL_TRUE_ON_POLICY_CUBLAS=0).
- cost: engine throughput with the mode on and off on the same prompts, printed for docs/benchmarks.md;
  asserted only to be >= 0.5x.

    .venv/bin/pytest -s tests/gpu/test_true_on_policy.py      # skipped without CUDA
"""

import time

import pytest
import torch

from clawrl.data.train_batch import TrainBatch
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.models import batch_invariant as bi
from clawrl.models import cublas_rows as cr
from clawrl.models.attention import VarlenAttention
from clawrl.models.hf_io import load_model
from clawrl.models.layers import enable_train_kernels
from clawrl.models.tiny import build_tiny_model
from clawrl.trainer.micro_batch import build_micro_batch
from clawrl.trainer.rl_step import forward_log_probs

NUM_GPUS = 1
pytestmark = pytest.mark.gpu
TEMPERATURE = 0.8
SHAPES = {
    "qwen2": dict(arch="qwen2", vocab_size=32768, hidden_size=896, num_layers=4, num_heads=14, num_kv_heads=2,
                  intermediate_size=4864, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", vocab_size=32768, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=3072, tie_word_embeddings=False),
}  # fmt: skip


def randn(*shape, seed=0, scale=1.0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=generator, device="cuda").mul(scale).bfloat16()


def test_linear_rows_and_packed_columns_are_invariant():
    # 1100 rows take the large tiles, the slices below LINEAR_LARGE_ROWS the decode tiles: same bits
    x, w_qkv, b_qkv = randn(1100, 896), randn(1152, 896, seed=1, scale=0.05), randn(1152, seed=2)
    full = bi.linear(x, w_qkv, b_qkv)
    torch.testing.assert_close(
        full.float(), x.float() @ w_qkv.float().t() + b_qkv.float(), atol=0.1, rtol=0.02
    )
    for num_rows in (1, 3, 17, 64, 129, 256, 512, 513):
        assert torch.equal(bi.linear(x[:num_rows], w_qkv, b_qkv), full[:num_rows]), num_rows
    for cols in (slice(0, 896), slice(896, 1024), slice(1024, 1152), slice(100, 1000)):
        assert torch.equal(bi.linear(x, w_qkv[cols], b_qkv[cols]), full[:, cols]), cols


@pytest.mark.parametrize("k_dim,n_dim", [(896, 1152), (4864, 896), (8960, 1536), (1000, 300)])
def test_linear_bits_do_not_depend_on_the_tiles(k_dim, n_dim):
    x, w = randn(300, k_dim), randn(n_dim, k_dim, seed=1, scale=k_dim**-0.5)
    want = bi.linear_forward(x, w, None, bi.LINEAR_TILES_DECODE)
    others = (bi.LINEAR_TILES_LARGE, bi.LINEAR_TILES_NARROW, bi.LinearTiles(128, 64, 64, 4, 3),
              bi.LinearTiles(64, 128, 128, 4, 3))  # fmt: skip
    for tiles in others:
        assert torch.equal(bi.linear_forward(x, w, None, tiles), want), tiles
    # K chunks spread over programs (and the reduce kernel) give the one-program bits, at every tile shape
    for tiles in (bi.LINEAR_TILES_DECODE, *others):
        assert torch.equal(bi.linear_forward(x, w, None, tiles, split=True), want), ("split", tiles)


@pytest.mark.parametrize("k_dim,n_dim", [(4864, 896), (8960, 1536), (5000, 300)])
def test_a_decode_batchs_split_k_gives_the_trainers_bits(k_dim, n_dim):
    # a down_proj: the decode batch's grid is smaller than the SM count, so its K chunks run on separate
    # programs; the trainer's 8192-row micro-batch sums them in one program, in the same order (at 300
    # columns its own grid is small enough to split too: both give the one-program bits)
    x, w = randn(8192, k_dim), randn(n_dim, k_dim, seed=1, scale=k_dim**-0.5)
    b = randn(n_dim, seed=2)
    device = torch.device("cuda")
    full = bi.linear_forward(x, w, b, split=False)
    torch.testing.assert_close(full.float(), x.float() @ w.float().t() + b.float(), atol=0.1, rtol=0.02)
    assert torch.equal(bi.linear(x, w, b), full)
    for rows in (1, 8, 64, 128, 256):  # split at <= 64 rows for every shape here (132 SMs)
        splits = bi.linear_splits(rows, n_dim, k_dim, bi.linear_tiles(rows, n_dim, device), device)
        assert splits > 1 or rows > 64, rows
        assert torch.equal(bi.linear(x[:rows], w, b), full[:rows]), (rows, splits)


def test_rms_norm_and_log_probs_are_row_invariant():
    x, w = randn(300, 896, scale=3.0), randn(896, seed=1)
    y = bi.rms_norm(x, w, 1e-6)
    assert torch.equal(bi.rms_norm(x[5:6], w, 1e-6), y[5:6])
    logits, tokens = randn(300, 32768, seed=3, scale=4.0), torch.randint(0, 32768, (300,), device="cuda")
    lp, _ = bi.log_probs_of(logits, tokens, TEMPERATURE)
    want = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0)
    for rows in (slice(7, 8), slice(0, 64)):
        assert torch.equal(bi.log_probs_of(logits[rows], tokens[rows], TEMPERATURE)[0], lp[rows])


def test_paged_attention_equals_packed_attention():
    lengths = [300, 77, 1]
    q, k, v = randn(378, 14, 64), randn(378, 2, 64, seed=1), randn(378, 2, 64, seed=2)
    packed = bi.varlen_attention(
        q, k, v, VarlenAttention.from_lengths(lengths, device="cuda").cu_seqlens, 0.125
    )
    page, blocks = 16, torch.randperm(40, device="cuda")[:19].to(torch.int32)  # sequence 0 over 19 pages
    k_cache, v_cache = torch.zeros(40, page, 2, 64, **_bf16()), torch.zeros(40, page, 2, 64, **_bf16())
    slots = (
        blocks.long()[torch.arange(300, device="cuda") // page] * page
        + torch.arange(300, device="cuda") % page
    )
    k_cache.view(-1, 2, 64)[slots], v_cache.view(-1, 2, 64)[slots] = k[:300], v[:300]
    table = blocks[None, :]
    for first in (0, 120, 299):  # a prefill chunk, a later chunk, one decode row
        count = 300 - first
        pos = torch.arange(first, 300, device="cuda")
        prefill = bi.segment_blocks(
            torch.tensor([0, count], device="cuda"), count, bi.attention_block_m(14, 2)
        )
        decode = bi.token_blocks(torch.zeros(count, dtype=torch.int64, device="cuda"))  # one token a program
        for programs in (prefill, decode):
            out = bi.attention_forward(q[first:300], k_cache.flatten(0, 1), v_cache.flatten(0, 1), pos, programs,
                                       table, 0.125, page=page)  # fmt: skip
            assert torch.equal(out, packed[first:300]), (first, programs.count.max().item())


def _bf16():
    return {"dtype": torch.bfloat16, "device": "cuda"}


def test_packed_attention_gradients_come_from_the_trainers_flash_kernel():
    # the forward is the batch-invariant kernel; the backward recomputes FlashAttention's varlen attention
    # (one call per layer, not a Python loop over segments): gradients within bf16 rounding of fp32 SDPA
    lengths = [37, 300, 5, 120, 64]
    attn = VarlenAttention.from_lengths(lengths, device="cuda")
    num_tokens = sum(lengths)
    q, k, v = (randn(num_tokens, heads, 64, seed=s).requires_grad_() for s, heads in ((1, 8), (2, 2), (3, 2)))
    grad = randn(num_tokens, 8, 64, seed=4)
    out = bi.varlen_attention(q, k, v, attn.cu_seqlens, 0.125, attn.max_seqlen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = VarlenAttention.from_lengths(lengths, device="cuda")._segment_forward(*leaves, 0.125)
    want = torch.autograd.grad(reference, leaves, grad.float())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, atol=3e-2, rtol=3e-2)


CUBLAS_GROUPS = {  # the matmuls of Qwen2.5-0.5B and -1.5B (qkv with bias; the LM head of the 152k vocab)
    "0.5b qkv": cr.LinearGroup(896, (896, 128, 128), True), "0.5b o": cr.LinearGroup(896, (896,), False),
    "0.5b gate_up": cr.LinearGroup(896, (4864, 4864), False), "0.5b down": cr.LinearGroup(4864, (896,), False),
    "lm_head 896": cr.LinearGroup(896, (151936,), False),
    "1.5b qkv": cr.LinearGroup(1536, (1536, 256, 256), True), "1.5b o": cr.LinearGroup(1536, (1536,), False),
    "1.5b gate_up": cr.LinearGroup(1536, (8960, 8960), False), "1.5b down": cr.LinearGroup(8960, (1536,), False),
    "lm_head 1536": cr.LinearGroup(1536, (151936,), False),
}  # fmt: skip


def test_cublas_groups_that_pass_their_check_keep_a_rows_bits_anywhere():
    device = torch.device("cuda")
    start = time.perf_counter()
    kernels = {name: cr.group_kernel(group, torch.bfloat16, device) for name, group in CUBLAS_GROUPS.items()}
    seconds = time.perf_counter() - start
    print(f"\n[cublas rows] {torch.cuda.get_device_name()}: check {seconds:.2f} s, kernels {kernels}")
    for name, group in CUBLAS_GROUPS.items():
        if kernels[name] == "triton":
            continue
        cols = sum(group.widths)
        rows = cr.block_rows(cols)
        num_rows = 2 * rows + 77  # three blocks, the last one padded
        x = randn(num_rows, group.k_dim, seed=3)
        weight = randn(cols, group.k_dim, seed=4, scale=group.k_dim**-0.5)
        bias = randn(cols, seed=5) if group.has_bias else None
        full = cr.cublas_linear_forward(x, weight, bias, rows)
        torch.testing.assert_close(full.float(), torch.nn.functional.linear(x, weight, bias).float(),
                                   atol=0.05, rtol=0.02)  # fmt: skip
        for count in (1, 3, 77, 1000):
            for offset in (0, 5, rows - 3):  # the last one straddles a block boundary of `full`
                got = cr.cublas_linear_forward(x[offset : offset + count], weight, bias, rows)
                assert torch.equal(got, full[offset : offset + count]), (name, count, offset)
        lo = 0
        for width in group.widths if len(group.widths) > 1 else ():
            part_b = None if bias is None else bias[lo : lo + width]
            part = cr.cublas_linear_forward(x[:300], weight[lo : lo + width].contiguous(), part_b, rows)
            assert torch.equal(part, full[:300, lo : lo + width]), (name, lo)
            lo += width
        del x, weight, full
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    return request.param, build_tiny_model(
        tmp_path_factory.mktemp(request.param), seed=5, **SHAPES[request.param]
    )


def prompts_and_params(num_seqs):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 120, (num_seqs,), generator=generator)]  # fmt: skip
    params = [SamplingParams(max_new_tokens=48, temperature=TEMPERATURE, seed=100 + i, ignore_eos=True)
              for i in range(num_seqs)]  # fmt: skip
    return prompts, params


def generate(path, prompts, params, *, true_on_policy):
    engine = Engine(EngineConfig(
        model_path=str(path), device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=2048,
        max_running_requests=64, true_on_policy_mode=true_on_policy,
    ))  # fmt: skip
    # warm-up: compile every kernel variant the timed run uses outside the timing: a batch of the same
    # shape (its prefill takes the large-row linear tiles, 4 prompts would not: 0.73x measured with 4), the
    # prompts reversed so that the timed run finds none of them in the prefix cache
    engine.generate([p[::-1] for p in prompts], params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    del engine
    torch.cuda.empty_cache()
    return results, sum(len(r["output_ids"]) for r in results) / elapsed


def trainer_log_probs(path, tokens, response_lengths, *, true_on_policy):
    model = load_model(str(path), fused=False, device="cuda", dtype=torch.bfloat16)
    if true_on_policy:
        bi.enable_batch_invariant(model)
    else:
        enable_train_kernels(model)  # the default trainer path
    batch = TrainBatch(
        rollout_id=0, tokens=tokens, response_lengths=response_lengths,
        loss_masks=[[1] * n for n in response_lengths], rewards=[0.0] * len(tokens),
        raw_rewards=[0.0] * len(tokens),
    )  # fmt: skip
    out = []
    with torch.no_grad():
        for start in range(0, len(tokens), 24):  # packed micro-batches of up to 24 sequences
            mb = build_micro_batch(
                batch, list(range(start, min(start + 24, len(tokens)))), torch.device("cuda")
            )
            out.append(forward_log_probs(model, mb, TEMPERATURE, with_entropy=False)[0])
    return torch.cat(out), bi.kernel_choices(model)


@pytest.mark.parametrize("kernels", ["checked-cublas", "triton"])
def test_trainer_log_probs_equal_the_engines_bit_for_bit(model_dir, kernels, monkeypatch):
    arch, path = model_dir
    if kernels == "triton":
        monkeypatch.setenv(bi.CUBLAS_ENV, "0")
    prompts, params = prompts_and_params(64 if arch == "qwen2" else 16)
    results, tok_s_on = generate(path, prompts, params, true_on_policy=True)
    _, tok_s_off = generate(path, prompts, params, true_on_policy=False)
    print(f"\n[true-on-policy] {arch}: engine {tok_s_on:.0f} tok/s with the mode, {tok_s_off:.0f} tok/s without "
          f"({tok_s_on / tok_s_off:.2f}x), {len(prompts)} sequences x 48 tokens")  # fmt: skip
    tokens = [p + r["output_ids"] for p, r in zip(prompts, results, strict=True)]
    lengths = [len(r["output_ids"]) for r in results]
    engine_lp = torch.tensor(
        [lp for r in results for lp in r["logprobs"]], dtype=torch.float32, device="cuda"
    )
    exact, choices = trainer_log_probs(path, tokens, lengths, true_on_policy=True)
    on_cublas = sorted({f"{name.rsplit('.', 1)[-1]}: {k}" for name, k in choices.items() if k != "triton"})
    print(f"[true-on-policy] {arch} ({kernels}): linears on cuBLAS: {on_cublas or 'none'}")
    if kernels == "triton":
        assert not on_cublas
    assert torch.equal(exact, engine_lp), (exact - engine_lp).abs().max()
    default, _ = trainer_log_probs(path, tokens, lengths, true_on_policy=False)
    diff = (default - engine_lp).abs()
    print(
        f"[true-on-policy] {arch}: default trainer path |diff| mean {diff.mean():.3g}, max {diff.max():.3g}"
    )
    assert diff.max() > 0
    assert tok_s_on >= 0.5 * tok_s_off
