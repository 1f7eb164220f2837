"""`--rm-type math_verify`: hand-picked answers judged by the math-verify package through the real dispatch,
and the one error (naming the extra to install) when the package is missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards import build_reward_fn, compute_reward
from clawrl.rollout.rewards.math_verify_rm import grade_math_verify


def _reward(response: str, label) -> float:
    fn = build_reward_fn(rm_type="math_verify")
    return asyncio.run(compute_reward(Sample(prompt="q", response=response, label=label), fn))


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\dfrac{1}{2}", 1.0),
        ("\\boxed{\\frac{3}{4}}<|im_end|>", "0.75", 1.0),  # end-of-turn token stripped first
        ("first \\boxed{7}, then \\boxed{42}", "42", 1.0),  # the last box counts
        ("\\boxed{42}", 42, 1.0),  # a numeric label
        ("\\boxed{2.0}", "2", 1.0),
        ("\\boxed{1+x}", "x+1", 1.0),  # bare `1+x` would parse as 1: `$...$` is tried first
        ("\\boxed{\\sqrt{2}}", "2^{1/2}", 1.0),
        ("\\boxed{(1,2]}", "(1, 2]", 1.0),
        ("\\boxed{B}", "b", 1.0),  # a choice letter, parsed as a string answer
        ("\\boxed{Monday}", "monday", 1.0),  # text: math-verify cannot parse it, the text comparison decides
        ("\\boxed{41}", "42", 0.0),  # wrong
        ("\\boxed{[1,2]}", "(1,2]", 0.0),  # brackets differ
        ("\\boxed{A}", "B", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
        ("the answer is 42", "42", 0.0),  # no box: no answer
        ("\\boxed{42", "42", 0.0),  # unclosed box: no answer
        ("\\boxed{42}", "", 0.0),  # empty label
        ("\\boxed{42}", None, 0.0),
    ],
)
def test_hand_picked_answers(response, label, expected):
    assert _reward(response, label) == expected
    assert grade_math_verify(response, label) == expected


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    with pytest.raises(ImportError) as info:
        build_reward_fn(rm_type="math_verify")
    assert str(info.value) == (
        "--rm-type math_verify needs the math-verify package: pip install 'clawrl[math]'"
    )
