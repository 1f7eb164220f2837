"""`--rm-type f1`: SQuAD token F1 with its normalisation and the yes/no/noanswer rule."""

import asyncio

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards.f1 import f1_reward, f1_score

F1_CASES = [
    # (response, label, reward) -- hand-computed
    ("the Eiffel Tower", "Eiffel tower", 1.0),  # case + article
    ("Paris!", "paris", 1.0),  # punctuation
    ("The cat sat", "cat sat on mat", 2 / 3),  # P = 2/2, R = 2/4
    ("red red blue", "red blue", 0.8),  # P = 2/3, R = 1 -> 2*(2/3)/(5/3)
    ("dog", "cat", 0.0),
    ("yes.", "Yes", 1.0),
    ("yes it is", "yes", 0.0),  # special answers must match exactly
    ("no", "yes", 0.0),
    ("noanswer", "no answer", 0.0),
    ("anything", "", 0.0),  # empty label
    ("new york city", ["boston", "New York"], 0.8),  # best of several labels: P = 2/3, R = 1
    ("Paris<|im_end|>", "paris", 1.0),  # end-of-turn token stripped
    ("yes</s>", "yes", 1.0),
    ("The cat sat<|eot_id|>", "cat sat on mat", 2 / 3),
    ("a an the", "the", 0.0),  # only articles: nothing left to share
    ("New  York\n", "new york", 1.0),  # whitespace collapsed
    ("no", "No.", 1.0),
    ("noanswer", "noanswer", 1.0),
    ("anything", None, 0.0),  # no label
]


@pytest.mark.parametrize("response,label,expected", F1_CASES)
def test_f1_reward(response, label, expected):
    assert asyncio.run(f1_reward(Sample(response=response, label=label))) == pytest.approx(
        expected, abs=1e-12
    )


def test_f1_score_returns_precision_and_recall():
    # "a" is an article and goes: tokens b c d vs b c -> P = 2/3, R = 1, F1 = 0.8
    assert f1_score("a b c d", "b c") == pytest.approx((0.8, 2 / 3, 1.0))
