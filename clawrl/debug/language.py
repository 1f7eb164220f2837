"""Does a rollout look like language? Cheap task-independent heuristics on decoded response texts.

    from clawrl.debug.language import TextThresholds, text_metrics, text_verdict
    metrics = text_metrics(["The answer is 4.", ""])  # {"empty_ratio": 0.5, "bad_char_ratio": 0.0, ...}
    reasons = text_verdict(metrics, TextThresholds())  # [] when the rollout looks like language

The first question when a run misbehaves is whether the engine produces text at all. A wrong chat template,
weights that were never loaded or synced, a tokenizer that does not belong to the model, or a collapsed
policy each show up as one of three symptoms that need no knowledge of the task:

  empty_ratio     share of responses that are empty or whitespace only
  bad_char_ratio  share of characters, pooled over the non-empty responses, that are U+FFFD (token bytes
                  that did not decode as UTF-8) or unprintable: control, surrogate, private-use or
                  unassigned code points (newline, carriage return and tab are text)
  repetition      mean over the non-empty responses of `response_repetition`: the larger of the share of
                  repeated word 4-grams and the share of the text taken by a periodic tail (one token or a
                  short phrase repeated until the length limit, with or without spaces)

All functions are pure; the thresholds' defaults are the `--ci-text-*` flags' defaults. A random tiny test
model (vocab 2048) scores about 0.02 bad characters (its byte tokens), 0 empty and 0 repetition.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import filterfalse

NGRAM = 4
"""Word n-gram length for repetition: long enough that ordinary prose and arithmetic rarely repeat one."""
MAX_PERIOD = 16
"""Longest repeated unit (characters) the periodic-tail test looks for: one BPE token or a short phrase."""
MIN_TAIL_REPEATS = 3
"""A periodic tail counts only when it holds at least this many copies of its unit..."""
MIN_TAIL_CHARS = 16
"""...and at least this many characters (a '...' or '1000' is not a loop)."""
_UNITS = re.compile(r"\w+|[^\w\s]")
_TEXT_CONTROLS = frozenset("\n\r\t")
_BAD_CATEGORIES = frozenset({"Cc", "Cs", "Co", "Cn"})


@dataclass(kw_only=True)
class TextThresholds:
    """Largest values of the text metrics that still look like language."""

    max_empty_ratio: float = 0.5
    """Share of empty responses (--ci-text-max-empty-ratio)."""
    max_bad_char_ratio: float = 0.05
    """Share of replacement / unprintable characters (--ci-text-max-bad-char-ratio)."""
    max_repetition: float = 0.5
    """Mean repetition of the responses (--ci-text-max-repetition)."""


def is_bad_char(char: str) -> bool:
    """U+FFFD or an unprintable code point; newline, carriage return and tab are ordinary text."""
    if char == "\ufffd":
        return True
    return char not in _TEXT_CONTROLS and unicodedata.category(char) in _BAD_CATEGORIES


def count_bad_chars(text: str) -> int:
    """How many characters of `text` are `is_bad_char`. str.isprintable sorts them at C speed: U+FFFD is
    printable (counted by str.count), every other bad character is not, so only the unprintable ones (a
    handful in most text) are looked up one by one."""
    return text.count("\ufffd") + sum(1 for char in filterfalse(str.isprintable, text) if is_bad_char(char))


def ngram_repetition(text: str, n: int = NGRAM) -> float:
    """1 - distinct / total word n-grams (words = runs of letters and digits, or one punctuation mark).

    "a b a b a b" has 3-grams (a b a), (b a b), (a b a), (b a b): 1 - 2/4 = 0.5. Fewer than two n-grams: 0.
    """
    units = _UNITS.findall(text)
    total = len(units) - n + 1
    if total < 2:
        return 0.0
    windows = zip(*(units[i:] for i in range(n)), strict=False)  # the shorter tails end it
    return 1.0 - len(set(windows)) / total


def periodic_tail_ratio(text: str) -> float:
    """Share of `text` taken by its longest tail that repeats a unit of 1..MAX_PERIOD characters.

    "xyz" + "ab" * 10 -> the tail "ab" * 10 (20 of 23 characters) -> 20/23. Tails with fewer than
    MIN_TAIL_REPEATS copies or MIN_TAIL_CHARS characters count as 0.
    """
    n = len(text)
    best = 0
    for period in range(1, min(MAX_PERIOD, n // MIN_TAIL_REPEATS) + 1):
        # Walk back while each character equals the one a period later; ordinary text stops at once.
        start = n - period
        while start > 0 and text[start - 1] == text[start - 1 + period]:
            start -= 1
        tail = n - start
        if tail >= max(MIN_TAIL_CHARS, MIN_TAIL_REPEATS * period):
            best = max(best, tail)
    return best / n if n else 0.0


def response_repetition(text: str) -> float:
    """How much of one response is a loop: max(ngram_repetition, periodic_tail_ratio), in [0, 1]."""
    return max(ngram_repetition(text), periodic_tail_ratio(text))


def text_metrics(texts: Sequence[str]) -> dict[str, float]:
    """{"empty_ratio", "bad_char_ratio", "repetition"} of one rollout's response texts (see above)."""
    if not texts:
        return {"empty_ratio": 0.0, "bad_char_ratio": 0.0, "repetition": 0.0}
    non_empty = [t for t in texts if t.strip()]
    num_chars = sum(len(t) for t in non_empty)
    num_bad = sum(count_bad_chars(t) for t in non_empty)
    repetition = sum(response_repetition(t) for t in non_empty) / len(non_empty) if non_empty else 0.0
    return {
        "empty_ratio": 1.0 - len(non_empty) / len(texts),
        "bad_char_ratio": num_bad / num_chars if num_chars else 0.0,
        "repetition": repetition,
    }


def text_verdict(metrics: Mapping[str, float], thresholds: TextThresholds) -> list[str]:
    """Why a rollout does not look like language, one reason per metric over its threshold ([] = fine)."""
    limits = (
        ("empty_ratio", "empty responses", thresholds.max_empty_ratio, "--ci-text-max-empty-ratio"),
        ("bad_char_ratio", "replacement/unprintable characters", thresholds.max_bad_char_ratio,
         "--ci-text-max-bad-char-ratio"),
        ("repetition", "repetition", thresholds.max_repetition, "--ci-text-max-repetition"),
    )  # fmt: skip
    return [
        f"{label} {metrics[key]:.3g} > {limit:g} ({flag})"
        for key, label, limit, flag in limits
        if key in metrics and not metrics[key] <= limit
    ]
