"""Checks of user input against what the engine can serve (requests, checkpoints, context length).

Each failure is one ValueError naming the field or file and the bad value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clawrl.engine.block_manager import BlockManager
from clawrl.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from clawrl.engine.config import EngineConfig
    from clawrl.models.config import ModelArgs


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    context_length: int,
    block_manager: BlockManager,
    has_tokenizer: bool,
) -> None:
    """Raise ValueError naming the field and value that the engine cannot serve."""
    params.validate()
    prompt = prompt_token_ids
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {prompt!r}")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids must be ints in [0, {vocab_size}), got {bad[0]!r}")
    if len(prompt) >= context_length:
        raise ValueError(
            f"prompt of {len(prompt)} tokens does not fit context_length={context_length} "
            "(at least one token must be generated)"
        )
    if params.stop and not has_tokenizer:
        raise ValueError(f"sampling_params.stop={params.stop!r} needs a tokenizer in the model directory")
    # A sequence alone must fit the cache, or it would preempt itself forever.
    longest = min(len(prompt) + params.max_new_tokens, context_length)
    capacity = block_manager.num_blocks * block_manager.block_size
    if block_manager.blocks_for_tokens(longest) > block_manager.num_blocks:
        raise ValueError(
            f"sampling_params.max_new_tokens={params.max_new_tokens} with a {len(prompt)}-token prompt needs "
            f"{longest} KV-cache slots, but the cache holds {capacity} (num_kv_blocks x block_size)"
        )


_SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "qkv_bias", "qk_norm")  # fmt: skip


def check_same_shapes(serving: ModelArgs, incoming: ModelArgs, model_path: str) -> None:
    """Refuse a checkpoint of another architecture before any running sequence is disturbed."""
    for name in _SHAPE_FIELDS:
        if getattr(serving, name) != getattr(incoming, name):
            raise ValueError(
                f"{model_path}/config.json: {name}={getattr(incoming, name)!r}, but the served model has "
                f"{name}={getattr(serving, name)!r}"
            )


def context_length_of(config: EngineConfig, max_positions: int) -> int:
    """The engine's context length: EngineConfig.context_length, at most the model's positions."""
    if config.context_length is not None and config.context_length > max_positions:
        raise ValueError(
            f"EngineConfig.context_length={config.context_length} exceeds max_position_embeddings={max_positions} "
            f"of {config.model_path}/config.json"
        )
    return config.context_length or max_positions
