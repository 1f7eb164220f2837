"""`--rm-type gsm8k`: `####` labels, final-number extraction, commas, signs and decimals."""

import asyncio

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards.gsm8k import gsm8k_reward

GSM8K_SOLUTION = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18"

GSM8K_CASES = [
    # (response, label, reward)
    ("She makes 18 dollars.\n#### 18", "#### 18", 1.0),
    ("She makes $18 every day.", GSM8K_SOLUTION, 1.0),  # full GSM8K solution as label
    ("The total is 1000.", "#### 1,000", 1.0),
    ("#### $1,000", "1000", 1.0),
    ("It costs 3.50 in total", "3.5", 1.0),
    ("The change is -3.0", "-3", 1.0),
    ("The temperature fell to \u22125 degrees", "-5", 1.0),  # unicode minus
    ("5 apples and 7 pears make 12 fruits", "12", 1.0),  # last number
    ("5 apples and 7 pears make 12 fruits", "7", 0.0),
    ("#### 12\nCheck: 3 + 4 = 7", "12", 1.0),  # the #### line beats the last number
    (r"So the answer is \boxed{18} (see step 3)", "18", 1.0),  # the box beats the last number
    ("It takes 3-4 hours", "4", 1.0),  # a hyphen between numbers is not a minus sign
    ("It is 1,234,567 in total", "1234567", 1.0),
    ("The answer is $18.", 18, 1.0),  # int label, trailing period
    ("The answer is 41", "42", 0.0),
    ("I do not know", "42", 0.0),  # no number
    ("The answer is 42", "", 0.0),  # empty label
    ("The answer is 42", None, 0.0),
    ("The answer is 42", "forty-two", 0.0),  # non-numeric label
    ("0.5 of them, i.e. .5", "0.5", 1.0),
    ("#### 18<|im_end|>", "18", 1.0),  # end-of-turn tokens stripped
    ("The answer is 18.<|eot_id|>", "#### 18", 1.0),
    ("The answer is 18</s>", "18", 1.0),
    ("The answer is 18<end_of_turn>", "18", 1.0),
]


@pytest.mark.parametrize("response,label,expected", GSM8K_CASES)
def test_gsm8k_reward(response, label, expected):
    assert asyncio.run(gsm8k_reward(Sample(response=response, label=label))) == expected
