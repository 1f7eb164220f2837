"""Offline tiny assets: the locally trained tokenizer, its chat template, tiny checkpoints and the CLI."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from clawrl.cli.main import main as clawrl_main
from clawrl.models import tiny
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer, check_tiny_model_args

ARCH_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
TEXTS = [
    "Tom has 3 apples and buys 5 more. How many apples does Tom have?\n#### 8",
    "The answer is $\\boxed{\\frac{12}{7}}$, i.e. 1,714.29%.",
    'def f(x):\n    return {"name": "get_weather", "arguments": {"city": "Paris"}}\n\n\n',
    "café naïve — 東京 😀 it's   spaced\tout",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch=arch, tokenizer=tokenizer) for arch in ARCH_CLASSES}


# ------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------
def test_tokenizer_vocab_layout(tokenizer):
    assert len(tokenizer) == 4096
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.convert_tokens_to_ids(list(tiny.TAG_TOKENS)) == list(range(4090, 4096))
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token) == (
        "<|endoftext|>",
        "<|im_end|>",
        None,
    )


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("Pay 12345 or 678.90 now")["input_ids"])
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == ["1", "2", "3", "4", "5", "6", "7", "8", "9", "0"]


def test_no_special_tokens_added_and_round_trip(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert 0 not in ids and 1 not in ids and 2 not in ids
        assert tokenizer.decode(ids) == text


def test_tags_are_single_tokens_kept_by_skip_special(tokenizer):
    text = "<|im_start|>assistant\n<think>hm</think><tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2
    for tag in tiny.TAG_TOKENS[:2] + tiny.TAG_TOKENS[4:]:
        assert ids.count(tokenizer.convert_tokens_to_ids(tag)) == 1
    assert (
        tokenizer.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>hm</think><tool_call>\n{}\n</tool_call>"
    )


def test_common_words_are_learned(tokenizer):
    # The corpus must actually shape the vocabulary: frequent words are single tokens.
    for word in [" apples", " How", " many", " return", " answer", "####"]:
        assert len(tokenizer(word)["input_ids"]) == 1, word


def test_tokenizer_is_deterministic_across_processes():
    code = (
        "import sys; from clawrl.models.tiny import _trained_tokenizer_json as t; "
        "sys.stdout.write(t(4096, None))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert other == tiny._trained_tokenizer_json(4096, None)  # this process's cached training
    tiny._trained_tokenizer_json.cache_clear()
    assert tiny._trained_tokenizer_json(4096, None) == other  # a fresh training in this process


def test_vocab_sizes_and_custom_corpus():
    assert len(build_tiny_tokenizer(512)) == 512
    small = build_tiny_tokenizer(2000, corpus=["the cat sat on the mat"] * 3)
    # 256 bytes + 9 special/tag tokens + a handful of merges: the corpus, not vocab_size, is the limit.
    assert 265 < len(small) < 300
    assert small.decode(small("the mat")["input_ids"]) == "the mat"
    for bad in (100, 264, 70000):
        with pytest.raises(ValueError, match=f"vocab_size={bad} is outside 265..65536"):
            build_tiny_tokenizer(bad)


def test_chat_template_renders_tools_and_tool_calls(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"celsius": 20}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou can call the functions described by these JSON schemas:\n"
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}\n'
        '</tools>\n\nTo call one, reply with a JSON object holding its "name" and "arguments" between '
        '<tool_call> and </tool_call>, e.g.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"celsius": 20}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_chat_template_plain_turns_and_string_arguments(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"name": "f", "arguments": '{"x": 1}'}],
        },
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n"
        '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        "<|im_end|>\n"
    )
    with pytest.raises(Exception, match="unknown chat role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


# ------------------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCH_CLASSES))
def test_checkpoint_loads_offline_and_generates(arch, tiny_dirs, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    path = tiny_dirs[arch]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"] == [ARCH_CLASSES[arch]]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (4096, 64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 2, 0)
    assert config["tie_word_embeddings"] is True
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [2, 0]

    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    # Whichever tokenizer class transformers picks (Qwen2Tokenizer for qwen2), it tokenizes like the built one.
    chat = "<|im_start|>assistant\n<think>x</think><tool_call>\n{}\n</tool_call><|im_end|>\n<|endoftext|>"
    for text in [*TEXTS, chat]:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(chat)["input_ids"], skip_special_tokens=True) == (
        "assistant\n<think>x</think><tool_call>\n{}\n</tool_call>\n"
    )
    prompt = loaded.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 5?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n"
    inputs = loaded(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    new_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new_ids) == 6 and all(0 <= i < 4096 for i in new_ids)
    assert loaded.decode(out[0]).startswith(prompt)
    assert isinstance(loaded.decode(new_ids), str)


def test_weights_are_seeded_and_untied_adds_lm_head(tmp_path, tokenizer):
    kwargs = dict(arch="llama", tokenizer=tokenizer, hidden_size=32, num_heads=2, num_kv_heads=1)
    torch.manual_seed(123)
    before = torch.rand(1)
    start = time.perf_counter()
    a = build_tiny_model(tmp_path / "a", seed=5, **kwargs)
    build_seconds = time.perf_counter() - start
    b = build_tiny_model(tmp_path / "b", seed=5, **kwargs)
    c = build_tiny_model(tmp_path / "c", seed=6, tie_word_embeddings=False, **kwargs)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is untouched
    assert build_seconds < 10  # measured ~0.1 s once the tokenizer is trained
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(c / "model.safetensors", "pt") as fc:
        assert "lm_head.weight" not in set(fa.keys()) and "lm_head.weight" in set(fc.keys())
        assert not torch.equal(
            fa.get_tensor("model.embed_tokens.weight"), fc.get_tensor("model.embed_tokens.weight")
        )
        assert fa.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (16, 32)  # 1 kv head x 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"arch": "gpt2"}, "arch='gpt2' is not one of qwen2, qwen3, llama"),
        ({"vocab_size": 255}, "vocab_size=255 is outside"),
        ({"hidden_size": 30}, "hidden_size=30 is not divisible by num_heads=4"),
        ({"num_kv_heads": 3}, "num_heads=4 is not divisible by num_kv_heads=3"),
        ({"hidden_size": 12, "num_heads": 4}, "gives head dim 3, which must be even"),
        ({"num_layers": 0}, "num_layers=0 must be >= 1"),
    ],
)
def test_bad_model_arguments(overrides, message):
    args = dict(arch="qwen2", vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tiny_model_args(**{**args, "intermediate_size": 128, **overrides})


def test_tokenizer_larger_than_vocab_is_rejected(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="tokenizer has 4096 tokens but vocab_size=1024"):
        build_tiny_model(tmp_path, vocab_size=1024, tokenizer=tokenizer)


# ------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------
def _clawrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    flags = ["--arch", "qwen3", "--vocab-size", "1024", "--hidden-size", "32", "--num-layers", "1"]
    flags += [
        "--num-heads",
        "4",
        "--num-kv-heads",
        "1",
        "--intermediate-size",
        "48",
        "--untied",
        "--seed",
        "7",
    ]
    result = _clawrl("make-tiny-model", str(out), *flags)
    assert result.returncode == 0, result.stderr
    files = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert files <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["hidden_size"]) == ("qwen3", 1024, 32)
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (1, 1, 8)
    assert (config["intermediate_size"], config["tie_word_embeddings"]) == (48, False)
    # embed 1024x32 + lm_head 1024x32 + final norm 32 + layer: q 32x32, k,v 8x32, o 32x32, q/k norm 8+8,
    # mlp 3 x 48x32, two norms 2x32
    num_params = 2 * 1024 * 32 + 32 + 32 * 32 * 2 + 8 * 32 * 2 + 16 + 3 * 48 * 32 + 64
    assert result.stdout.strip() == f"wrote qwen3 checkpoint with {num_params:,} parameters to {out}"

    # The Done-when bullet of issue 2: the CLI-built checkpoint loads and generates with transformers, offline.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == num_params
    inputs = loaded("Tom has 3 apples.", return_tensors="pt")
    out_ids = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=True, top_k=50)
    assert out_ids.shape == (1, inputs["input_ids"].shape[1] + 5)
    assert loaded.decode(out_ids[0]).startswith("Tom has 3 apples.")

    again = _clawrl("make-tiny-model", str(out), "--arch", "qwen3")
    assert again.returncode == 2
    assert (
        again.stderr.strip()
        == f"clawrl make-tiny-model: error: OUT_DIR {out} is not empty; pass --force to write into it"
    )


def test_cli_bad_flag_value_exits_2_with_one_error_line(tmp_path):
    result = _clawrl("make-tiny-model", str(tmp_path / "x"), "--num-heads", "3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "clawrl make-tiny-model: error: --hidden-size=64 is not divisible by --num-heads=3"
    ]
    assert not (tmp_path / "x").exists()


def test_cli_argparse_errors_and_force(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        clawrl_main(["make-tiny-model", str(tmp_path), "--arch", "gpt2"])
    assert exc.value.code == 2
    assert "argument --arch: invalid choice: 'gpt2'" in capsys.readouterr().err

    assert clawrl_main(["make-tiny-model", str(tmp_path / "v"), "--vocab-size", "70000"]) == 2
    assert "--vocab-size=70000 is outside 265..65536" in capsys.readouterr().err

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (tmp_path / "old" / "notes.txt").write_text("keep me")
    assert clawrl_main(["make-tiny-model", str(tmp_path / "old"), "--force", "--vocab-size", "512"]) == 0
    names = {p.name for p in (tmp_path / "old").iterdir()}
    assert "model-00001-of-00002.safetensors" not in names and {"notes.txt", "model.safetensors"} <= names
    assert Path(tmp_path / "old" / "config.json").exists()
