"""Loading and saving HF directories: save_hf round trips through transformers, sharding, non-weight files,
live (partial) weight updates through the same load_weights path, and the errors for checkpoints that do
not fit the model. export_hf_dir (what --save-hf and convert-checkpoint write): the source's dtype, a tied
head stored as the source stores it, atomic replacement, and architectures only transformers implements."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from clawrl.models.attention import VarlenAttention
from clawrl.models.config import ModelArgs, load_model_args
from clawrl.models.decoder import CausalLM
from clawrl.models.hf_io import export_hf_dir, hf_state_dict, load_model, save_hf, source_dtype
from clawrl.models.loader import INDEX_FILE, SINGLE_FILE, iter_safetensors, load_weights

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
LENGTHS = [7, 3, 12]
NON_WEIGHT_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {}}',
    "tokenizer_config.json": '{"model_max_length": 128}',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


def make_checkpoint(path, config, seed=0):
    """Random-weight transformers model saved to `path` plus stand-in tokenizer files; returns the model."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.2 * torch.randn_like(param)
                if name.endswith("norm.weight")
                else 0.1 * torch.randn_like(param)
            )
    model.save_pretrained(path)
    for name, text in NON_WEIGHT_FILES.items():
        (path / name).write_text(text)
    return model


def batch(vocab_size):
    ids = torch.randint(0, vocab_size, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return ids, positions


def hf_logits(hf_model, ids):
    """transformers' logits for each packed segment run on its own, concatenated."""
    out, start = [], 0
    for n in LENGTHS:
        out.append(hf_model(input_ids=ids[None, start : start + n]).logits[0])
        start += n
    return torch.cat(out)


def native_logits(model, ids, positions):
    return model.compute_logits(model(ids, positions, VarlenAttention.from_lengths(LENGTHS)))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return path, make_checkpoint(path, Qwen3Config(vocab_size=512, head_dim=32, **TINY))


@pytest.fixture(scope="module")
def qwen2_tied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return path, make_checkpoint(path, Qwen2Config(vocab_size=512, tie_word_embeddings=True, **TINY))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("which", ["qwen3_dir", "qwen2_tied_dir"])
def test_save_hf_loads_in_transformers_with_identical_logits(request, tmp_path, which, fused):
    src, hf_model = request.getfixturevalue(which)
    save_hf(load_model(src, fused=fused), tmp_path, source_dir=src)

    assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    assert set(load_file(tmp_path / SINGLE_FILE)) == set(load_file(src / SINGLE_FILE))  # HF names, un-fused
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, _ = batch(512)
    with torch.no_grad():
        assert torch.equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))
    for name in [*NON_WEIGHT_FILES, "generation_config.json"]:
        assert (tmp_path / name).read_bytes() == (src / name).read_bytes(), name


def test_save_hf_shards_with_index_and_replaces_stale_shards(qwen3_dir, tmp_path):
    src, hf_model = qwen3_dir
    model = load_model(src, fused=True)
    save_hf(model, tmp_path, source_dir=src, max_shard_bytes=60_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf_state_dict(model).values())
    ids, positions = batch(512)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))
        assert torch.equal(
            native_logits(load_model(tmp_path), ids, positions), native_logits(model, ids, positions)
        )

    save_hf(model, tmp_path, source_dir=src)  # now one file: the old shards and index must go
    assert sorted(p.name for p in tmp_path.glob("model*.safetensors")) == [SINGLE_FILE]
    assert not (tmp_path / INDEX_FILE).exists()


def test_save_hf_in_bf16_records_dtype(qwen2_tied_dir, tmp_path):
    src, _ = qwen2_tied_dir
    model = load_model(src, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the dtype change
    save_hf(model, tmp_path, source_dir=src)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / SINGLE_FILE, framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118
    assert load_model_args(tmp_path).torch_dtype == "bfloat16"


def test_save_hf_without_source_writes_a_config_transformers_reads(tmp_path):
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8}  # fmt: skip
    src = tmp_path / "src"
    src.mkdir()
    hf_model = make_checkpoint(src, LlamaConfig(vocab_size=1024, rope_scaling=rope, **TINY))
    model = load_model(src)
    save_hf(model, tmp_path / "out")
    assert load_model_args(tmp_path / "out") == model.args
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids, _ = batch(1024)
    with torch.no_grad():
        assert torch.equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))


def test_live_update_of_one_tensor_into_fused_model(qwen3_dir):
    """The engine's weight-update path: a bucket with one HF-named tensor lands in the packed qkv slice."""
    src, hf_model = qwen3_dir
    model = load_model(src, fused=True)
    new_k = torch.randn_like(hf_model.model.layers[1].self_attn.k_proj.weight)
    with torch.no_grad():
        old_qkv = model.model.layers[1].self_attn.qkv_proj.weight.clone()
        written = load_weights(model, [("model.layers.1.self_attn.k_proj.weight", new_k)], strict=False)
    assert written == {"model.layers.1.self_attn.qkv_proj.weight"}
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[128:192], new_k)  # q rows 0..127 (4 heads x 32), k rows 128..191
    assert torch.equal(qkv[:128], old_qkv[:128]) and torch.equal(qkv[192:], old_qkv[192:])

    updated_hf = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    with torch.no_grad():
        updated_hf.model.layers[1].self_attn.k_proj.weight.copy_(new_k)
        ids, positions = batch(512)
        expected = hf_logits(updated_hf, ids)
        assert ((native_logits(model, ids, positions) - expected).abs().max() / expected.abs().max()) < 1e-5


def test_tied_checkpoint_lm_head_is_accepted_and_ignored(qwen2_tied_dir):
    src, _ = qwen2_tied_dir
    model = load_model(src)
    embed = model.model.embed_tokens.weight.detach().clone()
    tensors = dict(iter_safetensors(src))
    tensors["lm_head.weight"] = torch.zeros_like(embed)
    load_weights(model, tensors.items())
    assert torch.equal(model.lm_head.weight, embed)


def test_llama_checkpoint_into_qwen3_args_names_the_missing_norms(tmp_path):
    make_checkpoint(tmp_path, LlamaConfig(vocab_size=512, head_dim=16, **TINY))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    with pytest.raises(
        ValueError, match=r"no tensor for parameter\(s\) of the CausalLM \(arch='qwen3'\)"
    ) as e:
        load_model(tmp_path)
    assert "model.layers.0.self_attn.k_norm.weight" in str(e.value) and str(tmp_path) in str(e.value)


def test_qwen2_checkpoint_into_llama_model_names_the_unexpected_tensor(qwen2_tied_dir):
    src, _ = qwen2_tied_dir
    args = ModelArgs.from_hf_config({**json.loads((src / "config.json").read_text()), "model_type": "llama"})
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.[qkv]_proj\.bias'"
    ):
        load_weights(
            CausalLM(args),
            iter_safetensors(src),
            files=dict.fromkeys(load_file(src / SINGLE_FILE), str(src / SINGLE_FILE)),
        )


@pytest.mark.parametrize("fused", [False, True])
def test_wrong_shape_names_tensor_parameter_file_and_both_shapes(qwen3_dir, tmp_path, fused):
    src, _ = qwen3_dir
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(src / SINGLE_FILE)
    tensors["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(96, 64)  # 3 heads instead of 4
    save_file(tensors, tmp_path / SINGLE_FILE)
    param = (
        "model.layers.1.self_attn.qkv_proj.weight' (shard 'q')"
        if fused
        else "model.layers.1.self_attn.q_proj.weight'"
    )
    with pytest.raises(ValueError) as e:
        load_model(tmp_path, fused=fused)
    message = str(e.value)
    assert (
        str(tmp_path / SINGLE_FILE) in message
        and "'model.layers.1.self_attn.q_proj.weight' has shape (96, 64)" in message
    )
    assert f"parameter '{param} of the CausalLM (arch='qwen3') model expects (128, 64)" in message


def test_directory_without_weights_or_config_is_a_clear_error(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path}/config.json: file not found"):
        load_model(tmp_path)
    shutil.copy(qwen3_dir[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=rf"{tmp_path}: no model.safetensors or {INDEX_FILE}"):
        load_model(tmp_path)
    (tmp_path / INDEX_FILE).write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(
        ValueError, match=r"lists shard 'model-00001-of-00002.safetensors', which does not exist"
    ):
        load_model(tmp_path)


def trainer_state(src):
    """HF-named fp32 tensors as the trainer holds them: a tied head appears as an alias of the embedding."""
    model = load_model(src)
    state = {name: t.detach().clone() for name, t in hf_state_dict(model).items()}
    if model.args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def with_config(src, dst, **changes):
    """A copy of the checkpoint `src` at `dst` with config.json entries changed (None removes one)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_export_hf_dir_writes_the_source_dtype_bit_exact_with_its_files(qwen3_dir, tmp_path):
    src, _ = qwen3_dir
    bf16_src = with_config(src, tmp_path / "bf16_src", dtype="bfloat16")
    state = trainer_state(src)
    out = export_hf_dir(state, tmp_path / "out", source_dir=bf16_src)

    saved = load_file(out / SINGLE_FILE)
    assert saved.keys() == state.keys()
    assert all(
        saved[n].dtype == torch.bfloat16 and torch.equal(saved[n], t.bfloat16()) for n, t in state.items()
    )
    config = json.loads((out / "config.json").read_text())
    assert config == {**json.loads((bf16_src / "config.json").read_text()), "dtype": "bfloat16"}
    for name in [*NON_WEIGHT_FILES, "generation_config.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16_src", "out"]  # no staging directory left
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    assert load_model_args(out).torch_dtype == "bfloat16"

    as_fp32 = export_hf_dir(state, tmp_path / "fp32", source_dir=bf16_src, dtype=torch.float32)
    assert all(torch.equal(t, state[n]) for n, t in load_file(as_fp32 / SINGLE_FILE).items())


def test_source_dtype_falls_back_to_the_stored_tensors(qwen3_dir, tmp_path):
    src, _ = qwen3_dir
    assert source_dtype(src) == torch.float32
    bare = with_config(src, tmp_path / "bare", dtype=None, torch_dtype=None)
    save_file({n: t.half() for n, t in load_file(src / SINGLE_FILE).items()}, bare / SINGLE_FILE)
    assert source_dtype(bare) == torch.float16
    assert (
        source_dtype(with_config(src, tmp_path / "old", dtype=None, torch_dtype="bfloat16")) == torch.bfloat16
    )


def test_export_hf_dir_shards_and_transformers_and_clawrl_load_it(qwen3_dir, tmp_path):
    src, hf_model = qwen3_dir
    state = trainer_state(src)
    out = export_hf_dir(state, tmp_path / "out", source_dir=src, max_shard_bytes=60_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert sorted(index["weight_map"]) == sorted(state) and not (out / SINGLE_FILE).exists()
    ids, positions = batch(512)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))
        native = load_model(out)
        assert torch.equal(
            native_logits(native, ids, positions), native_logits(load_model(src), ids, positions)
        )


def test_export_hf_dir_stores_a_tied_head_as_the_source_does(qwen2_tied_dir, tmp_path):
    src, _ = qwen2_tied_dir
    state = trainer_state(src)
    assert "lm_head.weight" in state  # the alias a DCP checkpoint carries
    assert "lm_head.weight" not in load_file(
        export_hf_dir(state, tmp_path / "a", source_dir=src) / SINGLE_FILE
    )

    stores_head = tmp_path / "stores_head"
    shutil.copytree(src, stores_head)
    tensors = load_file(src / SINGLE_FILE)
    save_file(
        {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, stores_head / SINGLE_FILE
    )
    saved = load_file(export_hf_dir(state, tmp_path / "b", source_dir=stores_head) / SINGLE_FILE)
    assert saved.keys() == {*tensors, "lm_head.weight"}
    assert torch.equal(saved["lm_head.weight"], state["model.embed_tokens.weight"])


def test_export_hf_dir_replaces_an_earlier_export_only_when_complete(qwen3_dir, tmp_path):
    src, _ = qwen3_dir
    state, out = trainer_state(src), tmp_path / "out"
    export_hf_dir(state, out, source_dir=src, max_shard_bytes=60_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = {**state, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"do not fit its architecture \(qwen3\): tensor 'model.norm.weight' has "
                       r"shape \[3\], expected \[64\]"):  # fmt: skip
        export_hf_dir(bad, out, source_dir=src)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the failed export changed nothing
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    changed = {name: t + 1 for name, t in state.items()}
    export_hf_dir(changed, out, source_dir=src)
    assert sorted(p.name for p in out.glob("model*")) == [SINGLE_FILE]  # the shards and index are gone
    assert all(torch.equal(t, changed[n]) for n, t in load_file(out / SINGLE_FILE).items())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_export_hf_dir_refuses_other_directories_and_unknown_architectures(qwen3_dir, tmp_path):
    src, _ = qwen3_dir
    state = trainer_state(src)
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"^{data}: exists and is not a HF model directory"):
        export_hf_dir(state, data, source_dir=src)
    assert [p.name for p in data.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match=rf"^{src}: is the source model directory itself"):
        export_hf_dir(state, src, source_dir=src)
    unknown = with_config(src, tmp_path / "unknown", model_type="no_such_model")
    with pytest.raises(ValueError, match=rf"^{unknown}: unsupported architecture for a HF export"):
        export_hf_dir(state, tmp_path / "out", source_dir=unknown)
    assert not (tmp_path / "out").exists()


def test_export_hf_dir_of_an_architecture_only_transformers_implements(tmp_path):
    src = tmp_path / "mistral"
    src.mkdir()
    hf_model = make_checkpoint(src, MistralConfig(vocab_size=512, head_dim=16, **TINY))
    state = {name: p.detach().clone() for name, p in hf_model.named_parameters()}
    out = export_hf_dir(state, tmp_path / "out", source_dir=src, max_shard_bytes=60_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / INDEX_FILE).is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "mistral"
    for name in NON_WEIGHT_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids, _ = batch(512)
    with torch.no_grad():
        assert torch.equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))
