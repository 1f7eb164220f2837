"""`--rm-type gsm8k`: numeric answer match for GSM8K-style problems.

Label: `"#### 42"`, a full GSM8K solution ending in `#### 42`, or a bare number (int, float or string).
Response answer, first that applies: the number on the last `#### x` line; the last number inside the last
`\\boxed{}`; the last number anywhere in the text. Numbers may carry `$`, thousands commas (`1,000`), a sign
(`-`, or the unicode minus) and decimals; they are compared exactly as rationals, so "3.50" == "3.5" and
"-3.0" == "-3". A label that is not a number scores 0.0 (GSM8K answers are numbers). End-of-turn special
tokens (`<|im_end|>`, ...) hold no digits, so a trailing one never changes the answer.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from clawrl.rollout.rewards.latex import last_boxed_content

# A minus counts only when it does not follow a word, digit or ")" ("3-4" is 3 and 4, not 3 and -4).
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-\s*)?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w)])-?\.\d+")
_HASH_LINE_RE = re.compile(r"####\s*([^\n]*)")


def parse_number(text: str) -> Fraction | None:
    """The value of a number token like "$1,000", "-3.50", "−2" or "7."; None if it is not one."""
    cleaned = re.sub(r"[\s$,]", "", text.replace("\u2212", "-")).rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> str | None:
    """The last number token in `text`, or None."""
    matches = _NUMBER_RE.findall(text.replace("\u2212", "-"))
    return matches[-1] if matches else None


def extract_response_answer(response: str) -> str | None:
    """The response's final answer as a number token (see the module docstring for the order)."""
    hash_lines = _HASH_LINE_RE.findall(response)
    if hash_lines:
        return last_number(hash_lines[-1])
    boxed = last_boxed_content(response)
    if boxed is not None:
        return last_number(boxed)
    return last_number(response)


def label_text(label: Any) -> str:
    """The reference answer: the text after the last `####`, else the whole label; "" for None."""
    if label is None:
        return ""
    text = str(label)
    return text.rpartition("####")[2].strip() if "####" in text else text.strip()


def gsm8k_score(response: str, label: Any) -> float:
    """1.0 if the response's final number equals the label's, else 0.0 (empty label -> 0.0)."""
    reference = label_text(label)
    answer = extract_response_answer(response)
    if not reference or answer is None:
        return 0.0
    reference_value = parse_number(reference)
    return 1.0 if reference_value is not None and parse_number(answer) == reference_value else 0.0


async def gsm8k_reward(sample, **kw) -> float:
    """Reward for `--rm-type gsm8k`: 1.0 if the response's final number equals `sample.label`, else 0.0."""
    return gsm8k_score(sample.response, sample.label)
