"""Non-streaming requests are collected, not streamed: `OutputCollector` + `collect_results` must give exactly
the GenerationResults that RequestStream's per-step deltas add up to (GenerationResult.add), for the same
core events: interleaved samples, stop strings and stop tokens (trimmed or kept), aborts, weight updates
in the middle of a request, split UTF-8 characters, special tokens."""

import random

import pytest

from clawrl.engine.core.engine import StepOutput
from clawrl.engine.core.request import (
    Aborted,
    Collected,
    GenerationResult,
    OutputCollector,
    RequestStream,
    SamplingParams,
    collect_results,
)
from clawrl.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(2048)


def _out(index, tokens, *, finished=False, reason=None, version="0", cached=0, prompt=4):
    return StepOutput("r", index, list(tokens), [-0.5 - t / 1000 for t in tokens], finished, reason, version,
                      prompt, cached)  # fmt: skip


def _streamed(prompt, params, tokenizer, events):
    """What generate_full used to return: RequestStream deltas added into per-sample results."""
    stream = RequestStream("r", prompt, params, tokenizer, "7")
    results: dict[int, GenerationResult] = {}
    for event in events:
        for delta in stream.deltas(event):
            results.setdefault(delta.index, GenerationResult(request_id="r", index=delta.index)).add(delta)
    assert not stream.unfinished
    return [results[index] for index in sorted(results)]


def _collected(prompt, params, tokenizer, events):
    """The same events through the engine thread's collector and the one-shot result builder."""
    collector, aborted = OutputCollector(params.n), []
    for event in events:
        if isinstance(event, Aborted):
            aborted += event.indices
        else:
            collector.add(event)
    return collect_results("r", prompt, params, tokenizer, "7", Collected(collector, aborted))


def _assert_same(prompt, params, tokenizer, events):
    want = _streamed(prompt, params, tokenizer, events)
    got = _collected(prompt, params, tokenizer, events)
    assert got == want
    return got


def test_interleaved_samples_with_a_weight_update_in_the_middle(tokenizer):
    prompt = tokenizer.encode("Count:")
    one, two = tokenizer.encode(" one two three four"), tokenizer.encode(" héllo wörld 日本語")
    events = []
    for step in range(max(len(one), len(two))):
        version = "0" if step < 3 else "1"  # weights updated after step 3: the tokens say so
        for index, ids in ((1, two), (0, one)):
            if step < len(ids):
                last = step == len(ids) - 1
                reason = {"type": "length", "length": len(ids)} if last else None
                events.append(
                    _out(index, [ids[step]], finished=last, reason=reason, version=version, cached=2)
                )
    results = _assert_same(prompt, SamplingParams(n=2), tokenizer, events)
    assert [r.text for r in results] == [" one two three four", " héllo wörld 日本語"]
    assert results[0].weight_versions == ["0"] * 3 + ["1"] * (len(one) - 3)
    assert results[1].weight_version == "1" and results[1].cached_tokens == 2


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_string_and_stop_token_trimming(tokenizer, no_stop_trim):
    ids = tokenizer.encode("alpha beta gamma delta")
    params = SamplingParams(n=2, stop=["ta gam"], no_stop_trim=no_stop_trim)
    string_stop = {"type": "stop", "matched": "ta gam"}
    token_stop = {"type": "stop", "matched": ids[-1]}
    events = [_out(0, [t]) for t in ids[:-1]] + [_out(0, [ids[-1]], finished=True, reason=string_stop)]
    events += [_out(1, ids[:2]), _out(1, ids[2:], finished=True, reason=token_stop)]  # several tokens a step
    results = _assert_same(tokenizer.encode("Say:"), params, tokenizer, events)
    if no_stop_trim:
        assert [r.text for r in results] == ["alpha beta gamma delta"] * 2
    else:  # cut before the stop string; the stop token itself dropped
        assert results[0].text == "alpha be"
        assert results[1].text == tokenizer.decode(ids[:-1])


def test_abort_keeps_tokens_and_takes_the_latest_counts(tokenizer):
    ids = tokenizer.encode(" one two three")
    params = SamplingParams(n=3)
    events = [_out(0, ids[:1], cached=0), _out(1, ids[:1], cached=0)]
    events += [_out(0, ids[1:2], finished=True, reason={"type": "stop", "matched": ids[1]}, cached=0)]
    events += [_out(1, ids[1:2], cached=3), _out(0, ids[2:], cached=9)]  # an output after its finish: ignored
    events += [Aborted([1, 2]), Aborted([1])]
    results = _assert_same(tokenizer.encode("x"), params, tokenizer, events)
    assert [r.finish_reason["type"] for r in results] == ["stop", "abort", "abort"]
    assert results[0].output_ids == ids[:2] and results[0].cached_tokens == 0
    assert results[1].output_ids == ids[:2] and results[1].text == tokenizer.decode(ids[:2])
    assert results[2].output_ids == [] and results[2].weight_version == "7" and results[2].cached_tokens == 3


def test_random_outputs_with_special_tokens_and_byte_pieces(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for trial in range(40):
        n = rng.randint(1, 3)
        params = SamplingParams(
            n=n, skip_special_tokens=trial % 2 == 0, stop=["e t"] if trial % 3 == 0 else []
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        lengths = [rng.randint(0, 40) for _ in range(n)]
        events = []
        for step in range(max(lengths) + 1):
            for index in rng.sample(range(n), n):
                if step < lengths[index]:
                    events.append(_out(index, [rng.randrange(vocab)], version=str(step // 15)))
                elif step == lengths[index] and rng.random() < 0.7:
                    events.append(_out(index, [], finished=True, reason={"type": "length", "length": step}))
        events.append(Aborted(list(range(n))))  # the samples that did not finish
        _assert_same(prompt, params, tokenizer, events)


def test_a_request_aborted_before_it_ran_has_empty_results(tokenizer):
    results = _assert_same([5, 6], SamplingParams(n=2), tokenizer, [Aborted([0, 1])])
    assert [(r.output_ids, r.text, r.prompt_tokens, r.weight_version) for r in results] == [
        ([], "", 2, "7")
    ] * 2
