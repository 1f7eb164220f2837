"""SGLang-compatible `/generate`: request -> engine requests -> response items (or an SSE stream).

Response item (one per prompt and sample; a batch or n > 1 gives a list, prompt-major):

    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort",
     ...}, "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
     "output_token_logprobs": [[logprob, token_id, text_or_null], ...]  (with return_logprob),
     "output_token_weight_versions": [str, ...]  (with return_logprob)}}

Streaming follows SGLang's default (non-incremental) output: every `data:` chunk carries the item so far
(cumulative text, output_ids and logprobs), chunks of different items are told apart by "index", and
the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.protocol import GenerateRequest, RequestError, check_prompt
from clawrl.engine.request_output import GenerationResult
from clawrl.engine.sampling_params import SamplingParams


def sse(payload: Any) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(error: BaseException) -> str:
    """An error after the stream started (the HTTP status is already 200): sent as an event."""
    status = getattr(error, "status_code", 500)
    return sse({"error": {"message": str(error), "type": type(error).__name__, "code": status}})


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as their items arrive; yields (stream index, item)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(position: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await merged.put((position, item))
        except BaseException as error:  # re-raised in the consumer below
            await merged.put((position, error))
        finally:
            await merged.put((position, done))

    tasks = [asyncio.create_task(pump(position, stream)) for position, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()


def encode_text(engine: AsyncEngine, text: str, field: str, *, add_special_tokens: bool = True) -> list[int]:
    """Tokenize a text prompt; SGLang encodes /generate text with the tokenizer's default special tokens."""
    if engine.tokenizer is None:
        raise RequestError(
            f"{field}: the model at {engine.model_path} has no tokenizer; send token ids instead"
        )
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def token_text(tokenizer: Any, token: int) -> str:
    """The text of one token, special tokens included (empty without a tokenizer)."""
    return "" if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)


def _prepare(engine: AsyncEngine, req: GenerateRequest) -> list[tuple[str, list[int], SamplingParams]]:
    """Tokenize, check every prompt against the model, resolve ids and max_new_tokens."""
    prompts: list[tuple[str, list[int], SamplingParams]] = []
    spec = req.sampling_params
    requested = -1 if spec.max_new_tokens is None else spec.max_new_tokens
    for position, (prompt, rid) in enumerate(zip(req.prompts, req.request_ids(), strict=True)):
        field = req.prompt_field + (f"[{position}]" if req.is_batch else "")
        ids = encode_text(engine, prompt, field) if isinstance(prompt, str) else list(prompt)
        max_new = check_prompt(ids, field=field, vocab_size=engine.vocab_size, context_len=engine.context_len,
                               max_new_tokens=requested)  # fmt: skip
        params = spec.sampling_params(max_new)
        try:
            params.validate()
        except ValueError as error:
            raise RequestError(str(error)) from None
        prompts.append((rid or uuid.uuid4().hex, ids, params))
    engine.check_alive()
    return prompts


def generate_item(result: GenerationResult, req: GenerateRequest, tokenizer: Any, started: float) -> dict:
    """One SGLang response item from a (possibly partial) result."""
    meta: dict[str, Any] = {
        "id": result.request_id,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "weight_version": result.weight_version,
        "e2e_latency": round(time.monotonic() - started, 6),
    }
    if req.return_logprob:
        texts = [token_text(tokenizer, t) for t in result.output_ids] if req.return_text_in_logprobs else None
        meta["output_token_logprobs"] = [
            [logprob, token, texts[i] if texts else None]
            for i, (logprob, token) in enumerate(zip(result.logprobs, result.output_ids, strict=True))
        ]
        meta["output_token_weight_versions"] = list(result.weight_versions)
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta}


async def generate(engine: AsyncEngine, req: GenerateRequest) -> dict | list[dict] | AsyncIterator[str]:
    """The whole `/generate` route: items (single dict for one prompt with n == 1) or an SSE stream."""
    prompts = _prepare(engine, req)
    started = time.monotonic()
    if req.stream:
        return _stream(engine, req, prompts, started)
    per_prompt = await asyncio.gather(*(engine.generate_full(ids, p, rid) for rid, ids, p in prompts))
    items = [
        generate_item(result, req, engine.tokenizer, started) for results in per_prompt for result in results
    ]
    single = not req.is_batch and req.sampling_params.n == 1
    return items[0] if single else items


async def _stream(
    engine: AsyncEngine, req: GenerateRequest, prompts: list, started: float
) -> AsyncIterator[str]:
    n = req.sampling_params.n
    results: dict[int, GenerationResult] = {}
    streams = [engine.generate(ids, params, rid) for rid, ids, params in prompts]
    try:
        async for position, delta in merge_streams(streams):
            index = position * n + delta.index
            result = results.setdefault(
                index, GenerationResult(request_id=delta.request_id, index=delta.index)
            )
            result.add(delta)
            item = generate_item(result, req, engine.tokenizer, started)
            if req.is_batch or n > 1:
                item["index"] = index
            yield sse(item)
    except Exception as error:
        yield sse_error(error)
    yield sse("[DONE]")
