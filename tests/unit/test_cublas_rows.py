"""clawrl/models/cublas_rows.py on CPU: the padded row blocks give F.linear's numbers and gradients, the
set-up check accepts a row-invariant product and rejects one whose bits follow the row count, the row
offset or the packing, and the engine's packed model and the trainer's split one get the same groups.
(On a GPU, tests/gpu/test_true_on_policy.py runs the check on cuBLAS itself.)

    .venv/bin/pytest -q tests/unit/test_cublas_rows.py
"""

import pytest
import torch
import torch.nn.functional as F

from clawrl.models import cublas_rows as cr
from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def integer_valued(*shape, seed=0):
    """Small integers in float64: every product and sum below is exact, whatever the order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=generator).double()


def test_block_rows_keep_a_blocks_output_bounded():
    assert cr.block_rows(1152) == 4096  # a 0.5B qkv: the largest block
    assert cr.block_rows(151936) == 1024  # a Qwen LM head: 1024 x 152k = 156M elements
    assert cr.block_rows(300_000) == 512
    assert cr.block_rows(10**9) == cr.ROW_QUANTUM
    for cols in (1, 896, 9728, 151936, 10**7):
        rows = cr.block_rows(cols)
        assert rows % cr.ROW_QUANTUM == 0 and (rows * cols <= cr.BLOCK_OUTPUT_ELEMENTS or rows == 64)


@pytest.mark.parametrize("num_rows", [1, 63, 64, 65, 200, 513])
@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_blocks_equal_f_linear(num_rows, with_bias):
    x, weight = integer_valued(num_rows, 24), integer_valued(40, 24, seed=1)
    bias = integer_valued(40, seed=2) if with_bias else None
    out = cr.cublas_linear_forward(x, weight, bias, rows_per_block=128)  # 513 rows: 5 blocks
    assert out.shape == (num_rows, 40) and out.is_contiguous()
    assert torch.equal(out, F.linear(x, weight, bias))
    # a strided input (a column slice) is copied, not misread
    wide = integer_valued(num_rows, 48, seed=3)
    assert torch.equal(
        cr.cublas_linear_forward(wide[:, ::2], weight, bias, 64), F.linear(wide[:, ::2], weight, bias)
    )


def test_cublas_linear_gradients_are_f_linears():
    x = integer_valued(2, 70, 16).requires_grad_()
    weight, bias = (
        integer_valued(12, 16, seed=1).requires_grad_(),
        integer_valued(12, seed=2).requires_grad_(),
    )
    out = cr.cublas_linear(x, weight, bias, rows_per_block=64)
    assert out.shape == (2, 70, 12)
    grad = integer_valued(2, 70, 12, seed=4)
    got = torch.autograd.grad(out, (x, weight, bias), grad)
    want = torch.autograd.grad(F.linear(x, weight, bias), (x, weight, bias), grad)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_without_gradients_the_blocks_skip_autograd_and_keep_the_bits():
    x, weight, bias = integer_valued(70, 16), integer_valued(12, 16, seed=1), integer_valued(12, seed=2)
    with_grad = cr.cublas_linear(x, weight.requires_grad_(), bias, rows_per_block=64)
    with torch.inference_mode():  # the engine: the forward itself, no autograd.Function around it
        plain = cr.cublas_linear(x, weight, bias, rows_per_block=64)
    assert with_grad.grad_fn is not None and plain.grad_fn is None
    assert torch.equal(plain, with_grad.detach())


# -- the check -------------------------------------------------------------------------------------------
def row_by_row(x_MK, weight_NK, bias_N, out_MN):
    """Each row by the same op on its own: row-invariant by construction."""
    for i in range(x_MK.shape[0]):
        row = weight_NK @ x_MK[i]
        out_MN[i] = row if bias_N is None else row + bias_N


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(cr, "MAX_BLOCK_ROWS", 256)  # four row counts: 64, 128, 192, 256
    monkeypatch.setattr(cr, "_VERDICTS", {})
    monkeypatch.setattr(cr, "_product", row_by_row)


QKV = cr.LinearGroup(k_dim=16, widths=(16, 8, 8), has_bias=True)


def check(group=QKV):
    return cr.rows_check(group, torch.float32, torch.device("cpu"), graphs=False)


def test_the_check_accepts_a_row_invariant_product(small_blocks):
    assert check()
    assert check(cr.LinearGroup(k_dim=32, widths=(24,), has_bias=False))


def nudged(condition):
    """row_by_row, with the first output element moved by one ulp where `condition(x, weight)` holds."""

    def product(x_MK, weight_NK, bias_N, out_MN):
        row_by_row(x_MK, weight_NK, bias_N, out_MN)
        if condition(x_MK, weight_NK):
            out_MN[0, 0] = torch.nextafter(out_MN[0, 0], torch.tensor(float("inf")))

    return product


@pytest.mark.parametrize(
    "condition",
    [
        pytest.param(lambda x, w: x.shape[0] == 128, id="one-row-count"),
        pytest.param(lambda x, w: x.shape[0] < 256 and x.storage_offset() > 0, id="tail-offset"),
        pytest.param(lambda x, w: w.shape[0] == 8, id="a-part-alone"),
    ],
)
def test_the_check_rejects_bits_that_follow_the_shape(small_blocks, monkeypatch, condition):
    monkeypatch.setattr(cr, "_product", nudged(condition))
    assert not check()


def test_the_check_rejects_bits_that_follow_a_rows_place(small_blocks, monkeypatch):
    def by_place(x_MK, weight_NK, bias_N, out_MN):  # even rows one way, odd rows another
        row_by_row(x_MK, weight_NK, bias_N, out_MN)
        out_MN[1::2] = (x_MK[1::2].double() @ weight_NK.double().t() + bias_N.double()).float() * (1 + 2**-20)

    monkeypatch.setattr(cr, "_product", by_place)
    assert not check()


def test_verdicts_are_cached_per_group(small_blocks, monkeypatch):
    calls = []
    monkeypatch.setattr(cr, "_run_rows_check", lambda *a: calls.append(a[0]) or True)
    assert check() and check() and check(cr.LinearGroup(16, (8,), False))
    assert calls == [QKV, cr.LinearGroup(16, (8,), False)]


# -- groups ----------------------------------------------------------------------------------------------
def tiny_args(**overrides):
    shape = dict(arch="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                 qkv_bias=True, tie_word_embeddings=True)  # fmt: skip
    return ModelArgs(**{**shape, **overrides})


def test_the_packed_and_the_split_model_have_the_same_groups():
    packed, split = (
        cr.linear_groups(CausalLM(tiny_args(), fused=True)),
        cr.linear_groups(CausalLM(tiny_args())),
    )
    assert sorted(g for g, _ in packed) == sorted(g for g, _ in split)
    qkv, gate_up = cr.LinearGroup(32, (32, 16, 16), True), cr.LinearGroup(32, (48, 48), False)
    kinds = {g: 0 for g, _ in split}
    for group, layers in split:
        kinds[group] += 1
        assert len(layers) == len(group.widths)  # the parts, each a layer of its own
    assert kinds == {qkv: 2, gate_up: 2, cr.LinearGroup(32, (32,), False): 2, cr.LinearGroup(48, (32,), False): 2,
                     cr.LinearGroup(32, (96,), False): 1}  # fmt: skip
    assert all(len(layers) == 1 for _, layers in packed)


def test_choose_kernels_gives_a_groups_layers_its_verdict(monkeypatch):
    model = CausalLM(tiny_args())
    monkeypatch.setattr(cr, "rows_check", lambda group, dtype, device: len(group.widths) > 1)  # packed pass
    kernels = cr.choose_kernels(model, torch.bfloat16, torch.device("cuda"))  # the check itself is replaced
    assert sorted(kernels.values()) == ["cublas", "cublas", "triton", "triton", "triton"]
    layer = model.model.layers[1]
    # q/k/v share the packed group's blocks (so the engine's qkv_proj and the trainer's q_proj agree)
    assert {layer.self_attn.q_proj.cublas_block_rows, layer.self_attn.v_proj.cublas_block_rows} == {4096}
    assert layer.mlp.up_proj.cublas_block_rows == 4096
    assert layer.self_attn.o_proj.cublas_block_rows == layer.mlp.down_proj.cublas_block_rows == 0
    assert model.lm_head.cublas_block_rows == 0
    # no CUDA device: nothing is checked, every layer keeps the Triton kernel
    cr.choose_kernels(model, torch.float32, torch.device("cpu"))
    assert {m.cublas_block_rows for m in model.modules() if isinstance(m, torch.nn.Linear)} == {0}
