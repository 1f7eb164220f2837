"""`--rm-type math_verify`: the response's last `\\boxed{}` against the label, judged by the math-verify package.

Needs the optional package: `pip install 'clawrl[math]'` (math-verify). Scoring, as slime's `math_verify`
reward: 1.0 or 0.0.
1. An empty label scores 0; a response without `\\boxed{...}` scores 0 (the last box counts, braces balanced;
   trailing end-of-turn tokens such as `<|im_end|>` are stripped first).
2. The box content and the label (stripped) are each parsed by math-verify. An answer made of letters only
   (`A`, `B`, a multiple-choice letter) is parsed as a string answer; anything else as math. Where slime tries
   the raw text first and the `$...$`-wrapped text second, this tries `$...$` first: math-verify reads a bare
   `1+x` as just `1` (its first number), and inside `$...$` as the expression `x + 1`.
3. If both parse, math-verify's `verify(gold, prediction)` decides (so `0.5` == `\\frac{1}{2}` == `1/2`,
   `x+1` == `1+x`, `(1,2]` != `[1,2]`).
4. Otherwise, or if math-verify raises, the two texts are compared after lower-casing and collapsing
   whitespace (so `Monday` == `monday`).

math-verify's own timeouts use SIGALRM, which only works on a process's main thread; rewards run in worker
threads, so they are off and the whole judgement instead has a deadline here (`timeout_s`, default 10 s):
past it the sample scores 0 and a warning names the answers (the worker thread finishes in the background).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from clawrl.rollout.rewards.latex import last_boxed_content
from clawrl.rollout.rewards.special_tokens import strip_end_tokens

logger = logging.getLogger(__name__)

INSTALL_HINT = "--rm-type math_verify needs the math-verify package: pip install 'clawrl[math]'"
DEFAULT_TIMEOUT_S = 10.0
"""Wall-clock limit of one judgement (parse both answers, verify)."""
_LETTERS_RE = re.compile(r"[A-Za-z]+")


def require_math_verify() -> Any:
    """The math_verify module; ImportError with the install line if it is missing."""
    try:
        import math_verify
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    # Each parse/verify with its timeout off logs a warning; this module keeps its own deadline instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def _parse(text: str) -> list:
    """math-verify's parse of one answer ([] if nothing could be read); see rule 2 of the module docstring."""
    mv = require_math_verify()
    if _LETTERS_RE.fullmatch(text):
        config = [mv.StringExtractionConfig()]
        return mv.parse(text, extraction_config=config, parsing_timeout=None)
    for candidate in (f"${text}$", text):
        parsed = mv.parse(candidate, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip()).lower()


def grade_math_verify(response: str, label: Any) -> float:
    """1.0 if the last `\\boxed{}` of `response` equals `label` by math-verify (module docstring), else 0.0."""
    gold = "" if label is None else str(label).strip()
    if not gold:
        return 0.0
    predicted = last_boxed_content(strip_end_tokens(response or ""))
    if predicted is None:
        return 0.0
    try:
        parsed_gold, parsed_pred = _parse(gold), _parse(predicted)
        if parsed_gold and parsed_pred:
            mv = require_math_verify()
            return 1.0 if mv.verify(parsed_gold, parsed_pred, timeout_seconds=None) else 0.0
    except ImportError:
        raise
    except Exception as error:  # math-verify failed on this input: fall back to the text comparison
        logger.debug("math-verify failed on %r vs %r: %s", predicted, gold, error)
    return 1.0 if _plain(predicted) == _plain(gold) else 0.0


async def math_verify_reward(sample, *, timeout_s: float = DEFAULT_TIMEOUT_S, **kw) -> float:
    """Reward for `--rm-type math_verify` (see the module docstring)."""
    require_math_verify()
    work = asyncio.to_thread(grade_math_verify, sample.response, sample.label)
    try:
        return await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        logger.warning(
            "--rm-type math_verify: judging %r against label %r took over %g s; scored 0",
            (sample.response or "")[-200:], sample.label, timeout_s,
        )  # fmt: skip
        return 0.0
