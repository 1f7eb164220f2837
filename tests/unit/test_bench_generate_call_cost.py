"""bench/generate_call_cost.py on a small call: every piece is timed, and what it times is the real path (the
answer it builds parses back into samples with the request's tokens). Nothing is asserted about speed."""

from __future__ import annotations

import argparse
import gc

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def bench():
    yield load_bench("generate_call_cost")
    unload_bench("generate_call_cost")


def test_every_piece_is_timed_and_the_heap_is_thawed_after(bench):
    args = argparse.Namespace(group_size=2, prompt_len=8, new_tokens=16, vocab=2048, calls=3, json_out=None)
    result = bench.measure(args)
    assert gc.get_freeze_count() == 0  # the script froze the heap to time, and thawed it
    pieces = {name: ms for name, ms in result.items() if not name.endswith("answer_bytes")}
    assert len(pieces) == 12 and all(ms > 0 for ms in pieces.values())
    assert result["answer_bytes"] > 2 * 16 * 10  # two samples' triples at least
    assert 2 * 16 * 8 < result["compact_answer_bytes"] < result["answer_bytes"]  # packed float64s


def test_the_call_it_times_is_the_rollouts_call(bench):
    import random

    from clawrl.engine.http.generate import GenerateRequest, parse_request

    args = argparse.Namespace(group_size=3, prompt_len=8, new_tokens=5, vocab=2048)
    req = parse_request(GenerateRequest, bench.request_body(args, random.Random(0)))
    assert req.is_batch and req.return_logprob and [len(p) for p in req.prompts] == [8, 8, 8]
    assert [req.spec(i).seed for i in range(3)] == [0, 1, 2] and req.spec(0).max_new_tokens == 5
    samples = [c.outputs.samples[0] for c in bench.collected_outputs(args, random.Random(1))]
    assert [(len(s.token_ids), len(s.logprobs), s.finished) for s in samples] == [(5, 5, True)] * 3
