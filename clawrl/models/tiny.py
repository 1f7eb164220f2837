"""Offline tiny assets: a locally trained BPE tokenizer with a ChatML chat template, and tiny random checkpoints.

Nothing is downloaded. The tokenizer is a byte-level BPE trained in well under a second by `tokenizers` on the
procedurally generated corpus of `clawrl.models.tiny_corpus`; digits are always split into single tokens, so
arithmetic stays learnable by tiny models. `build_tiny_model` writes a complete Hugging Face model directory
(tokenizer files, config.json, generation_config.json, model.safetensors) that loads with
`transformers.AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` with HF_HUB_OFFLINE=1.

    from clawrl.models.tiny import build_tiny_model
    path = build_tiny_model("/tmp/tiny-qwen3", arch="qwen3")

or from the shell: `clawrl make-tiny-model /tmp/tiny-qwen3 --arch qwen3`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: removed by decode(skip_special_tokens=True).
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Markup tokens: one id each, but kept by skip_special_tokens so tool calls and reasoning survive decoding.
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
MAX_VOCAB_SIZE = 65536
TINY_ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mistral", "gemma")
"""Architectures build_tiny_model writes; mistral and gemma have no native clawrl implementation (the
engine serves them through transformers, the trainer with --model-impl hf)."""

# Pre-tokenizer split, applied after NFC normalisation: contractions, words (with one leading non-letter),
# ONE digit at a time, punctuation runs, newline runs, other whitespace; byte-level mapping comes after it.
# This is the split Qwen2's tokenizer uses, on purpose: transformers loads every `model_type: qwen2` directory
# with its Qwen2Tokenizer class, which rebuilds normaliser and pre-tokenizer from this fixed recipe instead of
# reading tokenizer.json. Training with the same recipe makes the tokenizer identical under every loader.
_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# ChatML, Qwen-style. Every turn is closed as soon as it is rendered (each tool result is its own turn), so a
# rendered prefix of a conversation is always a prefix of the rendered whole: multi-turn loss masks can be
# computed by diffing renders (clawrl.data.chat) and agent rollouts can append turns token by token.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- text(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou can call the functions described by these JSON schemas:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\n\\nTo call one, reply with a JSON object holding its "name" and "arguments" '
    'between <tool_call> and </tool_call>, e.g.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}'
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and has_system -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + text(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message.role in ['user', 'system'] -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown chat role: ' + message.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# ------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------
def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError unless `vocab_size` can hold the byte alphabet and all special/tag tokens."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is outside {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE} (the minimum holds "
            f"{NUM_BYTE_TOKENS} byte tokens + {len(SPECIAL_TOKENS) + len(TAG_TOKENS)} special/tag tokens)"
        )


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, corpus: tuple[str, ...] | None) -> str:
    """Train the BPE once per (vocab_size, corpus) in this process; returns tokenizer.json text."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    from clawrl.models.tiny_corpus import tiny_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),  # tags are appended after training
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus() if corpus is None else list(corpus), trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    return tokenizer.to_str()


def build_tiny_tokenizer(
    vocab_size: int = 4096, corpus: Sequence[str] | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens, trained locally (cached per process).

    Ids 0-2 are `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos); the last six ids are the tool-call,
    tool-response and think tags. The vocabulary is smaller than `vocab_size` only when `corpus` runs out of
    merges (the built-in corpus supports up to ~9k). The same inputs always give an identical tokenizer.json.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    check_vocab_size(vocab_size)
    corpus_key = None if corpus is None else tuple(corpus)
    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size, corpus_key))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# ------------------------------------------------------------------------------------------------------------
# Model directory
# ------------------------------------------------------------------------------------------------------------
def check_tiny_model_args(
    *,
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
) -> None:
    """Raise one ValueError naming the first bad argument and its value."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {', '.join(TINY_ARCHS)}")
    check_vocab_size(vocab_size)
    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    if (hidden_size // num_heads) % 2:
        raise ValueError(
            f"hidden_size={hidden_size} / num_heads={num_heads} gives head dim {hidden_size // num_heads}, "
            "which must be even (rotary embeddings rotate pairs of channels)"
        )


_MOE_PREFIXES = ("num_experts", "moe_", "norm_topk", "shared_expert")


def _make_config(arch: str, tokenizer: PreTrainedTokenizerFast, **fields):
    """A transformers config of `arch` with ids from the tokenizer and head_dim set explicitly."""
    from transformers import AutoConfig

    extra = {"attention_bias": False, "mlp_bias": False} if arch == "llama" else {}
    if arch not in ("qwen3_moe", "qwen2_moe"):
        fields = {k: v for k, v in fields.items() if not k.startswith(_MOE_PREFIXES)}
    elif arch == "qwen3_moe":
        fields = {k: v for k, v in fields.items() if k != "shared_expert_intermediate_size"}
    pad_id = tokenizer.pad_token_id
    return AutoConfig.for_model(
        arch,
        head_dim=fields["hidden_size"]
        // fields["num_attention_heads"],  # Qwen3's default (128) is wrong here
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=pad_id,  # like Qwen: no BOS is prepended; <|endoftext|> separates documents
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        dtype="float32",
        **extra,
        **fields,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    vocab_size: int = 4096,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
) -> Path:
    """Write a complete HF model directory with random weights (seeded) to `out_dir`; returns its path.

    `tokenizer` defaults to `build_tiny_tokenizer(vocab_size)`; the embedding has `vocab_size` rows, which
    must be at least `len(tokenizer)` (extra rows are never produced by the tokenizer, like Qwen's padding).
    The MoE arguments apply to "qwen3_moe" (every layer routed, top-k renormalised, like Qwen3-30B-A3B) and
    "qwen2_moe" (plus a shared expert of `intermediate_size`); the dense architectures ignore them.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    check_tiny_model_args(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
    )
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size={vocab_size} (must be >=)")
    config = _make_config(
        arch,
        tokenizer,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=float(rope_theta),
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=arch == "qwen3_moe",
        shared_expert_intermediate_size=intermediate_size,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    _save_tokenizer(tokenizer, out, model_max_length=max_position_embeddings)
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    generation.save_pretrained(out)
    return out


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path, *, model_max_length: int) -> None:
    """Save with the checkpoint's context length recorded, leaving the caller's tokenizer unchanged."""
    previous = tokenizer.model_max_length
    tokenizer.model_max_length = model_max_length
    try:
        tokenizer.save_pretrained(out)
    finally:
        tokenizer.model_max_length = previous


def _save_quietly(model, out: Path) -> None:
    """save_pretrained without transformers' shard-writing progress bar (noise in CLI output and test logs)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
