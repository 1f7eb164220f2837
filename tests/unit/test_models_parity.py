"""Native CausalLM vs transformers' own Qwen2/Qwen3/Llama on random-weight tiny checkpoints (fp32, CPU).

Each config is built with transformers' own config class, randomised (norm weights and biases too, so that
no parameter is left at a value that would hide a loading bug), saved with `save_pretrained`, loaded
natively, and run on sequences of different lengths packed flat. The reference is transformers' forward on
the same sequences as a right-padded batch with an attention mask ("eager" attention: plain math).

Error metric: max |native - reference| / max |reference| over all valid tokens and vocab entries. The
transformers side (random model, padded batch, packed logits) is transformers_reference.py beside this file.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers_reference import (
    LENGTHS,
    checkpoint_fixture,
    hf_packed_logits,
    native_logits,
    packed_batch,
    random_hf_model,
)

from clawrl.models.hf_io import load_model
from clawrl.models.loader import INDEX_FILE

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, max_position_embeddings=256)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # < the longest sequence, so all three frequency bands occur
}

CONFIGS = {
    "qwen2-tied-gqa": lambda: Qwen2Config(
        vocab_size=512, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **TINY
    ),
    "qwen2-untied-mha": lambda: Qwen2Config(
        vocab_size=1024, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, **TINY
    ),
    "qwen3-untied-gqa-wide-heads": lambda: Qwen3Config(
        vocab_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=32, **TINY
    ),
    "qwen3-tied-gqa-bias": lambda: Qwen3Config(
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_bias=True,
        **TINY,
    ),
    "llama3-rope-untied-mqa": lambda: LlamaConfig(
        vocab_size=2048, num_attention_heads=4, num_key_value_heads=1, rope_scaling=LLAMA3_ROPE, **TINY
    ),
    "llama-tied-gqa-bias": lambda: LlamaConfig(
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        **TINY,
    ),
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


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
    assert rel_err(unfused, expected) < 1e-5, name
    # The packed matmuls compute every output element the same way, so fusing changes no bit.
    assert torch.equal(fused, unfused), name


def test_unfused_state_dict_has_exactly_the_hf_names(checkpoint):
    _, path, hf_model = checkpoint
    native = load_model(path)
    assert set(native.state_dict()) == set(hf_model.state_dict())
    for key, value in hf_model.state_dict().items():
        assert torch.equal(native.state_dict()[key], value), key


def test_sharded_checkpoint_with_index_loads_with_same_logits(tmp_path):
    hf_model = random_hf_model(CONFIGS["qwen3-untied-gqa-wide-heads"]())
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / INDEX_FILE).is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    seqs, ids, positions = packed_batch(hf_model.config.vocab_size)
    with torch.no_grad():
        err = rel_err(
            native_logits(load_model(tmp_path, fused=True), ids, positions), hf_packed_logits(hf_model, seqs)
        )
    assert err < 1e-5


def test_gradients_match_transformers(tmp_path):
    """Next-token cross-entropy over the packed batch: every parameter's gradient (the tied embedding
    collects both its input and output gradient) matches transformers' on the padded batch."""
    hf_model = random_hf_model(CONFIGS["qwen2-tied-gqa"]())
    hf_model.save_pretrained(tmp_path)
    native = load_model(tmp_path)
    seqs, ids, positions = packed_batch(hf_model.config.vocab_size)
    targets = torch.cat([torch.roll(seq, -1) for seq in seqs])  # wrap-around target at each sequence end

    loss_native = torch.nn.functional.cross_entropy(native_logits(native, ids, positions), targets)
    loss_native.backward()
    loss_hf = torch.nn.functional.cross_entropy(hf_packed_logits(hf_model, seqs), targets)
    loss_hf.backward()

    assert abs(loss_native.item() - loss_hf.item()) <= 1e-5 * loss_hf.item()
    native_params = dict(native.named_parameters())
    hf_params = dict(hf_model.named_parameters())
    assert set(native_params) == set(hf_params)
    for name, hf_param in hf_params.items():
        assert hf_param.grad.abs().max() > 0, name
        assert rel_err(native_params[name].grad, hf_param.grad) < 1e-5, name
