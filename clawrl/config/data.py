"""Prompt dataset flags: file, column names, chat template, shuffling, prompt-length filter, epochs."""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import at_least, non_empty
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class DataConfig:
    """Prompt dataset."""

    prompt_data: str | None = option(metavar="PATH")
    """Prompt dataset: a .jsonl or .parquet file, optionally a row slice PATH@[start:end]."""
    input_key: str = "input"
    """Dataset column with the prompt: a string or a list of chat messages."""
    label_key: str | None = None
    """Dataset column with the label given to the reward function (unset: no label)."""
    metadata_key: str = "metadata"
    """Dataset column with a per-prompt metadata dict, copied into sample.metadata."""
    tool_key: str = "tools"
    """Dataset column with tool specs (a list or a JSON string) passed to the chat template."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (a string prompt becomes one user message)."""
    rollout_shuffle: bool = False
    """Shuffle the prompts at every epoch, seeded by --rollout-seed + epoch."""
    rollout_max_prompt_len: int | None = None
    """Drop prompts longer than N tokens when the dataset is loaded."""
    num_epoch: int | None = None
    """Passes over --prompt-data (num_rollout = N x dataset size // --rollout-batch-size); --num-rollout wins."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("input_key", "metadata_key", "tool_key", "label_key", "prompt_data"):
            non_empty(self, name)
        at_least(self, "rollout_max_prompt_len", 1)
        at_least(self, "num_epoch", 1)
