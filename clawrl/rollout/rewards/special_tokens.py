"""End-of-turn special tokens that chat templates leave at the end of a decoded response.

When an engine decodes without skipping special tokens, a response ends in the template's end-of-turn marker
(`Answer: 42<|im_end|>`). The marker is not part of the answer, so every built-in grader strips it before it
extracts anything:
    strip_end_tokens("Answer: 42<|im_end|>\\n")   # -> "Answer: 42"
"""

from __future__ import annotations

END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML: Qwen, Yi, many fine-tunes
    "<|endoftext|>",  # GPT-2 / Qwen base models
    "</s>",  # Llama 2, Mistral
    "<|eot_id|>",  # Llama 3 end of turn
    "<|eom_id|>",  # Llama 3 end of message (tool call)
    "<|end_of_text|>",  # Llama 3 end of text
    "<end_of_turn>",  # Gemma
    "<eos>",  # Gemma end of sequence
    "<|end|>",  # Phi-3
    "<|return|>",  # gpt-oss (harmony) final message
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek (full-width bars, lower-one-eighth-block spaces)
)
"""Markers removed from the end of a response (repeatedly, with the whitespace between them)."""


def strip_end_tokens(text: str) -> str:
    """`text` without its trailing end-of-turn markers (and the whitespace around them); unchanged if none."""
    stripped = text.rstrip()
    found = True
    while found:
        found = False
        for token in END_OF_TURN_TOKENS:
            if stripped.endswith(token):
                stripped, found = stripped[: -len(token)].rstrip(), True
    # Without a marker the text stays exactly as it was (trailing whitespace included).
    return stripped if len(stripped) < len(text.rstrip()) else text


def remove_end_tokens(text: str) -> str:
    """`text` with every end-of-turn marker removed, wherever it stands."""
    for token in END_OF_TURN_TOKENS:
        text = text.replace(token, "")
    return text
