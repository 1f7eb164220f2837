"""Fused Triton training ops (clawrl/models/triton_train_ops.py) against the eager ops of clawrl.models.layers:
outputs and every gradient (torch.autograd.grad), at widths that are not powers of two, run by the Triton
interpreter on CPU in fp32 (compiled kernels on a GPU machine); bf16 against the eager path on a GPU (gpu
marker). Also the model switch `enable_train_kernels`: off by default, eager bit for bit on tensors of devices
it was not enabled for, and, enabled, a whole decoder's hidden states and parameter gradients match the eager
model. Every kernel also compiles for sm_90 (in a subprocess without the interpreter; see
tests/unit/test_triton_compile.py for why that is a separate check). Run by hand:

    .venv/bin/pytest -q tests/unit/test_models_triton_train_ops.py
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from interpreted_triton import (  # before clawrl.models.triton_train_ops: sets TRITON_INTERPRET
    DEVICE,
    ON_GPU,
    replace_tests_if_triton_was_imported_too_early,
)
from sm90_compile import compiling_for_sm90, run_compile_script

from clawrl.models.attention import VarlenAttention
from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM
from clawrl.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, enable_train_kernels
from clawrl.models.triton_train_ops import fused_rms_norm, fused_rotary_qk, fused_silu_mul

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# The interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even): on CPU, bf16 results agree
# with eager to about one bf16 rounding only.
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def outputs_and_grads(fn, inputs, grad_outs):
    """fn(*inputs) (a tensor or a tuple) and d(sum <out, grad_out>)/d(inputs)."""
    inputs = [leaf(t) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    return outs, torch.autograd.grad(outs, inputs, grad_outs)


def assert_all_close(got, want, tol):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        torch.testing.assert_close(g, w, **tol)


def eager_rms_norm(x, weight, eps):
    norm = RMSNorm(x.shape[-1], eps).to(device=x.device, dtype=weight.dtype)
    del norm.weight
    norm.weight = weight  # the leaf itself, so autograd.grad reaches it
    return norm(x)


# ------------------------------------------------------------------------------------------- RMSNorm
def test_rms_norm_hand_computed():
    x = torch.tensor([[3.0, 4.0]], device=DEVICE)
    weight = torch.tensor([1.0, 2.0], device=DEVICE)
    rms = (12.5 + 1e-6) ** 0.5  # sqrt((9 + 16) / 2 + eps)
    want = torch.tensor([[3.0 / rms, 2.0 * 4.0 / rms]], device=DEVICE)
    torch.testing.assert_close(fused_rms_norm(x, weight, 1e-6), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "shape",
    [
        (37, 96),  # many narrow rows per tile, rows not a multiple of the tile
        (19, 1536),  # the 1.5B hidden size: 2 rows per tile, several tiles per backward program
        (5, 3, 40),  # per-head q/k norm of Qwen3: [N, H, D] with D not a power of two
    ],
)
def test_rms_norm_fp32_matches_eager_with_gradients(shape):
    width = shape[-1]
    x, weight = randn(*shape, scale=2.0), randn(width, seed=1) + 1.0
    dy = randn(*shape, seed=2)
    got_out, got_grads = outputs_and_grads(lambda a, w: fused_rms_norm(a, w, 1e-6), [x, weight], dy)
    want_out, want_grads = outputs_and_grads(lambda a, w: eager_rms_norm(a, w, 1e-6), [x, weight], dy)
    assert_all_close(got_out, want_out, FP32_TOL)
    assert_all_close(got_grads, want_grads, FP32_TOL)


def test_rms_norm_bf16_input_with_fp32_weight_promotes_like_eager():
    x, weight = randn(7, 96, dtype=torch.bfloat16), randn(96, seed=1) + 1.0
    dy = randn(7, 96, seed=2)
    got_out, got_grads = outputs_and_grads(lambda a, w: fused_rms_norm(a, w, 1e-5), [x, weight], dy)
    want_out, want_grads = outputs_and_grads(lambda a, w: eager_rms_norm(a, w, 1e-5), [x, weight], dy)
    assert got_out[0].dtype == torch.float32 and got_grads[0].dtype == torch.bfloat16
    assert_all_close(got_out, want_out, BF16_TOL)
    assert_all_close(got_grads, want_grads, BF16_TOL)


# -------------------------------------------------------------------------------------- SiLU-and-mul
def test_silu_mul_hand_computed():
    gate = torch.tensor([[0.0, 1.0, -2.0]], device=DEVICE)
    up = torch.tensor([[5.0, 2.0, 3.0]], device=DEVICE)
    sig1, sig_m2 = 1 / (1 + torch.e**-1), 1 / (1 + torch.e**2)
    want = torch.tensor([[0.0, 2.0 * sig1, 3.0 * -2.0 * sig_m2]], device=DEVICE)
    torch.testing.assert_close(fused_silu_mul(gate, up), want, atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy, on purpose
@pytest.mark.parametrize("rows,width", [(7, 150), (3, 2200)])  # 2200: two full 1024-wide blocks + a part
def test_silu_mul_fp32_matches_eager_with_gradients(rows, width):
    gate, up = randn(rows, width, scale=3.0), randn(rows, width, seed=1)
    gate[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0])  # exp overflow and saturation stay finite
    dout = randn(rows, width, seed=2)
    got_out, got_grads = outputs_and_grads(fused_silu_mul, [gate, up], dout)
    want_out, want_grads = outputs_and_grads(lambda g, u: F.silu(g) * u, [gate, up], dout)
    assert_all_close(got_out, want_out, FP32_TOL)
    assert_all_close(got_grads, want_grads, FP32_TOL)
    assert all(torch.isfinite(g).all() for g in got_grads)


def test_silu_mul_on_strided_halves_of_a_packed_gate_up():
    gate_up = leaf(randn(5, 2 * 96, scale=2.0))
    dout = randn(5, 96, seed=3)
    got = torch.autograd.grad(fused_silu_mul(*gate_up.chunk(2, dim=-1)), gate_up, dout)[0]
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.autograd.grad(F.silu(gate) * up, gate_up, dout)[0]
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_silu_mul_bf16_matches_eager():
    gate, up = randn(4, 150, dtype=torch.bfloat16, scale=3.0), randn(4, 150, dtype=torch.bfloat16, seed=1)
    dout = randn(4, 150, dtype=torch.bfloat16, seed=2)
    got_out, got_grads = outputs_and_grads(fused_silu_mul, [gate, up], dout)
    want_out, want_grads = outputs_and_grads(lambda g, u: F.silu(g) * u, [gate, up], dout)
    assert_all_close(got_out, want_out, BF16_TOL)
    assert_all_close(got_grads, want_grads, BF16_TOL)


# ---------------------------------------------------------------------------------------------- RoPE
def packed_rope(head_dim, lengths, dtype=torch.float32):
    """cos/sin [N, 1, D/2] of packed sequences: positions restart at 0 in every segment."""
    rope = RotaryEmbedding(head_dim, max([64, *lengths]), 10000.0, None).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in [0, *lengths]]).to(DEVICE)
    return rope(positions)


def eager_rotary_qk(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(12, 2, 128), (7, 1, 40)],  # the 1.5B layout; odd heads and a half width that is not a power of two
)
def test_rotary_fp32_matches_eager_with_gradients(num_heads, num_kv_heads, head_dim):
    lengths = [4, 1, 6]
    num_tokens = sum(lengths)
    cos, sin = packed_rope(head_dim, lengths)
    q, k = randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim, seed=1)
    grads = (
        randn(num_tokens, num_heads, head_dim, seed=2),
        randn(num_tokens, num_kv_heads, head_dim, seed=3),
    )
    got_out, got_grads = outputs_and_grads(lambda a, b: fused_rotary_qk(a, b, cos, sin), [q, k], grads)
    want_out, want_grads = outputs_and_grads(lambda a, b: eager_rotary_qk(a, b, cos, sin), [q, k], grads)
    assert_all_close(got_out, want_out, FP32_TOL)
    assert_all_close(got_grads, want_grads, FP32_TOL)
    torch.testing.assert_close(got_out[0][0], q[0])  # position 0 of the first segment: no rotation
    torch.testing.assert_close(got_out[0][4], q[4])  # position 0 again: the second segment starts over


def test_rotary_on_strided_views_of_a_packed_qkv():
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 3, 1, 40
    qkv = leaf(randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim))
    cos, sin = packed_rope(head_dim, [2, 3])
    grads = (
        randn(num_tokens, num_heads, head_dim, seed=2),
        randn(num_tokens, num_kv_heads, head_dim, seed=3),
    )

    def grad_of(rotate):
        q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
        return torch.autograd.grad(rotate(q, k, cos, sin), qkv, grads)[0]

    got, want = grad_of(fused_rotary_qk), grad_of(eager_rotary_qk)
    torch.testing.assert_close(got, want, **FP32_TOL)
    assert not got[:, num_heads + num_kv_heads :].any()  # v got no gradient


def test_rotary_bf16_matches_eager():
    cos, sin = packed_rope(40, [3, 2])
    q, k = randn(5, 3, 40, dtype=torch.bfloat16), randn(5, 1, 40, dtype=torch.bfloat16, seed=1)
    grads = (randn(5, 3, 40, dtype=torch.bfloat16, seed=2), randn(5, 1, 40, dtype=torch.bfloat16, seed=3))
    got_out, got_grads = outputs_and_grads(lambda a, b: fused_rotary_qk(a, b, cos, sin), [q, k], grads)
    want_out, want_grads = outputs_and_grads(lambda a, b: eager_rotary_qk(a, b, cos, sin), [q, k], grads)
    assert_all_close(got_out, want_out, BF16_TOL)
    assert_all_close(got_grads, want_grads, BF16_TOL)


def test_zero_tokens_give_empty_outputs_and_a_zero_weight_gradient():
    weight = leaf(randn(96))
    x = leaf(randn(0, 96))
    (dx, dw) = torch.autograd.grad(fused_rms_norm(x, weight, 1e-6).sum(), (x, weight))
    assert dx.shape == (0, 96) and torch.equal(dw, torch.zeros_like(dw))
    gate, up = leaf(randn(0, 150)), leaf(randn(0, 150))
    assert fused_silu_mul(gate, up).shape == (0, 150)
    cos, sin = packed_rope(40, [])
    q, k = fused_rotary_qk(randn(0, 3, 40), randn(0, 1, 40), cos, sin)
    assert q.shape == (0, 3, 40) and k.shape == (0, 1, 40)


# ---------------------------------------------------------------------------------------- the switch
def tiny_model(arch, *, fused=False, dtype=torch.float32, device=DEVICE):
    args = ModelArgs(
        arch=arch, vocab_size=64, hidden_size=96, num_layers=2, num_heads=3, num_kv_heads=1, head_dim=40,
        intermediate_size=150, qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2",
    )  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(args, fused=fused)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):  # ones would hide a wrong weight gradient
                module.weight.uniform_(0.5, 1.5)
    return model.to(device=device, dtype=dtype)


def forward_and_grads(model, lengths=(5, 1, 7)):
    """Final hidden states of a packed batch, and every parameter's gradient of a fixed projection of the logits."""
    device = model.model.embed_tokens.weight.device
    num_tokens = sum(lengths)
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, model.args.vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    attn = VarlenAttention.from_lengths(list(lengths), device=device)
    hidden = model(input_ids, positions, attn)
    logits = model.compute_logits(hidden).float()
    projection = torch.randn(logits.shape, generator=generator).to(device)
    params = [p for _, p in sorted(model.named_parameters())]
    return hidden, torch.autograd.grad((logits * projection).sum(), params)


def test_switch_is_off_by_default_and_cuda_only_leaves_cpu_tensors_on_eager_bit_for_bit():
    model = tiny_model("qwen3", device="cpu")
    assert all(not m.kernel_devices for m in model.modules() if hasattr(m, "kernel_devices"))
    want_hidden, want_grads = forward_and_grads(model)
    # 2 layers x (2 norms + MLP + attention + q/k norms) + the final norm
    assert enable_train_kernels(model) == 2 * 6 + 1
    assert all(m.kernel_devices == {"cuda"} for m in model.modules() if hasattr(m, "kernel_devices"))
    got_hidden, got_grads = forward_and_grads(model)
    assert torch.equal(got_hidden, want_hidden)
    assert all(map(torch.equal, got_grads, want_grads))


def test_enabling_cpu_kernels_without_the_interpreter_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1.*drop 'cpu'"):
        enable_train_kernels(tiny_model("qwen2"), devices=("cpu", "cuda"))


@pytest.mark.parametrize("arch,fused", [("qwen2", False), ("qwen3", True)])
def test_switched_decoder_matches_eager_hidden_and_every_parameter_gradient(arch, fused):
    eager = tiny_model(arch, fused=fused)
    switched = copy.deepcopy(eager)
    assert enable_train_kernels(switched, devices=(torch.device(DEVICE).type,)) > 0
    want_hidden, want_grads = forward_and_grads(eager)
    got_hidden, got_grads = forward_and_grads(switched)
    torch.testing.assert_close(got_hidden, want_hidden, **FP32_TOL)
    assert_all_close(got_grads, want_grads, FP32_TOL)
    assert enable_train_kernels(switched, devices=()) > 0  # and back: eager again, bit for bit
    hidden, grads = forward_and_grads(switched)
    assert torch.equal(hidden, want_hidden)
    # (On a GPU the eager attention backward may accumulate with atomics: equal up to rounding there.)
    assert_all_close(grads, want_grads, FP32_TOL if ON_GPU else {"atol": 0, "rtol": 0})


# ------------------------------------------------------------------------------------------ GPU, bf16
def assert_bf16_at_least_as_accurate_as_eager(fused_fn, eager_fn, inputs, grad_outs, truth_fn=None):
    """Outputs and gradients: close to eager bf16 and not further from the fp64 truth (`truth_fn`, default
    eager_fn, on fp64 copies of the inputs) than eager is (the kernels round once, eager after every op)."""
    got_out, got_grads = outputs_and_grads(fused_fn, inputs, grad_outs)
    want_out, want_grads = outputs_and_grads(eager_fn, inputs, grad_outs)
    true_out, true_grads = outputs_and_grads(
        truth_fn or eager_fn, [t.double() for t in inputs], [g.double() for g in grad_outs]
    )
    for got, want, true in zip(got_out, want_out, true_out, strict=True):
        # Not bitwise: compiled kernels fuse a * b - c into one FMA (RoPE: ~20% of elements an ulp off eager).
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        got_err, want_err = (got.double() - true).norm(), (want.double() - true).norm()
        assert got_err <= want_err * 1.1 + 1e-6, (got_err, want_err)
    for got, want, true in zip(got_grads, want_grads, true_grads, strict=True):
        # Reductions (d weight sums 8k rows) cancel to near zero in places: tolerance relative to the scale.
        torch.testing.assert_close(got, want, atol=5e-2 * want.abs().max().item(), rtol=5e-2)
        got_err, want_err = (got.double() - true).norm(), (want.double() - true).norm()
        assert got_err <= want_err * 1.1 + 1e-6, (got_err, want_err)


@pytest.mark.gpu
def test_gpu_bf16_rms_norm_at_the_15b_shapes():
    for shape in [(8192, 1536), (4096, 12, 128)]:
        x, weight = randn(*shape, dtype=torch.bfloat16), (randn(shape[-1], seed=1) + 1.0).bfloat16()
        dy = randn(*shape, dtype=torch.bfloat16, seed=2)
        assert_bf16_at_least_as_accurate_as_eager(
            lambda a, w: fused_rms_norm(a, w, 1e-6),
            lambda a, w: eager_rms_norm(a, w, 1e-6),
            [x, weight],
            [dy],
        )


@pytest.mark.gpu
def test_gpu_bf16_silu_mul_at_the_15b_shape():
    gate, up = (
        randn(8192, 8960, dtype=torch.bfloat16, scale=2.0),
        randn(8192, 8960, dtype=torch.bfloat16, seed=1),
    )
    dout = randn(8192, 8960, dtype=torch.bfloat16, seed=2)
    assert_bf16_at_least_as_accurate_as_eager(fused_silu_mul, lambda g, u: F.silu(g) * u, [gate, up], [dout])


@pytest.mark.gpu
def test_gpu_bf16_rotary_at_the_15b_shape():
    lengths = [2048] * 4
    cos, sin = packed_rope(128, lengths)
    q, k = randn(8192, 12, 128, dtype=torch.bfloat16), randn(8192, 2, 128, dtype=torch.bfloat16, seed=1)
    grads = [
        randn(8192, 12, 128, dtype=torch.bfloat16, seed=2),
        randn(8192, 2, 128, dtype=torch.bfloat16, seed=3),
    ]
    # Both bf16 paths rotate by bf16-rounded cos/sin (apply_rotary casts them): so does the truth.
    cos16, sin16 = cos.bfloat16().double(), sin.bfloat16().double()
    assert_bf16_at_least_as_accurate_as_eager(
        lambda a, b: fused_rotary_qk(a, b, cos, sin),
        lambda a, b: eager_rotary_qk(a, b, cos, sin),
        [q, k],
        grads,
        truth_fn=lambda a, b: eager_rotary_qk(a, b, cos16, sin16),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gpu_bf16_switched_decoder_is_close_to_eager(arch):
    eager = tiny_model(arch, dtype=torch.bfloat16)
    switched = copy.deepcopy(eager)
    assert enable_train_kernels(switched) > 0
    want_hidden, want_grads = forward_and_grads(eager, lengths=(300, 17, 700))
    got_hidden, got_grads = forward_and_grads(switched, lengths=(300, 17, 700))
    torch.testing.assert_close(got_hidden, want_hidden, atol=5e-2, rtol=5e-2)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert (got.float() - want.float()).norm() <= 0.05 * want.float().norm() + 1e-3


# ------------------------------------------------------------------------------------ sm_90 compile
KERNELS = ["_rms_norm_bwd_kernel", "_rms_norm_fwd_kernel", "_rotary_kernel", "_silu_mul_bwd_kernel",
           "_silu_mul_fwd_kernel"]  # fmt: skip


def compile_every_kernel_for_sm90() -> list[str]:
    """Run each op forward and backward at 1.5B shapes on CPU tensors, every launch compiling for sm_90."""
    with compiling_for_sm90() as compiled:
        _drive_every_kernel()
    return compiled


def _drive_every_kernel() -> None:
    cos, sin = RotaryEmbedding(128, 64, 10000.0, None)(torch.arange(8))
    for dtype in (torch.bfloat16, torch.float32):
        ops = [
            (lambda a, w: fused_rms_norm(a, w, 1e-6), [(8, 1536), (1536,)]),
            (lambda a, w: fused_rms_norm(a, w, 1e-6), [(8, 12, 128), (128,)]),
            (fused_silu_mul, [(8, 8960), (8, 8960)]),
            (lambda q, k: fused_rotary_qk(q, k, cos, sin), [(8, 12, 128), (8, 2, 128)]),
        ]
        for fn, shapes in ops:
            inputs = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
            outs = fn(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])


def test_every_kernel_compiles_for_sm90():
    compiled = run_compile_script(__file__)
    assert sorted(set(compiled)) == KERNELS
    assert len(compiled) == 2 * (2 * 2 + 2 + 4)  # per dtype: 2 norms x fwd/bwd, silu fwd/bwd, q/k x fwd/bwd


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.exit("run without TRITON_INTERPRET", returncode=2)
    print(" ".join(compile_every_kernel_for_sm90()))
else:
    replace_tests_if_triton_was_imported_too_early(globals(), __file__)
