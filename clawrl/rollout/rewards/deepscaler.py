"""`--rm-type deepscaler`: math grading of the part of a reasoning model's response after its thinking.

The solution is the text after the last `</think>`; without one, the text after the first `###Response` (up
to a second `###Response`, if any); with neither the reward is 0.0 (a response that never closed its
thinking earns nothing). Trailing end-of-turn special tokens are stripped first. The solution's last
`\\boxed{}` is graded against the label with the `math` rules (`math_rm.answers_equal`). Returns 1.0 / 0.0.
"""

from __future__ import annotations

import asyncio
from typing import Any

from clawrl.rollout.rewards.math_rm import grade_boxed
from clawrl.rollout.rewards.special_tokens import strip_end_tokens
from clawrl.rollout.rewards.sympy_judge import DEFAULT_TIMEOUT_S


def extract_solution(response: str) -> str | None:
    """Text after the last `</think>`, else between the first and second `###Response`, else None."""
    response = strip_end_tokens(response)
    if "</think>" in response:
        return response.rpartition("</think>")[2]
    if "###Response" in response:
        return response.split("###Response")[1]
    return None


def deepscaler_score(response: str, label: Any, sympy_timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the solution's last box matches the label, else 0.0."""
    solution = extract_solution(response)
    return 0.0 if solution is None else grade_boxed(solution, label, sympy_timeout_s)


async def deepscaler_reward(sample, *, sympy_timeout_s: float = DEFAULT_TIMEOUT_S, **kw) -> float:
    """Reward for `--rm-type deepscaler` (see the module docstring)."""
    return await asyncio.to_thread(deepscaler_score, sample.response, sample.label, sympy_timeout_s)
