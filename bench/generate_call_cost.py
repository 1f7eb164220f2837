"""The CPU cost of one rollout `/generate` call on each side, piece by piece, without an engine or a socket.

One prompt group's batch request as the default generate function sends it (--group-size prompts of
--prompt-len tokens, one sampling_params entry per sample, return_logprob), and its answer (--new-tokens
tokens per sample with logprobs): the engine server's parsing and checks (the request model, the rule table
as the core applies it again), the answer it builds (collect_results: text decoded; generate_item: the
SGLang item with its logprob triples; orjson), and the rollout client's parsing and apply_output. Each piece
is timed over --calls calls with the heap frozen, as the engine server and the RolloutManager freeze theirs
(gc.freeze after their set-up), with a tiny tokenizer built offline (--vocab).

These are the per-call costs behind bench/rollout_http_overhead.py's ramp (requests in, one after another on
the server's event loop) and tail (answers out, then parsed by the client, one after another). The answer's
pieces are timed twice: with SGLang's logprob triples (what any SGLang client gets) and with clawrl's
`compact_logprobs` (what the rollout asks its own engines for: packed floats, version runs).

Run from the repository root (CPU, ~10 s):
    .venv/bin/python bench/generate_call_cost.py
    .venv/bin/python bench/generate_call_cost.py --group-size 8 --new-tokens 1024 --json-out /tmp/cost.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import orjson

from clawrl.data.sample import Sample
from clawrl.engine.core.request import Collected, OutputCollector, check_prompt, collect_results
from clawrl.engine.http.generate import GenerateRequest, generate_item, parse_request
from clawrl.models.tiny import build_tiny_tokenizer
from clawrl.rollout.generate import apply_output


def request_body(args, rng: random.Random) -> dict:
    """The default generate function's batch payload for one group (clawrl/rollout/generate.py)."""
    ids = [[rng.randrange(3, args.vocab - 8) for _ in range(args.prompt_len)] for _ in range(args.group_size)]
    params = [{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": args.new_tokens, "stop": None,
               "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
               "spaces_between_special_tokens": False, "seed": i} for i in range(args.group_size)]  # fmt: skip
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


def collected_outputs(args, rng: random.Random) -> list[Collected]:
    """What the engine thread hands over for each sample of the group when it finishes (one sample each)."""
    out = []
    for _ in range(args.group_size):
        collector = OutputCollector(1)
        sample = collector.samples[0]
        sample.token_ids = [rng.randrange(3, args.vocab - 8) for _ in range(args.new_tokens)]
        sample.logprobs = [-rng.random() * 4 for _ in range(args.new_tokens)]
        sample.weight_version, sample.version_starts, sample.finished = "1", [(0, "1")], True
        sample.last = collector.last = SimpleNamespace(
            weight_version="1", prompt_tokens=args.prompt_len, cached_tokens=0,
            finish_reason={"type": "length", "length": args.new_tokens},
        )  # fmt: skip
        out.append(Collected(collector, [], time.monotonic()))
    return out


def time_ms(fn, calls: int) -> float:
    """Mean over `calls` calls after one warm-up call, in ms."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e3 / calls


def measure(args) -> dict[str, float]:
    rng = random.Random(0)
    tokenizer = build_tiny_tokenizer(args.vocab)
    body = orjson.dumps(request_body(args, rng))
    data = json.loads(body)
    req = parse_request(GenerateRequest, data)

    def core_params():
        params = []
        for position, ids in enumerate(req.prompts):
            spec = req.spec(position)
            fitted = check_prompt(ids, field="input_ids", vocab_size=args.vocab, context_len=1 << 20,
                                  max_new_tokens=spec.max_new_tokens)  # fmt: skip
            params.append(spec.sampling_params(fitted))
        return params

    params = core_params()
    collected = collected_outputs(args, rng)

    def results():
        out = []
        for i, done in enumerate(collected):
            for result in collect_results(f"r{i}", req.prompts[i], params[i], tokenizer, "1", done):
                result.prompt_ids = req.prompts[i]
                out.append(result)
        return out

    compact_req = parse_request(GenerateRequest, {**data, "compact_logprobs": True})

    def items(of, request=req):
        return [generate_item(result, request, tokenizer, 0.0) for result in of]

    finished = results()
    answer_items, compact_items = items(finished), items(finished, compact_req)
    answer_body, compact_body = orjson.dumps(answer_items), orjson.dumps(compact_items)
    parsed, compact_parsed = orjson.loads(answer_body), orjson.loads(compact_body)

    def apply(answer=parsed) -> list[Sample]:
        samples = [Sample(index=i, tokens=list(req.prompts[i])) for i in range(len(answer))]
        for sample, item in zip(samples, answer, strict=True):
            apply_output(sample, item)
        return samples

    same = [(s.tokens, s.rollout_log_probs, s.weight_versions) for s in apply(parsed)]
    if same != [(s.tokens, s.rollout_log_probs, s.weight_versions) for s in apply(compact_parsed)]:
        raise AssertionError("the compact answer gave the samples other tokens, logprobs or versions")
    gc.collect()
    gc.freeze()  # as the engine server and the RolloutManager do after their set-up
    pieces = {
        "server: JSON body -> request model (json.loads, pydantic, value rules)": lambda: parse_request(
            GenerateRequest, json.loads(body)
        ),
        "server: core SamplingParams per prompt (check_prompt, fitting)": core_params,
        "server: the rule table again, as AsyncEngine and the core apply it (x2)": lambda: [
            p.validate() for p in params + params
        ],
        "server: the samples' results (collect_results: text decoded)": results,
        "server: the SGLang answer items (generate_item: logprob triples)": lambda: items(finished),
        "server: answer JSON (orjson)": lambda: orjson.dumps(answer_items),
        "client: answer JSON -> objects (orjson)": lambda: orjson.loads(answer_body),
        "client: apply_output per sample": apply,
        "compact: the answer items (generate_item: packed logprobs)": lambda: items(finished, compact_req),
        "compact: answer JSON (orjson)": lambda: orjson.dumps(compact_items),
        "compact: client, answer JSON -> objects (orjson)": lambda: orjson.loads(compact_body),
        "compact: client, apply_output per sample": lambda: apply(compact_parsed),
    }
    try:
        return {name: time_ms(fn, args.calls) for name, fn in pieces.items()} | {
            "answer_bytes": len(answer_body),
            "compact_answer_bytes": len(compact_body),
        }
    finally:
        gc.unfreeze()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=8, help="prompts in the batch request")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="answer tokens per sample")
    p.add_argument("--vocab", type=int, default=4096, help="tiny tokenizer's vocabulary")
    p.add_argument("--calls", type=int, default=300, help="timed calls per piece")
    p.add_argument("--json-out", help="write the numbers here")
    args = p.parse_args()
    result = measure(args)
    print(f"one /generate call: {args.group_size} prompts x {args.prompt_len} tokens, {args.new_tokens} answer "
          f"tokens each, answer {result['answer_bytes']:,} bytes ({result['compact_answer_bytes']:,} compact); "
          "ms per call (heap frozen):")  # fmt: skip
    for name, value in result.items():
        if not name.endswith("answer_bytes"):
            print(f"  {name:72s} {value:7.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "ms_per_call": result}, indent=1))


if __name__ == "__main__":
    main()
