"""Native Qwen3-MoE / Qwen2-MoE vs transformers' own on random-weight tiny checkpoints (fp32, CPU).

Each config is built with transformers' config class, every parameter randomised, saved with
`save_pretrained` (per-expert names on disk) and loaded natively. The reference is transformers' forward on
right-padded sequences with an attention mask; the native model runs the same sequences packed flat.
The configs cover what changes the layer layout: `mlp_only_layers` (a dense layer between MoE layers),
`decoder_sparse_step` 2, top-k renormalised or not, and Qwen2-MoE's sigmoid-gated shared expert. The
transformers side (random model, padded batch, packed logits) is transformers_reference.py beside this file.

Run: .venv/bin/pytest tests/unit/test_models_moe.py -x -q
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig
from transformers_reference import (
    LENGTHS,
    checkpoint_fixture,
    hf_packed_logits,
    native_logits,
    packed_batch,
    padded,
    random_hf_model,
)

from clawrl.models.attention import VarlenAttention
from clawrl.models.config import ModelArgs, load_model_args
from clawrl.models.decoder import CausalLM
from clawrl.models.hf_io import export_hf_dir, hf_state_dict, load_model, save_hf
from clawrl.models.moe import (
    SparseMoeBlock,
    load_balancing_loss,
    moe_aux_loss_metric,
    moe_blocks,
    record_router_logits,
    route,
)
from clawrl.models.tiny import build_tiny_model

TINY_MOE = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
    num_experts=5, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
"""What the configs share unless they change it."""


def moe_config(config_cls, **changes):
    """A transformers MoE config: TINY_MOE with `changes` applied."""
    return config_cls(**{**TINY_MOE, **changes})


CONFIGS = {
    "qwen3_moe-dense-middle-layer-normtopk": lambda: moe_config(
        Qwen3MoeConfig, num_hidden_layers=3, head_dim=16, num_experts=6, norm_topk_prob=True, mlp_only_layers=[1],
        tie_word_embeddings=True,
    ),
    "qwen3_moe-sparse-step-2-top3-untied": lambda: moe_config(
        Qwen3MoeConfig, vocab_size=384, intermediate_size=96, head_dim=32, moe_intermediate_size=24,
        num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, attention_bias=True,
    ),
    "qwen2_moe-shared-expert": lambda: moe_config(Qwen2MoeConfig, shared_expert_intermediate_size=48),
}  # fmt: skip


def tiny_args(arch: str, **fields) -> ModelArgs:
    """ModelArgs of a one-layer 16-wide model (2 query heads, 1 KV head) of `arch`; `fields` add the rest."""
    return ModelArgs(
        arch=arch, vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
        intermediate_size=32, **fields,
    )  # fmt: skip


def disk_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


checkpoint = checkpoint_fixture(CONFIGS)
"""(name, checkpoint dir, transformers model) per config."""


def test_logits_match_transformers_fused_and_unfused(checkpoint):
    name, path, hf_model = checkpoint
    seqs, ids, positions = packed_batch(hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_packed_logits(hf_model, seqs)
        unfused = native_logits(load_model(path), ids, positions)
        fused = native_logits(load_model(path, fused=True), ids, positions)
    assert unfused.shape == (sum(LENGTHS), hf_model.config.vocab_size)
    assert (unfused - expected).abs().max() < 1e-5, name
    assert (fused - expected).abs().max() < 1e-5, name


def test_layer_layout_follows_mlp_only_layers_and_sparse_step(checkpoint):
    name, path, _ = checkpoint
    model = load_model(path)
    kinds = ["moe" if isinstance(layer.mlp, SparseMoeBlock) else "dense" for layer in model.model.layers]
    expected = {
        "qwen3_moe-dense-middle-layer-normtopk": ["moe", "dense", "moe"],
        "qwen3_moe-sparse-step-2-top3-untied": ["dense", "moe"],
        "qwen2_moe-shared-expert": ["moe", "moe"],
    }[name]
    assert kinds == expected


def test_state_dict_names_and_values_are_the_checkpoint_files(checkpoint):
    """HF names on disk (per-expert gate/up/down) == hf_state_dict of the unfused and of the fused model (a
    tied LM head left out, as transformers saves it); values bit-equal."""
    _, path, _ = checkpoint
    on_disk = disk_tensors(path)
    unfused = hf_state_dict(load_model(path))
    fused_export = hf_state_dict(load_model(path, fused=True))
    assert set(unfused) == set(on_disk) == set(fused_export)
    for key, value in on_disk.items():
        assert torch.equal(unfused[key], value), key
        assert torch.equal(fused_export[key], value), key


def test_aux_loss_equals_transformers_on_padded_batch(checkpoint):
    """transformers masks padding with attention_mask; the packed native forward has no padding rows."""
    _, path, hf_model = checkpoint
    seqs, ids, positions = packed_batch(hf_model.config.vocab_size)
    model = load_model(path)
    with torch.no_grad():
        ids_BL, mask_BL = padded(seqs)
        expected = hf_model(input_ids=ids_BL, attention_mask=mask_BL, output_router_logits=True).aux_loss
        with record_router_logits(model) as router_logits:
            model(ids, positions, VarlenAttention.from_lengths(LENGTHS))
    num_moe_layers = len(moe_blocks(model))
    assert len(router_logits) == num_moe_layers >= 1
    assert all(t.shape == (sum(LENGTHS), model.args.num_experts) for t in router_logits)
    got = load_balancing_loss(router_logits, model.args.num_experts_per_tok)
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)
    for block in moe_blocks(model):  # the recorder is removed on exit
        assert block.router_logits_sink is None


def test_gradients_match_transformers(tmp_path):
    """Cross-entropy over the packed batch: every gradient, including each expert's and the router's,
    matches transformers' (whose experts are 3-D [E, 2I, H] / [E, H, I] parameters)."""
    hf_model = random_hf_model(CONFIGS["qwen2_moe-shared-expert"]())
    hf_model.save_pretrained(tmp_path)
    native = load_model(tmp_path)
    seqs, ids, positions = packed_batch(hf_model.config.vocab_size)
    targets = torch.cat([torch.roll(seq, -1) for seq in seqs])
    torch.nn.functional.cross_entropy(native_logits(native, ids, positions), targets).backward()
    torch.nn.functional.cross_entropy(hf_packed_logits(hf_model, seqs), targets).backward()
    hf_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    inter = hf_model.config.moe_intermediate_size
    checked = 0
    for name, param in native.named_parameters():
        if ".experts." in name:  # model.layers.0.mlp.experts.3.gate_proj.weight
            prefix, expert, proj, _ = name.rsplit(".", 3)
            stacked = hf_grads[f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][
                int(expert)
            ]
            want = {"gate_proj": stacked[:inter], "up_proj": stacked[inter:], "down_proj": stacked}[proj]
        else:
            want = hf_grads[name]
        assert param.grad.abs().max() > 0, name
        assert (param.grad - want).abs().max() <= 1e-5 * want.abs().max(), name
        checked += 1
    assert checked == len(disk_tensors(tmp_path))


def test_dense_expert_path_equals_sparse_path():
    """The CUDA-graph path (every expert on every row) gives the sparse loop's values."""
    args = tiny_args(
        "qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
    )
    torch.manual_seed(0)
    block = SparseMoeBlock(args, fused=False)
    x = torch.randn(11, 16)
    weights, experts = route(block.gate(x), 2, norm_topk_prob=False)
    sparse = block.sparse_experts(x, weights, experts)
    dense = block.dense_experts(x, weights, experts)
    assert (sparse - dense).abs().max() < 1e-6
    assert sparse.abs().max() > 0


def test_route_by_hand():
    """Softmax over [0, ln 2, ln 3, ln 4] -> [0.1, 0.2, 0.3, 0.4]; top-2 = experts 3, 2."""
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    weights, experts = route(logits, 2, norm_topk_prob=False)
    assert experts.tolist() == [[3, 2]]
    assert weights[0].tolist() == pytest.approx([0.4, 0.3])
    weights, _ = route(logits, 2, norm_topk_prob=True)
    assert weights[0].tolist() == pytest.approx([4 / 7, 3 / 7])


def test_load_balancing_loss_by_hand():
    """2 rows, 2 experts, top-1. Row probs [0.75, 0.25] and [0.25, 0.75]: f = [0.5, 0.5], P = [0.5, 0.5]:
    loss = 2 * (0.25 + 0.25) = 1 (perfectly balanced). Both rows [0.75, 0.25]: f = [1, 0], P = [.75, .25]:
    loss = 2 * 0.75 = 1.5."""
    a = torch.log(torch.tensor([[3.0, 1.0]]))
    b = torch.log(torch.tensor([[1.0, 3.0]]))
    assert load_balancing_loss([a, b], top_k=1).item() == pytest.approx(1.0)
    assert load_balancing_loss([torch.cat([a, a])], top_k=1).item() == pytest.approx(1.5)
    # The trainer's metric: a micro-batch's share of the step mean; None for a dense model.
    with torch.device("meta"):
        dense = CausalLM(tiny_args("qwen3"))
    assert moe_aux_loss_metric(dense, [], 0.5) is None


def test_save_hf_round_trips_through_transformers(checkpoint, tmp_path):
    """save_hf without a source directory writes config.json from ModelArgs; transformers loads it."""
    name, path, hf_model = checkpoint
    native = load_model(path, fused=True)
    save_hf(native, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    reloaded.config._attn_implementation = "eager"
    seqs, _, _ = packed_batch(hf_model.config.vocab_size)
    with torch.no_grad():
        got = hf_packed_logits(reloaded, seqs)
        want = hf_packed_logits(hf_model, seqs)
    assert torch.equal(got, want), name
    assert load_model_args(tmp_path / "out") == load_model_args(path)


def test_export_hf_dir_writes_native_names(checkpoint, tmp_path):
    """The trainer's HF export path (export_hf_dir) takes the native tensors for MoE too, in bf16 here."""
    _, path, _ = checkpoint
    state = hf_state_dict(load_model(path))
    out = export_hf_dir(state, tmp_path / "export", source_dir=path, dtype=torch.bfloat16)
    on_disk = disk_tensors(out)
    assert set(on_disk) == set(disk_tensors(path))
    assert all(t.dtype == torch.bfloat16 for t in on_disk.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(
        load_model(out).model.layers[-1].mlp.gate.weight,
        state[f"model.layers.{len(load_model(out).model.layers) - 1}.mlp.gate.weight"]
        .to(torch.bfloat16)
        .float(),
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_checkpoint_matches_transformers(tmp_path, arch):
    path = build_tiny_model(tmp_path / arch, arch=arch, vocab_size=512, num_experts=4, num_experts_per_tok=2)
    args = load_model_args(path)
    assert (args.arch, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (
        arch, 4, 2, 32,
    )  # fmt: skip
    assert args.norm_topk_prob == (arch == "qwen3_moe")
    assert args.shared_expert_intermediate_size == (128 if arch == "qwen2_moe" else 0)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs, ids, positions = packed_batch(512)
    with torch.no_grad():
        expected = hf_packed_logits(hf_model, seqs)
        got = native_logits(load_model(path), ids, positions)
    assert (got - expected).abs().max() < 1e-5


def test_config_errors_name_the_field(tmp_path):
    cfg = CONFIGS["qwen3_moe-dense-middle-layer-normtopk"]().to_dict()
    cfg.update(num_experts_per_tok=9)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"config.json: ModelArgs.num_experts_per_tok=9 exceeds num_experts=6"
    ):
        load_model_args(tmp_path)
    cfg.update(num_experts_per_tok=2, moe_intermediate_size=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"moe_intermediate_size=0 must be > 0 for arch='qwen3_moe'"):
        load_model_args(tmp_path)
