"""`--rm-type dapo`: DAPO's strict answer check with Minerva-style normalisation; returns a dict.

Only the last 300 characters of the response are read. The prediction is the last `Answer: ...` (case
insensitive, to the end of its line), else "[INVALID]"; end-of-turn special tokens of chat templates
(`<|im_end|>`, `</s>`, ...; see `special_tokens`) are removed from it. Prediction and label are normalised
(`minerva_normalise`: keep what follows the last `=`; drop filler words and units; keep the inside of `$..$`,
`\\text{}`, `\\textbf{}`, `\\overline{}` and `\\boxed{}`; `\\fracab` -> `\\frac{a}{b}`, `\\sqrta` -> `\\sqrt{a}`;
no `$` or spaces; `1,000` -> `1000`); an integral numeric label is written as an integer ("42.0" -> "42").
They must then be equal strings. The result is `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`;
train on it with `--reward-key score`.

`strict_box=True` (a keyword of `dapo_reward`) is DAPO's other mode: the last `\\boxed{}` in the last 100
characters must equal the label.
"""

from __future__ import annotations

import re
from typing import Any

from clawrl.rollout.rewards.latex import last_boxed_content, unwrap_command
from clawrl.rollout.rewards.special_tokens import remove_end_tokens

_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_TAIL_CHARS = 300
_STRICT_BOX_TAIL_CHARS = 100
INVALID = "[INVALID]"

# Applied in order as plain substring replacements, as Minerva's normaliser does.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
    "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
    "\\dots",
)  # fmt: skip


def minerva_normalise(answer: str) -> str:
    """Normalise a final answer the way Minerva / DAPO do (see the module docstring)."""
    text = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expression in _REMOVED:
        text = text.replace(expression, "")
    dollars = re.search(r"\$(.*?)\$", text)
    if dollars:
        text = dollars.group(1)
    for command in ("\\text", "\\textbf", "\\overline", "\\boxed"):
        text = unwrap_command(text, command)
    text = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", text)
    text = re.sub(r"sqrt([^{])", r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _label_text(label: Any) -> str:
    text = minerva_normalise(str(label))
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else text


def dapo_score(response: str, label: Any, strict_box: bool = False) -> dict[str, Any]:
    """`{"score": 1.0 | -1.0, "acc": bool, "pred": str}` for one response."""
    if label is None or not str(label).strip():
        return {"score": -1.0, "acc": False, "pred": INVALID}
    if strict_box:
        boxed = last_boxed_content(response[-_STRICT_BOX_TAIL_CHARS:])
        pred = boxed.strip() if boxed is not None else ""
        correct = pred == str(label).strip()
    else:
        matches = _ANSWER_RE.findall(response[-_TAIL_CHARS:])
        pred = minerva_normalise(remove_end_tokens(matches[-1])) if matches else INVALID
        correct = pred == _label_text(label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


async def dapo_reward(sample, *, strict_box: bool = False, **kw) -> dict[str, Any]:
    """Reward for `--rm-type dapo`: a dict; select the training value with `--reward-key score`."""
    return dapo_score(sample.response, sample.label, strict_box)
