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
]


@pytest.mark.parametrize("response,label,expected", DEEPSCALER_CASES)
def test_deepscaler_reward(response, label, expected):
    assert asyncio.run(deepscaler_reward(Sample(response=response, label=label))) == expected
