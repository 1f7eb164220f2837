"""`--rm-type deepscaler`: only the text after the thinking counts, graded with the math rules."""

import asyncio

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards.deepscaler import deepscaler_reward

DEEPSCALER_CASES = [
    # (response, label, reward)
    (r"<think>maybe \boxed{3}</think> The answer is \boxed{4}.", "4", 1.0),
    (r"<think>maybe \boxed{3}</think> The answer is \boxed{4}.", "3", 0.0),  # boxes inside thinking ignored
    (r"<think>a</think> x </think> final \boxed{\dfrac{1}{2}}", "0.5", 1.0),  # after the LAST </think>
    (r"<think>a</think> \boxed{7} </think> no box here", "7", 0.0),
    (r"The answer is \boxed{4}.", "4", 0.0),  # thinking never closed: 0
    (r"###Response The answer is \boxed{1,000}", "1000", 1.0),
    (r"<think>long</think> no box at all", "4", 0.0),
    (r"<think>x</think> \boxed{4}", 4, 1.0),  # int label
    (r"<think>x</think> \boxed{4}", r"\boxed{4}", 1.0),  # boxed label
    (r"<think>x</think> \boxed{4}", "", 0.0),  # empty label
    (r"<think>x</think> \boxed{4}", None, 0.0),
    # Case-insensitive text answers, as slime's grader (the math rules).
    (r"<think>is it Sunday?</think> \boxed{monday}", "Monday", 1.0),
    (r"<think>hmm</think> \boxed{\text{Even}}", "even", 1.0),
    (r"<think>hmm</think> \boxed{\text{odd}}", "even", 0.0),
    # The solution after the first "###Response" ends at a second one.
    (r"###Response \boxed{4} ###Response \boxed{5}", "4", 1.0),
    (r"###Response \boxed{4} ###Response \boxed{5}", "5", 0.0),
    (r"<think>x</think> ###Response \boxed{5}", "5", 1.0),  # </think> first
    # Trailing end-of-turn tokens do not hide the answer.
    (r"<think>x</think> \boxed{42}<|im_end|>", "42", 1.0),
    ("<think>x</think> \\boxed{42}</s>", "42", 1.0),
    (r"<think>x</think> \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"<think>x</think> \boxed{\frac{2}{4}}", r"\frac12", 0.0),  # unreduced fraction
    (r"<think>x</think> \boxed{10\text{ apples}}", "10", 1.0),
    (r"<think>x</think> \boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),  # sympy
    (r"<think>x</think> \boxed{(1, 2)}", r"\boxed{(1,2)}", 1.0),
]


@pytest.mark.parametrize("response,label,expected", DEEPSCALER_CASES)
def test_deepscaler_reward(response, label, expected):
    assert asyncio.run(deepscaler_reward(Sample(response=response, label=label))) == expected
