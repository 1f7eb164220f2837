"""`--rm-type dapo`: `Answer:` extraction from the last 300 characters, Minerva normalisation, dict result."""

import asyncio

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards.dapo import dapo_reward, minerva_normalise

FILLER = "x" * 400

DAPO_CASES = [
    # (response, label, score, pred)
    ("Reasoning...\nAnswer: 42", "42", 1.0, "42"),
    ("Reasoning...\nanswer : $1,000$", "1000", 1.0, "1000"),  # case-insensitive, $..$, thousands comma
    ("Answer: x = 5", "5", 1.0, "5"),  # after the last "="
    ("Answer: 42", "42.0", 1.0, "42"),  # integral label written as an integer
    ("Answer: 42.0", "42", -1.0, "42.0"),  # no numeric equivalence: DAPO is strict
    ("Answer: 3\nmore thought\nAnswer: 4", "4", 1.0, "4"),  # last match wins
    (r"Answer: \boxed{7}", "7", 1.0, "7"),
    (r"Answer: \frac12", r"\frac{1}{2}", 1.0, r"\frac{1}{2}"),  # \frac shorthand
    ("Answer: 42 degrees", "42", 1.0, "42"),  # unit removed
    (r"Answer: \text{(B)}", "(B)", 1.0, "(B)"),
    ("The answer is 42", "42", -1.0, "[INVALID]"),  # no Answer:
    ("Answer: 42\n" + FILLER, "42", -1.0, "[INVALID]"),  # outside the last 300 characters
    ("Answer: 41", "42", -1.0, "41"),
    # Trailing end-of-turn tokens of chat templates are not part of the answer.
    ("Reasoning...\nAnswer: 42<|im_end|>", "42", 1.0, "42"),
    ("Answer: 42<|im_end|>\n", "42", 1.0, "42"),
    ("Answer: 42<|endoftext|>", "42", 1.0, "42"),
    ("Answer: 42</s>", "42", 1.0, "42"),
    ("Answer: 42<|eot_id|>", "42", 1.0, "42"),
    ("Answer: 42<end_of_turn>", "42", 1.0, "42"),
    ("Answer: 42<|im_end|><|endoftext|>", "42", 1.0, "42"),
    ("Answer: 41<|im_end|>", "42", -1.0, "41"),
    ("Answer: 4<|im_end|>2", "42", 1.0, "42"),  # removed inside the answer too, as DAPO's normaliser does
    # Minerva normalisation, rule by rule.
    ("ANSWER: 42", "42", 1.0, "42"),
    ("Answer: 42.", "42", -1.0, "42."),  # a trailing period stays (no numeric equivalence)
    ("Answer: 5 cm", "5", 1.0, "5"),
    ("Answer: 7 students", "7", 1.0, "7"),
    ("Answer: 1,000,000", "1000000", 1.0, "1000000"),
    (r"Answer: \textbf{12}", "12", 1.0, "12"),
    (r"Answer: 90^\circ", "90", 1.0, "90"),
    (r"Answer: $y = 3$", "3", 1.0, "3"),
    ("Answer: -3", "-3.0", 1.0, "-3"),
    ("Answer: 42", 42, 1.0, "42"),  # int label
    ("Answer: 3.5", "3.5", 1.0, "3.5"),  # a non-integral label is kept (slime truncates it to "3")
    ("Answer: 3", "3.5", -1.0, "3"),
    ("Answer: 42", "", -1.0, "[INVALID]"),  # empty label
    ("Answer: x+1", "x + 1", 1.0, "x+1"),  # a non-numeric label is compared as a string (slime raises)
]


@pytest.mark.parametrize("response,label,score,pred", DAPO_CASES)
def test_dapo_reward(response, label, score, pred):
    result = asyncio.run(dapo_reward(Sample(response=response, label=label)))
    assert result == {"score": score, "acc": score == 1.0, "pred": pred}


def test_dapo_strict_box_mode_reads_only_the_last_100_characters():
    near_end = Sample(response=FILLER + r" so \boxed{42}", label="42")
    far = Sample(response=r"\boxed{42}" + FILLER, label="42")
    assert asyncio.run(dapo_reward(near_end, strict_box=True)) == {"score": 1.0, "acc": True, "pred": "42"}
    assert asyncio.run(dapo_reward(far, strict_box=True)) == {"score": -1.0, "acc": False, "pred": ""}


def test_dapo_strict_box_mode_ignores_a_trailing_end_token():
    sample = Sample(response=r"so \boxed{42}<|im_end|>", label="42")
    assert asyncio.run(dapo_reward(sample, strict_box=True)) == {"score": 1.0, "acc": True, "pred": "42"}


def test_minerva_normalise_sqrt_shorthand_and_spaces():
    assert minerva_normalise(r"\sqrt3 + 1") == r"\sqrt{3}+1"
    assert minerva_normalise("a 5 cm") == "5"
