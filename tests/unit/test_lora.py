"""LoRA pieces on CPU: the LoRA linear against hand computation, apply_lora on the native decoder, the
--lora-* flags, merging an adapter into base tensors, and the PEFT adapter directory layout.

    .venv/bin/pytest tests/unit/test_lora.py -x -q -p no:cacheprovider
"""

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from clawrl.config import ConfigError, parse_job_args
from clawrl.config.train import TrainConfig, parse_target_modules
from clawrl.models.decoder import CausalLM
from clawrl.models.lora import (
    LoRALinear,
    LoraSpec,
    adapters_disabled,
    apply_lora,
    lora_modules,
    merge_adapter_state,
    write_peft_adapter,
)
from clawrl.models.tiny import build_tiny_model

W = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
BIAS = [0.5, -0.5]
X = [1.0, 0.0, -1.0]


def _layer(*, rank=1, alpha=4.0) -> LoRALinear:
    base = nn.Linear(3, 2)
    with torch.no_grad():
        base.weight.copy_(torch.tensor(W))
        base.bias.copy_(torch.tensor(BIAS))
    base.requires_grad_(False)
    layer = LoRALinear(base, rank=rank, alpha=alpha)
    with torch.no_grad():
        layer.lora_A.weight.copy_(torch.tensor([[1.0, 0.0, 0.0]]))
        layer.lora_B.weight.copy_(torch.tensor([[2.0], [3.0]]))
    return layer


def test_forward_and_merged_weight_by_hand():
    layer = _layer()
    # base: W x + b = [1 - 3 + 0.5, 4 - 6 - 0.5] = [-1.5, -2.5]; A x = 1; B A x = [2, 3]; scaling 4 / 1
    out = layer(torch.tensor([X]))
    assert out.tolist() == [[6.5, 9.5]]
    assert layer.merged_weight().tolist() == [[9.0, 2.0, 3.0], [16.0, 5.0, 6.0]]
    # the merged layer computes the same outputs without an adapter
    merged_out = torch.nn.functional.linear(torch.tensor([X]), layer.merged_weight(), layer.bias)
    assert merged_out.tolist() == [[6.5, 9.5]]
    assert layer.weight.tolist() == W  # merging does not change the base weight


def test_gradient_reaches_only_a_and_b():
    layer = _layer()
    layer(torch.tensor([X])).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    # d/dB = scaling * (A x) for each output = 4 * 1; d/dA = scaling * (B^T 1) x^T = 4 * 5 * [1, 0, -1]
    assert layer.lora_B.weight.grad.tolist() == [[4.0], [4.0]]
    assert layer.lora_A.weight.grad.tolist() == [[20.0, 0.0, -20.0]]


def test_fresh_adapter_is_the_base_layer_and_dropout_only_hits_the_adapter():
    base = nn.Linear(3, 2)
    expected = base(torch.tensor([X]))
    layer = LoRALinear(base, rank=2, alpha=16.0, dropout=0.5)
    assert layer.scaling == 8.0
    assert torch.equal(layer(torch.tensor([X])), expected)  # B starts at zero
    assert layer.lora_A.weight.abs().sum() > 0  # A does not (else no gradient would ever reach B)
    assert layer.weight is base.weight and layer.bias is base.bias  # shared, not copied
    with torch.no_grad():
        layer.lora_B.weight.fill_(1.0)
    x = torch.ones(1, 3) * 0.25
    with torch.no_grad():  # a log-prob pass: no dropout even in training mode
        undropped = base(x) + 8.0 * (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
        assert all(torch.allclose(layer(x), undropped, rtol=1e-6, atol=0) for _ in range(10))
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    torch.manual_seed(0)
    draws = {tuple(layer(x).flatten().tolist()) for _ in range(20)}
    assert len(draws) > 1  # a training pass with grad on drops adapter inputs at random
    with adapters_disabled(nn.Sequential(layer)):
        assert torch.equal(layer(torch.tensor([X])), expected)
    assert not torch.equal(layer(torch.tensor([X])), expected)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "m", arch="qwen2", vocab_size=512, hidden_size=32,
                            num_layers=2)  # fmt: skip


def _model(tiny_dir) -> CausalLM:
    from clawrl.models.hf_io import load_model

    return load_model(tiny_dir)


def test_apply_lora_targets_freezes_and_keeps_hf_names(tiny_dir):
    model = _model(tiny_dir)
    names_before = [n for n, _ in model.named_parameters()]
    adapted = apply_lora(model, LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    assert adapted == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if ".lora_" not in n] == names_before  # base names unchanged
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    args = model.args
    q_out, v_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    # rank * (in + out) per adapted layer
    assert sum(trainable.values()) == 2 * 4 * ((32 + q_out) + (32 + v_out))
    assert set(trainable) == {f"{p}.lora_{ab}.weight" for p in adapted for ab in "AB"}


def test_all_linear_adapts_every_block_linear_but_not_the_head(tiny_dir):
    model = _model(tiny_dir)
    adapted = apply_lora(model, LoraSpec(rank=2, alpha=2))
    last_names = sorted({p.rsplit(".", 1)[-1] for p in adapted})
    assert last_names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert len(adapted) == 14 and len(list(lora_modules(model))) == 14
    assert isinstance(model.lm_head, nn.Linear) and not model.lm_head.weight.requires_grad


def test_adapted_model_starts_equal_to_base_and_adapters_disabled_is_the_base(tiny_dir):
    from clawrl.models.attention import VarlenAttention

    model = _model(tiny_dir)
    ids, pos = torch.tensor([3, 9, 27, 81]), torch.arange(4)
    attn = VarlenAttention.from_lengths([4], device="cpu")
    base_out = model(ids, pos, attn)
    apply_lora(model, LoraSpec(rank=2, alpha=4))
    assert torch.equal(model(ids, pos, attn), base_out)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.weight.normal_()
    assert not torch.allclose(model(ids, pos, attn), base_out)
    with adapters_disabled(model):
        assert torch.equal(model(ids, pos, attn), base_out)


def test_unknown_target_module_is_one_error_listing_the_names(tiny_dir):
    message = r"--target-modules q_proj,qkv: \['qkv'\] match no linear layer.*'up_proj'"
    with pytest.raises(ValueError, match=message):
        apply_lora(_model(tiny_dir), LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "qkv")))


def test_flags_parse_and_bad_values_name_the_flag():
    job = parse_job_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--lora-rank", "8", "--lora-alpha", "32",
                          "--target-modules", "q_proj, v_proj", "--lora-dropout", "0.1"])  # fmt: skip
    train = job.train
    assert (train.lora_rank, train.lora_alpha, train.lora_dropout) == (8, 32.0, 0.1)
    assert parse_target_modules(train.target_modules) == ("q_proj", "v_proj")
    defaults = TrainConfig()
    assert (defaults.lora_rank, defaults.lora_alpha, defaults.target_modules) == (0, 16.0, "all-linear")
    for kwargs, message in [
        ({"lora_rank": -1}, "--lora-rank must be >= 0, got -1"),
        ({"lora_alpha": 0.0}, "--lora-alpha must be > 0, got 0.0"),
        ({"lora_dropout": 1.0}, r"--lora-dropout must be in \[0, 1\), got 1.0"),
        ({"target_modules": "q_proj,,v_proj"}, "--target-modules must be a comma-separated list"),
        ({"target_modules": "all-linear,q_proj"}, "'all-linear' stands alone"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**kwargs)


def test_merge_adapter_state_by_hand_and_mismatch():
    base = {"l.q_proj.weight": torch.tensor(W), "l.q_proj.bias": torch.tensor(BIAS), "other": torch.ones(1)}
    adapter = {"l.q_proj.lora_A.weight": torch.tensor([[1.0, 0.0, 0.0]]),
               "l.q_proj.lora_B.weight": torch.tensor([[2.0], [3.0]])}  # fmt: skip
    merged = merge_adapter_state(base, adapter, LoraSpec(rank=1, alpha=4))
    assert merged["l.q_proj.weight"].tolist() == [[9.0, 2.0, 3.0], [16.0, 5.0, 6.0]]
    assert merged["l.q_proj.bias"] is base["l.q_proj.bias"] and merged["other"] is base["other"]
    with pytest.raises(ValueError, match=r"the adapter of 'l.q_proj' \(\[2, 1\] @ \[1, 3\]\) does not fit"):
        merge_adapter_state({"l.q_proj.weight": torch.ones(3, 3)}, adapter, LoraSpec(rank=1, alpha=4))


def test_peft_adapter_directory_layout(tmp_path):
    adapter = {
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
        "model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(4, 64),
        "model.layers.0.mlp.down_proj.lora_B.weight": torch.zeros(32, 4),
    }
    spec = LoraSpec(rank=4, alpha=8, dropout=0.05, target_modules=("all-linear",))
    out = write_peft_adapter(adapter, tmp_path / "adapter", spec=spec, base_model="/models/base")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.05)
    assert config["target_modules"] == ["down_proj", "q_proj"]  # what was adapted, not "all-linear"
    assert config["base_model_name_or_path"] == "/models/base"
    assert (config["bias"], config["use_rslora"], config["use_dora"]) == ("none", False, False)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        keys = sorted(f.keys())
        assert keys == sorted("base_model.model." + name for name in adapter)
        down_A = f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
        assert list(down_A.shape) == [4, 64]


def test_unknown_native_target_module_fails_in_validate_before_anything_starts():
    base = [
        "--rollout-batch-size",
        "2",
        "--num-rollout",
        "1",
        "--lora-rank",
        "4",
        "--target-modules",
        "q_proj,qkv_proj",
    ]
    with pytest.raises(
        ConfigError, match=r"--target-modules 'q_proj,qkv_proj': \['qkv_proj'\] name no linear"
    ):
        parse_job_args(base)
    # another architecture (--model-impl hf) has its own names: checked when the model is built
    assert parse_job_args([*base, "--model-impl", "hf"]).train.target_modules == "q_proj,qkv_proj"
    assert (
        parse_job_args(
            ["--rollout-batch-size", "2", "--num-rollout", "1", "--target-modules", "qkv_proj"]
        ).train.lora_rank
        == 0
    )


def test_model_impl_hf_takes_the_same_adapters_without_peft(tiny_dir):
    from clawrl.models.attention import VarlenAttention
    from clawrl.trainer.hf_model import load_hf_model

    model = load_hf_model(tiny_dir)
    ids, pos = torch.tensor([3, 9, 27, 81, 5]), torch.tensor([0, 1, 2, 0, 1])
    attn = VarlenAttention.from_lengths([3, 2], device="cpu")
    base_out = model(ids, pos, attn)
    adapted = apply_lora(model, LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "down_proj")))
    assert adapted == [
        f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "mlp.down_proj")
    ]
    assert torch.equal(model(ids, pos, attn), base_out)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{p}.lora_{ab}.weight" for p in adapted for ab in "AB")
