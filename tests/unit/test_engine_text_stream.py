"""Incremental detokenization for streaming: deltas add up to the full text, stop strings are trimmed and
never half-sent, incomplete UTF-8 characters are held back."""

import pytest

from clawrl.engine.core.sequence import IncrementalDetokenizer
from clawrl.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(2048)


def _push_one_by_one(stream: IncrementalDetokenizer, ids: list[int], finish_reason: dict) -> list[str]:
    deltas = [stream.push([token]) for token in ids[:-1]]
    deltas.append(stream.push([ids[-1]], finish_reason))
    return deltas


def test_deltas_add_up_to_the_full_decode_and_hold_back_split_characters(tokenizer):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(" héllo wörld 日本語 ok")
    # The tiny BPE has no merges for CJK: each character is split over byte tokens.
    assert len(ids) > len(["héllo", "wörld", "日本語", "ok"])
    stream = IncrementalDetokenizer(tokenizer, prompt)
    deltas = _push_one_by_one(stream, ids, {"type": "length", "length": len(ids)})
    assert "".join(deltas) == tokenizer.decode(ids) == " héllo wörld 日本語 ok"
    assert all("\ufffd" not in delta for delta in deltas)
    assert deltas.count("") >= 2  # bytes of a character waited for the rest of it


def test_stop_string_is_trimmed_and_its_prefix_never_sent(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    stream = IncrementalDetokenizer(tokenizer, stop=["ta gam"])
    upto_beta = len(tokenizer.encode("alpha beta"))
    sent = "".join(stream.push([token]) for token in ids[:upto_beta])
    assert sent == "alpha be"  # "ta" could start "ta gam": held back
    # The rest arrives before the finish is known (its news may come a step later): nothing more is sent.
    rest = ids[upto_beta:]
    assert "".join(stream.push([token]) for token in rest) == ""
    assert stream.push([], {"type": "stop", "matched": "ta gam"}) == ""
    assert stream.final_text == "alpha be"


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    stream = IncrementalDetokenizer(tokenizer, stop=["beta"], no_stop_trim=True)
    text = "".join(_push_one_by_one(stream, ids, {"type": "stop", "matched": "beta"}))
    assert text == "alpha beta gamma"


def test_matched_stop_token_is_trimmed_unless_no_stop_trim(tokenizer):
    ids = tokenizer.encode("one two three")
    reason = {"type": "stop", "matched": ids[-1]}
    trimmed = "".join(_push_one_by_one(IncrementalDetokenizer(tokenizer), ids, reason))
    kept = "".join(_push_one_by_one(IncrementalDetokenizer(tokenizer, no_stop_trim=True), ids, reason))
    assert trimmed == tokenizer.decode(ids[:-1]) and kept == "one two three"


def test_special_tokens_follow_skip_special_tokens(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("done") + [im_end]
    reason = {"type": "stop", "matched": im_end}
    assert "".join(_push_one_by_one(IncrementalDetokenizer(tokenizer), ids, reason)) == "done"
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, no_stop_trim=True)
    assert "".join(_push_one_by_one(shown, ids, reason)) == "done<|im_end|>"


def test_abort_with_no_new_tokens_flushes_held_text(tokenizer):
    stream = IncrementalDetokenizer(tokenizer, stop=["xyz"])
    ids = tokenizer.encode("abc x")
    sent = "".join(stream.push([token]) for token in ids)
    assert sent == "abc "  # "x" might start "xyz"
    assert stream.push([], {"type": "abort"}) == "x"
    assert stream.push([5]) == ""  # finished: later tokens are ignored
