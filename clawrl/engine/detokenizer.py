"""Incremental detokenization of a sequence's output, to detect stop strings as tokens arrive.

Decoding token by token does not work for byte-level BPE (a character can span tokens, and a token's
leading space depends on what precedes it). So the text is grown by decoding a short window: the text of
ids[prefix:] minus the text of ids[prefix:read] is what the newest tokens add, unless it ends in U+FFFD
(an incomplete UTF-8 sequence), in which case we wait for more tokens. A few prompt tokens seed the window
so the first output token decodes as it would inside the full text.
"""

from __future__ import annotations

# Prompt tokens kept as left context of the first output token (same idea as SGLang's initial offset).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Accumulates a sequence's output text and reports the first stop string it contains."""

    def __init__(
        self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool, stop: list[str]
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""

    def append(self, token_id: int) -> str | None:
        """Add one output token; returns the stop string now present in the output text, if any."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        added = after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.output_text += added
        return self._find_stop(len(added))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, num_added: int) -> str | None:
        # Only matches that end inside the new text are new; earlier ones were checked before.
        start = max(0, len(self.output_text) - num_added - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.output_text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return None if best is None else best[1]
