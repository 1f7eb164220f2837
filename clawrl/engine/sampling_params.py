"""Per-request sampling parameters (SGLang's `sampling_params` vocabulary) and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request; field names and meanings follow SGLang's `/generate`."""

    max_new_tokens: int = 128
    """Most tokens to generate (>= 0; 0 finishes at once with finish reason "length")."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep only the top_k most likely tokens; -1 or 0 turns it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the decoded output text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the sequence (ignored, like EOS, when ignore_eos is set; SGLang's rule)."""
    ignore_eos: bool = False
    """Keep generating past EOS and stop_token_ids (stop strings and max_new_tokens still apply)."""
    n: int = 1
    """Samples per request; they share the prompt's KV blocks."""
    seed: int | None = None
    """Sampling seed: same seed + prompt + params -> same tokens, whatever else is in the batch."""
    skip_special_tokens: bool = True
    """Drop special tokens when decoding text (text layer and stop-string matching)."""
    no_stop_trim: bool = False
    """Keep the matched stop string / stop token in the output text (text layer)."""

    def __post_init__(self) -> None:
        # A single string is a common slip (`stop="\n"`); accept it as one stop string.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its value."""
        _check_int("max_new_tokens", self.max_new_tokens, lambda v: v >= 0, "be an int >= 0")
        _check_float("temperature", self.temperature, lambda v: v >= 0.0, "be a number >= 0")
        _check_float("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "be in (0, 1]")
        _check_int("top_k", self.top_k, lambda v: v >= -1, "be -1, 0 or an int >= 1")
        _check_float("min_p", self.min_p, lambda v: 0.0 <= v < 1.0, "be in [0, 1)")
        _check_int("n", self.n, lambda v: v >= 1, "be an int >= 1")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: True, "be an int or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"sampling_params.stop must be a list of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"sampling_params.stop_token_ids must be a list of ints >= 0, got {ids!r}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name} must be a bool, got {getattr(self, name)!r}")


def _is_int(value: object) -> bool:
    # bool is an int subclass; `max_new_tokens=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, ok, must: str) -> None:
    if not _is_int(value) or not ok(value):
        raise ValueError(f"sampling_params.{name} must {must}, got {value!r}")


def _check_float(name: str, value: object, ok, must: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{name} must {must}, got {value!r}")
    if not ok(value):
        raise ValueError(f"sampling_params.{name} must {must}, got {value!r}")
