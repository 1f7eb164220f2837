"""Trailing end-of-turn tokens of chat templates: every built-in `--rm-type` grades the answer before them."""

import asyncio

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards import build_reward_fn, compute_reward
from clawrl.rollout.rewards.special_tokens import END_OF_TURN_TOKENS, remove_end_tokens, strip_end_tokens

# (rm type, response before the end token, label, reward when right)
GRADERS = [
    ("math", r"so \boxed{42}", "42", 1.0),
    ("math", r"the day is \boxed{monday}", "Monday", 1.0),
    ("deepscaler", r"<think>x</think> so \boxed{42}", "42", 1.0),
    ("dapo", "so\nAnswer: 42", "42", {"score": 1.0, "acc": True, "pred": "42"}),
    ("gsm8k", "so\n#### 42", "42", 1.0),
    ("f1", "Paris", "paris", 1.0),
    ("boxed_f1", r"\boxed{New York}", "new york", 1.0),
]
COMMON_TOKENS = ["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<end_of_turn>"]


def _grade(rm_type, response, label):
    fn = build_reward_fn(rm_type=rm_type)
    return asyncio.run(compute_reward(Sample(response=response, label=label), fn))


@pytest.mark.parametrize("token", COMMON_TOKENS + ["<|im_end|>\n", "<|im_end|><|endoftext|>", " </s> "])
@pytest.mark.parametrize("rm_type,response,label,expected", GRADERS)
def test_every_builtin_grader_ignores_trailing_end_tokens(rm_type, response, label, expected, token):
    assert _grade(rm_type, response, label) == expected
    assert _grade(rm_type, response + token, label) == expected


def test_the_common_templates_tokens_are_all_known():
    assert set(COMMON_TOKENS) <= set(END_OF_TURN_TOKENS)


@pytest.mark.parametrize(
    "text,stripped",
    [
        ("Answer: 42<|im_end|>", "Answer: 42"),
        ("Answer: 42 <|im_end|>\n<|endoftext|>\n", "Answer: 42"),
        ("Answer: 42\n", "Answer: 42\n"),  # no token: unchanged, whitespace included
        ("<|im_end|> Answer: 42", "<|im_end|> Answer: 42"),  # only trailing ones
        ("</s>", ""),
        ("", ""),
    ],
)
def test_strip_end_tokens(text, stripped):
    assert strip_end_tokens(text) == stripped


def test_remove_end_tokens_removes_them_anywhere():
    assert remove_end_tokens("4<|im_end|>2</s>") == "42"
