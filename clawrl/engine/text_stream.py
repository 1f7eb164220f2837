"""Incremental detokenization of one output sequence, for streaming.

Output tokens arrive a few at a time; their text is produced as deltas whose concatenation is the final
text. Two things are held back until they are certain:
- an incomplete UTF-8 character (a byte-level BPE token can carry half of one; decoding it gives U+FFFD);
- a suffix that could be the start of a stop string, because a matched stop string is trimmed from the
  text (unless no_stop_trim) and text already sent cannot be taken back.

Decoding uses a sliding window (tokens from `prefix_offset` on) so each step costs O(window), not
O(sequence): the text of window[prefix:read] is known, and whatever the full window decodes to beyond it is
new. The window restarts at every point where the text was complete. The last few prompt tokens seed the
window, so the first output token decodes as it does inside the full text (a leading space, for example);
the engine core's stop-string detector (detokenizer.py) seeds its window the same way, so both see the
same text.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context of the first output token.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalText:
    """Text deltas of one sequence; `push` returns the new text that is safe to send."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int] | None = None, *, skip_special_tokens: bool = True,
        stop: list[str] | None = None, no_stop_trim: bool = False,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.no_stop_trim = no_stop_trim
        # Window ids: prompt context, then output tokens.
        self._ids: list[int] = list((prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:])
        self.text = ""  # output text decoded so far (complete characters only, untrimmed)
        self.num_sent_chars = 0
        self.final_text: str | None = None
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int], finish_reason: dict | None = None) -> str:
        """Add new tokens; with finish_reason (the sequence ended) flush everything and trim the stop."""
        if self.final_text is not None:
            return ""
        if finish_reason is not None and self._drops_last_token(token_ids, finish_reason):
            # A matched stop token is not part of the text (SGLang trims it unless no_stop_trim).
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        if finish_reason is None:
            self._decode(final=False)
            return self._send_up_to(self._safe_end())
        self._decode(final=True)
        self.final_text = self.text[: self._trim_point(finish_reason)]
        return self._send_up_to(len(self.final_text))

    def _drops_last_token(self, token_ids: list[int], finish_reason: dict) -> bool:
        matched = finish_reason.get("matched")
        return (
            not self.no_stop_trim
            and finish_reason.get("type") == "stop"
            and isinstance(matched, int)
            and bool(token_ids)
            and token_ids[-1] == matched
        )

    def _decode(self, *, final: bool) -> None:
        if self._read_offset == len(self._ids):
            return
        known = self._detok(self._ids[self._prefix_offset : self._read_offset])
        window = self._detok(self._ids[self._prefix_offset :])
        if len(window) > len(known) and (final or not window.endswith(_REPLACEMENT_CHAR)):
            self.text += window[len(known) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        elif final:
            self._read_offset = len(self._ids)

    def _detok(self, token_ids: list[int]) -> str:
        if not token_ids or self.tokenizer is None:  # a model directory without tokenizer: ids only
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _safe_end(self) -> int:
        """End of the text that can be sent: before any complete stop string (the core finishes the
        sequence on it, but that news may come with a later step) and before a possible partial one."""
        end = len(self.text) - self._stop_prefix_len()
        if not self.no_stop_trim:
            for stop in self.stop:
                found = self.text.find(stop, max(0, self.num_sent_chars - len(stop) + 1))
                if found >= 0:
                    end = min(end, found)
        return end

    def _stop_prefix_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        if self.no_stop_trim or not self.stop:
            return 0
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _trim_point(self, finish_reason: dict) -> int:
        matched = finish_reason.get("matched")
        if self.no_stop_trim or finish_reason.get("type") != "stop" or not isinstance(matched, str):
            return len(self.text)
        # The core stops at the first occurrence; text from the stop string on is dropped.
        found = self.text.find(matched, 0)
        return len(self.text) if found < 0 else found

    def _send_up_to(self, end: int) -> str:
        if end <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta
