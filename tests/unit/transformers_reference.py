"""The transformers side of the native-vs-transformers parity tests (test_models_parity.py, test_models_moe.py).

A transformers model built from a config with every parameter random, saved as a checkpoint the native
loader reads; a batch of sequences of different lengths, packed flat for the native model and right-padded
with an attention mask for transformers; logits of both, valid tokens packed flat so they compare row for row.
Not a test file: the test modules import it (`from transformers_reference import ...`).

    hf_model = random_hf_model(Qwen2Config(...))
    seqs, ids, positions = packed_batch(hf_model.config.vocab_size)
    assert (native_logits(load_model(path), ids, positions) - hf_packed_logits(hf_model, seqs)).abs().max() < 1e-5
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawrl.models.attention import VarlenAttention

LENGTHS = [5, 17, 1, 40, 9]
"""Sequence lengths of every test batch: a 1-token sequence and one longer than the others together."""


def random_hf_model(config, seed: int = 0):
    """transformers model with every parameter random: N(0, 0.1), norm weights 1 + N(0, 0.2)."""
    # "eager": plain-math attention, the reference the native kernels are held to
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


def checkpoint_fixture(configs: dict[str, Callable]):
    """A module-scoped fixture, parametrised over `configs` (name -> config builder), that yields
    (name, checkpoint dir, transformers model) with the model saved by `save_pretrained`."""

    @pytest.fixture(scope="module", params=list(configs))
    def checkpoint(request, tmp_path_factory):
        hf_model = random_hf_model(configs[request.param]())
        path = tmp_path_factory.mktemp(request.param)
        hf_model.save_pretrained(path)
        return request.param, path, hf_model

    return checkpoint


def packed_batch(vocab_size: int, seed: int = 1):
    """(sequences, flat ids [N], flat positions [N]) for LENGTHS."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return seqs, torch.cat(seqs), positions


def padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], attention mask [B, L]) of `seqs` right-padded to the longest of LENGTHS."""
    ids = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)], mask[i, : len(seq)] = seq, 1
    return ids, mask


def hf_packed_logits(hf_model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """transformers' logits for `seqs` (right-padded batch + attention mask), valid tokens packed flat [N, V]."""
    ids, mask = padded(seqs)
    logits = hf_model(input_ids=ids, attention_mask=mask).logits
    return torch.cat([logits[i, : len(seq)] for i, seq in enumerate(seqs)])


def native_logits(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The native model's logits [N, V] of the flat batch of LENGTHS."""
    return model.compute_logits(model(ids, positions, VarlenAttention.from_lengths(LENGTHS)))
