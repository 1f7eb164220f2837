"""LaTeX helpers shared by the answer-checking rewards: boxed-answer extraction and brace-aware rewrites.

Everything here is plain string work (no sympy), so it is cheap and cannot hang.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Commands whose argument is shown as the answer box; `\fbox` is what some models emit instead of `\boxed`.
_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Unit and filler words dropped from answers ("5 cm" -> "5", "30 degrees" -> "30"); matched as whole words,
# optionally squared/cubed ("cm^2"). One- and two-letter units that double as variable names (m, g, s, in) are
# only dropped when they stand alone inside `\text{...}`, see `TEXT_ONLY_UNITS`.
UNIT_WORDS = (
    "square", "cubic", "units", "unit", "cm", "mm", "km", "meters", "meter", "metres", "inches", "inch",
    "feet", "foot", "ft", "yards", "miles", "mph", "kg", "gm", "grams", "pounds", "lbs", "degrees", "degree",
    "radians", "seconds", "minutes", "hours", "hour", "days", "weeks", "years", "dollars", "dollar", "cents",
    "cent", "points", "ways", "people", "students", "integers", "digits", "edges", "sides", "centimeters",
    "centimeter", "millimeters", "kilometers", "mile", "yard", "second", "minute", "day", "week",
    "weeks", "months", "month", "year", "liters", "liter",
)  # fmt: skip
TEXT_ONLY_UNITS = ("m", "g", "s", "h", "in", "min", "sec", "deg", "sq", "ml", "l")
_UNIT_RE = re.compile(r"(?<![\\a-zA-Z])(?:" + "|".join(UNIT_WORDS) + r")(?![a-zA-Z])(?:\^\{?[23]\}?)?")


def find_closing_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` matching the `{` at `open_index` (nesting respected); None if unbalanced."""
    assert text[open_index] == "{"
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (also `\\boxed 5`); None if there is none."""
    starts = [(text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS]
    start, cmd = max(starts)
    if start < 0:
        return None
    rest_index = start + len(cmd)
    if text.startswith(" ", rest_index):
        # `\boxed 5` form: the argument runs to the next `$` or end of text.
        return text[rest_index + 1 :].split("$")[0].strip()
    brace = rest_index
    if brace >= len(text) or text[brace] != "{":
        return None
    close = find_closing_brace(text, brace)
    return None if close is None else text[brace + 1 : close]


def unwrap_command(text: str, command: str, replace: Callable[[str], str] = lambda arg: arg) -> str:
    """Replace every `\\command{arg}` by `replace(arg)` (default: `arg`); nested braces are respected."""
    out = []
    pos = 0
    pattern = re.compile(re.escape(command) + r"(?![a-zA-Z])\s*\{")
    while True:
        match = pattern.search(text, pos)
        if match is None:
            break
        close = find_closing_brace(text, match.end() - 1)
        if close is None:
            break
        out.append(text[pos : match.start()])
        out.append(replace(text[match.end() : close]))
        pos = close + 1
    out.append(text[pos:])
    return "".join(out)


_TEXT_COMMANDS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox")
_ALL_UNITS = frozenset(UNIT_WORDS + TEXT_ONLY_UNITS)


def _text_argument(arg: str) -> str:
    """`\\text{ cm}` -> "" (a unit on its own), `\\text{Monday}` -> "Monday"."""
    word = re.sub(r"\^\{?[23]\}?$", "", arg.strip())
    return "" if word in _ALL_UNITS else arg


# `\text{ m}^2` -> `\text{ m^2}`, so that a squared unit is recognised as a unit as a whole.
_POWER_AFTER_TEXT_RE = re.compile(r"(\\(?:text|mbox|mathrm|textrm)\s*\{[^{}]*)\}\s*\^\s*\{?([23])\}?")


def unwrap_text_commands(text: str) -> str:
    """Replace `\\text{..}`, `\\mbox{..}`, `\\mathrm{..}`, ... by their content; a bare unit becomes ""."""
    text = _POWER_AFTER_TEXT_RE.sub(r"\1^\2}", text)
    for command in _TEXT_COMMANDS:
        text = unwrap_command(text, command, _text_argument)
    return text


# `10\text{ apples}`: a `\text{...}` that starts with a space and ends the answer names its unit (the
# convention of the MATH dataset), whatever the word.
_TRAILING_TEXT_UNIT_RE = re.compile(
    r"^(.*?\S)\s*\\(?:text|mbox|textrm)\s*\{ +[A-Za-z][A-Za-z .]*\}(?:\s*\^\s*\{?[23]\}?)?\s*\.?\s*$"
)


def drop_trailing_text_unit(text: str) -> str:
    """`10\\text{ apples}` -> `10`; text without such a unit is returned unchanged."""
    match = _TRAILING_TEXT_UNIT_RE.match(text)
    return text if match is None else match.group(1)


def remove_units(text: str) -> str:
    """Drop unit words ("5 cm^2" -> "5 "); keeps the text unchanged if nothing but units would be left."""
    stripped = _UNIT_RE.sub("", text)
    return stripped if stripped.strip() else text


def fix_shorthand(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{x}` -> `\\frac{1}{x}`, `\\sqrt2` -> `\\sqrt{2}`."""
    text = re.sub(r"\\sqrt\s*([^\s{\[\\])", r"\\sqrt{\1}", text)
    text = re.sub(r"\\frac\s*([^\s{\\])\s*([^\s{\\])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\s*([^\s{\\])\s*\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac\s*(\{[^{}]*\})\s*([^\s{\\])", r"\\frac\1{\2}", text)
