"""The "rollout looks like language" heuristic: each measure on hand-made texts with hand-computed values,
the verdict on garbage and on healthy text (prose, arithmetic answers, a random tiny model's output), and the
rollout/text/* metrics computed from samples."""

from __future__ import annotations

import random

import pytest

from clawrl.data.sample import Sample, Status
from clawrl.debug.language import (
    TextThresholds,
    count_bad_chars,
    is_bad_char,
    ngram_repetition,
    periodic_tail_ratio,
    response_repetition,
    text_metrics,
    text_verdict,
)
from clawrl.rollout.metrics import rollout_metrics

HEALTHY = [
    "Natalia sold 48 / 2 = 24 clips in May. Natalia sold 48 + 24 = 72 clips altogether in April and May. #### 72",
    "Weng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. The answer is 10.",
    "Sure! Here is a short poem:\n\nThe river bends and the willows lean,\nthe evening light is soft and green.",
    "北京是中国的首都。",
    '<tool_call>\n{"name": "search", "arguments": {"q": "weather"}}\n</tool_call>',
    "42",
]


@pytest.mark.parametrize(
    ("char", "bad"),
    [("\ufffd", True), ("\x00", True), ("\x1b", True), ("\x7f", True), ("\ue000", True), ("\ud800", True),
     ("\n", False), ("\t", False), ("\r", False), ("a", False), ("é", False), ("中", False), ("😀", False)],
)  # fmt: skip
def test_bad_characters(char, bad):
    assert is_bad_char(char) is bad


def test_ngram_repetition_hand_computed():
    # 3-grams (a b a), (b a b), (a b a), (b a b): 2 distinct of 4
    assert ngram_repetition("a b a b a b", n=3) == 0.5
    # ten words: seven 4-grams, all "the the the the"
    assert ngram_repetition("the " * 10) == pytest.approx(1 - 1 / 7)
    # punctuation marks are units of their own: "!" * 10 -> seven equal 4-grams
    assert ngram_repetition("!" * 10) == pytest.approx(1 - 1 / 7)
    assert ngram_repetition("one two three four five") == 0.0  # two distinct 4-grams
    assert ngram_repetition("the the the the") == 0.0  # one 4-gram: too short to judge


def test_periodic_tail_hand_computed():
    assert periodic_tail_ratio("xyz" + "ab" * 10) == pytest.approx(20 / 23)
    assert periodic_tail_ratio("ing" * 8) == 1.0  # one BPE token repeated without spaces
    assert periodic_tail_ratio("Hello, world" + "." * 20) == pytest.approx(20 / 32)
    assert periodic_tail_ratio("Hello, world" + "." * 15) == 0.0  # 15 < 16 characters: not a loop
    assert periodic_tail_ratio("1000000") == 0.0
    assert periodic_tail_ratio("") == 0.0


def test_response_repetition_is_the_larger_measure():
    assert response_repetition("ing" * 8) == 1.0  # a single word: no n-grams, the tail finds it
    assert response_repetition("the " * 10) == 1.0  # periodic with period 4 from the first character
    text = "a b c d e f g h a b c d e f g h"  # 13 4-grams, 8 distinct; the tail has period 16 but 2 copies
    assert response_repetition(text) == pytest.approx(1 - 8 / 13)
    assert all(response_repetition(t) < 0.2 for t in HEALTHY)


def test_text_metrics_hand_computed():
    metrics = text_metrics(["Hello world.", "", "  \n", "ab\ufffd\x00"])
    # 2 of 4 empty; 16 characters in the non-empty ones, 2 of them bad; no repetition
    assert metrics == {"empty_ratio": 0.5, "bad_char_ratio": 0.125, "repetition": 0.0}
    assert text_metrics([]) == {"empty_ratio": 0.0, "bad_char_ratio": 0.0, "repetition": 0.0}
    assert text_metrics(["", ""]) == {"empty_ratio": 1.0, "bad_char_ratio": 0.0, "repetition": 0.0}
    # repetition is the mean over non-empty responses: (1.0 + 0.0) / 2
    assert text_metrics(["ing" * 8, "fine text", ""])["repetition"] == 0.5


@pytest.mark.parametrize(
    ("texts", "reasons"),
    [
        (["", "", " ", "ok"], ["empty responses 0.75 > 0.5 (--ci-text-max-empty-ratio)"]),
        (["\ufffd\ufffd", "\ufffd\ufffdab"], ["replacement/unprintable characters 0.667 > 0.05 (--ci-text-max-bad-char-ratio)"]),
        # periodic from the start: 1.0; 38 4-grams of which 2 distinct: 1 - 2/38; mean 0.974
        (["the " * 30, "the " * 40 + "end"], ["repetition 0.974 > 0.5 (--ci-text-max-repetition)"]),
        (["\x01\x02\x03 hi", "\x07\x08"], ["replacement/unprintable characters 0.625 > 0.05 (--ci-text-max-bad-char-ratio)"]),
    ],
)  # fmt: skip
def test_garbage_fails_with_the_numbers(texts, reasons):
    assert text_verdict(text_metrics(texts), TextThresholds()) == reasons


def test_all_reasons_at_once_and_custom_thresholds():
    metrics = {"empty_ratio": 0.6, "bad_char_ratio": 0.1, "repetition": 0.7}
    assert len(text_verdict(metrics, TextThresholds())) == 3
    loose = TextThresholds(max_empty_ratio=0.6, max_bad_char_ratio=0.2, max_repetition=0.9)
    assert text_verdict(metrics, loose) == []


def test_healthy_text_passes():
    assert text_verdict(text_metrics(HEALTHY), TextThresholds()) == []


def test_a_random_tiny_model_output_passes():
    """What a random tiny model (vocab 2048) produces in the CPU tests: uniformly random tokens, decoded
    with the special tokens kept, 12 per response, 8 responses per rollout, for 50 rollouts."""
    from clawrl.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(2048)
    rng = random.Random(0)
    worst = {"empty_ratio": 0.0, "bad_char_ratio": 0.0, "repetition": 0.0}
    for _ in range(50):
        texts = [tokenizer.decode([rng.randrange(len(tokenizer)) for _ in range(12)]) for _ in range(8)]
        metrics = text_metrics(texts)
        assert text_verdict(metrics, TextThresholds()) == [], texts
        worst = {k: max(v, metrics[k]) for k, v in worst.items()}
    assert worst["bad_char_ratio"] > 0  # its byte tokens do decode to U+FFFD now and then


def _sample(index: int, response: str) -> Sample:
    return Sample(
        group_index=index // 2, index=index, tokens=[1, 2, 3], response=response, response_length=2,
        status=Status.COMPLETED, reward=1.0,
    )  # fmt: skip


def test_rollout_metrics_carry_the_text_metrics():
    groups = [[_sample(0, "Hello world."), _sample(1, "")], [_sample(2, "ab\ufffd\x00"), _sample(3, "  ")]]
    metrics = rollout_metrics(
        groups, [1.0, 0.0, 1.0, 0.0], estimator="grpo", drops={}, num_aborted_samples=0, rollout_time_s=1.0,
        num_rollout_devices=1,
    )  # fmt: skip
    assert metrics["rollout/text/empty_ratio"] == 0.5
    assert metrics["rollout/text/bad_char_ratio"] == 0.125
    assert metrics["rollout/text/repetition"] == 0.0


def test_count_bad_chars_is_the_per_character_count():
    # The fast path (str.isprintable on the text) must agree with is_bad_char on every kind of code point:
    # controls, format characters, non-ASCII spaces, line separators, surrogates, private use, unassigned.
    rng = random.Random(7)
    kinds = ["\x00", "\x1b", "\x7f", "\u200d", "\u00a0", "\u2028", "\ud800", "\ue000", "\U000e0080", "\ufffd",
             "\n", "\t", "\r", " ", "a", "é", "中", "😀", "\u0378"]  # fmt: skip
    texts = [*HEALTHY, "", "\ufffd\ufffd ok", "a\u2028b\u00a0c", "x\u200dy"]
    texts += ["".join(rng.choice(kinds) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    texts += ["".join(chr(rng.randrange(0, 0x30000)) for _ in range(200)) for _ in range(50)]
    for text in texts:
        assert count_bad_chars(text) == sum(is_bad_char(c) for c in text), repr(text)


def test_ngram_repetition_counts_every_window():
    assert ngram_repetition("a b a b a b", n=3) == pytest.approx(0.5)
    assert ngram_repetition("a b c d", n=4) == 0.0  # one 4-gram: fewer than two
    assert ngram_repetition("a a a a a", n=4) == pytest.approx(0.5)  # (a a a a) twice: 1 - 1/2
