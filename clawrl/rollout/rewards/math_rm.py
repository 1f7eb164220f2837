"""`--rm-type math`: the last `\\boxed{}` of the response against the label, by normalised match or equivalence.

Grading, in order (a rule that decides stops the chain). Trailing end-of-turn special tokens (`<|im_end|>`,
`</s>`, ...) are stripped from the response before its last box is found.
1. Both answers are normalised (`normalise_answer`): `\\dfrac`/`\\tfrac`/`\\cfrac` -> `\\frac`, `\\frac12` ->
   `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`, `a/b` -> `\\frac{a}{b}`; `\\left`/`\\right`, set braces `\\{ \\}`,
   spacing (`\\!`, `\\,`, `\\;`, `~`), degrees (`^\\circ`), `$`, `\\%`, trailing periods, `{,}` and thousands
   commas (`1,000`), a leading `x =`, `\\text{}`/`\\mbox{}`/`\\mathrm{}` wrappers (a unit on its own inside one
   is dropped, and so is a trailing `\\text{ word}` that starts with a space: `10\\text{ apples}` -> `10`) and
   unit words ("cm", "degrees", ...) are removed; " and " / " or " between answers become commas; a mixed
   number `7 3/4` becomes `7\\frac{3}{4}` (= 31/4); `.5` -> `0.5`; unicode minus -> `-`; all whitespace goes;
   letters are lower-cased (LaTeX command names excepted), so `\\text{Monday}` == `monday`.
2. Equal strings -> correct. Tuples and intervals (`(1,2]`) are compared element by element with the same
   brackets; each element goes through the rules below.
3. Integers: if either side is an integer literal ("3", "-3.0"), the other must be a number literal of the same
   value (so "3" does not accept `\\frac{6}{2}` or `\\sqrt{9}`: the final answer must be simplified).
4. Two plain fractions compare by numerator and denominator (sign moved up), so `\\frac{2}{4}` != `\\frac{1}{2}`.
5. Exact rational comparison of decimal, fraction and mixed-number literals: `0.5` == `\\frac{1}{2}` == `1/2`;
   `3.50` == `3.5`; `7\\frac{3}{4}` == `\\frac{31}{4}` == `7.75`.
6. Otherwise sympy decides (`simplify(a - b) == 0`) in a worker process with a deadline (`sympy_judge`):
   inputs over 200 characters, outside a small safe grammar or with more than two distinct variables
   (text answers: "listen" vs "silent") are refused (-> not equal), and a comparison
   that runs past `sympy_timeout_s` (default 5 s) is killed and counts as not equal. Rules 1-5 never call
   sympy, so plain numeric answers cost microseconds.
"""

from __future__ import annotations

import asyncio
import re
from fractions import Fraction
from typing import Any

from clawrl.rollout.rewards.latex import (
    drop_trailing_text_unit,
    fix_shorthand,
    last_boxed_content,
    remove_units,
    unwrap_text_commands,
)
from clawrl.rollout.rewards.special_tokens import strip_end_tokens
from clawrl.rollout.rewards.sympy_judge import DEFAULT_TIMEOUT_S, sympy_equal

_DECIMAL_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION_RE = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_VARIABLE_PREFIX_RE = re.compile(r"^\s*[a-zA-Z](?:_\{?\w+\}?)?\s*=(?!=)")
# "2 and 3", "2 \\text{ or } 3" list several answers: both read as "2, 3".
_CONJUNCTION_RE = re.compile(r"\s+(?:and|or)\s+")
# A mixed number written in plain text, "7 3/4" (read as 7 + 3/4, not 73/4).
_MIXED_PLAIN_RE = re.compile(r"^(-?\d+)\s+(\d+)/(\d+)$")
_MIXED_RE = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_UPPER_OUTSIDE_COMMANDS_RE = re.compile(r"(\\[a-zA-Z]+)|[A-Z]+")


def normalise_answer(answer: Any) -> str:
    """Canonical string form of one answer (see the module docstring for the rules)."""
    text = str(answer).strip().replace("\u2212", "-").replace("\n", " ")
    text = text.replace("\\displaystyle", "")
    text = re.sub(r"\\[dtc]frac", r"\\frac", text)
    text = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", text)
    text = re.sub(r"\\[{}]|\\[lr]brace(?![a-zA-Z])", "", text)  # set braces: {1, 2} lists its elements
    text = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\u00b0", "", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = unwrap_text_commands(drop_trailing_text_unit(text))
    text = re.sub(r"\\[,;:! ]|\\q?quad(?![a-zA-Z])|~", " ", text)
    text = _CONJUNCTION_RE.sub(",", remove_units(text).replace("{,}", ""))
    if text.count("=") == 1 and _VARIABLE_PREFIX_RE.match(text):
        text = text.split("=", 1)[1]
    text = _MIXED_PLAIN_RE.sub(r"\1\\frac{\2}{\3}", text.strip())
    # Text answers are not case sensitive ("Monday" == "monday"); LaTeX command names are (done before the
    # spaces go, while `\Delta ABC` still shows where the command name ends).
    text = _UPPER_OUTSIDE_COMMANDS_RE.sub(lambda m: m.group(1) or m.group(0).lower(), fix_shorthand(text))
    text = re.sub(r"\s+", "", text).rstrip(".")
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    text = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", text)
    return re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", text)


# Longer literals are left to the string comparison: int() refuses > 4300 digits, and no real answer has them.
_MAX_LITERAL_CHARS = 1000


def _decimal(text: str) -> Fraction | None:
    if len(text) > _MAX_LITERAL_CHARS or not _DECIMAL_RE.fullmatch(text):
        return None
    return Fraction(text)


def _fraction_parts(text: str) -> tuple[int, int] | None:
    match = _FRACTION_RE.fullmatch(text) if len(text) <= _MAX_LITERAL_CHARS else None
    if match is None or int(match.group(3)) == 0:
        return None
    sign = -1 if match.group(1) else 1
    numerator, denominator = sign * int(match.group(2)), int(match.group(3))
    return (numerator, denominator) if denominator > 0 else (-numerator, -denominator)


def _is_integer(value: Fraction | None) -> bool:
    return value is not None and value.denominator == 1


def _literal_value(text: str, decimal: Fraction | None, fraction: tuple[int, int] | None) -> Fraction | None:
    """The exact value of a decimal, plain fraction or mixed number (`7\\frac{3}{4}` = 31/4); else None."""
    if fraction is not None:
        return Fraction(*fraction)
    if decimal is not None:
        return decimal
    match = _MIXED_RE.fullmatch(text) if len(text) <= _MAX_LITERAL_CHARS else None
    if match is None or int(match.group(4)) == 0:
        return None
    value = int(match.group(2)) + Fraction(int(match.group(3)), int(match.group(4)))
    return -value if match.group(1) else value


def elements_equal(pred: str, label: str, sympy_timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Rules 2-6 for one normalised element."""
    if pred == label:
        return True
    pred_decimal, label_decimal = _decimal(pred), _decimal(label)
    if _is_integer(pred_decimal) or _is_integer(label_decimal):
        return pred_decimal is not None and pred_decimal == label_decimal
    pred_fraction, label_fraction = _fraction_parts(pred), _fraction_parts(label)
    if pred_fraction and label_fraction:
        return pred_fraction == label_fraction
    pred_value = _literal_value(pred, pred_decimal, pred_fraction)
    label_value = _literal_value(label, label_decimal, label_fraction)
    if pred_value is not None and label_value is not None:
        return pred_value == label_value
    return sympy_equal(pred, label, sympy_timeout_s)


def _split_top_level(text: str) -> tuple[str, list[str]] | None:
    """`(1,2]` -> ("(]", ["1", "2"]); `1,2` -> ("", ...); None when there is no top-level comma."""
    brackets = ""
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]":
        brackets, text = text[0] + text[-1], text[1:-1]
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if not parts or depth != 0:
        return None
    return brackets, parts + [text[start:]]


def answers_equal(pred: Any, label: Any, sympy_timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether a predicted answer matches the label (both raw strings; see the module docstring)."""
    pred_norm, label_norm = normalise_answer(pred), normalise_answer(label)
    if not pred_norm or not label_norm:
        return False
    if pred_norm == label_norm:
        return True
    pred_parts, label_parts = _split_top_level(pred_norm), _split_top_level(label_norm)
    if pred_parts is None and label_parts is None:
        return elements_equal(pred_norm, label_norm, sympy_timeout_s)
    if pred_parts is None or label_parts is None:
        return False
    if pred_parts[0] != label_parts[0] or len(pred_parts[1]) != len(label_parts[1]):
        return False
    return all(
        elements_equal(p, q, sympy_timeout_s) for p, q in zip(pred_parts[1], label_parts[1], strict=True)
    )


def label_answer(label: Any) -> str:
    """The reference answer as text: the content of its last box if it is boxed; "" for None."""
    if label is None:
        return ""
    text = str(label)
    boxed = last_boxed_content(text)
    return (boxed if boxed is not None else text).strip()


def grade_boxed(text: str, label: Any, sympy_timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the last box in `text` matches the label, else 0.0 (no box or empty label -> 0.0)."""
    reference = label_answer(label)
    pred = last_boxed_content(strip_end_tokens(text))
    if not reference or pred is None:
        return 0.0
    return 1.0 if answers_equal(pred, reference, sympy_timeout_s) else 0.0


async def math_reward(sample, *, sympy_timeout_s: float = DEFAULT_TIMEOUT_S, **kw) -> float:
    """Reward for `--rm-type math`: 1.0 if the response's last `\\boxed{}` matches `sample.label`, else 0.0."""
    # A worker thread keeps the event loop free while sympy (rarely) works.
    return await asyncio.to_thread(grade_boxed, sample.response, sample.label, sympy_timeout_s)
