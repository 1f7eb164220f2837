"""OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Chat prompts are rendered by the model's own chat template (tokenizer_config.json) with `tools` passed to
it, then tokenized without adding special tokens (the template already wrote them). Streaming is real: one
SSE chunk per engine step per sample (token by token), ending with `data: [DONE]`.

Extensions over OpenAI's schema (ignored by the `openai` package, read by clawrl's own tools):
- every response carries `weight_version` (the version of the last generated token; ARCHITECTURE 8);
- `return_token_ids: true` adds `prompt_token_ids` and per-choice `token_ids` (vLLM's field names);
- SGLang sampling knobs are accepted: top_k, min_p, stop_token_ids, ignore_eos, skip_special_tokens,
  no_stop_trim, and `chat_template_kwargs` for the template (e.g. enable_thinking).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.protocol import ChatCompletionRequest, CompletionRequest, RequestError, check_prompt
from clawrl.engine.request_output import GenerationResult
from clawrl.engine.sampling_params import SamplingParams
from clawrl.engine.serving_generate import encode_text, merge_streams, sse, sse_error, token_text

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(reason: dict | None) -> str | None:
    """Core finish reason dict -> OpenAI's string ("stop", "length"; "abort" as SGLang reports it)."""
    return None if reason is None else _FINISH_REASONS.get(reason.get("type"), reason.get("type"))


def models(engine: AsyncEngine) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": engine.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "clawrl",
                "root": engine.model_path,
                "max_model_len": engine.context_len,
            }
        ],
    }


# ---------------------------------------------------------------------------------------------------
# prompts


def render_chat_prompt(engine: AsyncEngine, req: ChatCompletionRequest) -> list[int]:
    """Messages (+ tools) -> prompt token ids through the model's chat template."""
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"the model at {engine.model_path} has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            req.messages, tools=req.tools, tokenize=False, add_generation_prompt=True,
            **(req.chat_template_kwargs or {}),
        )  # fmt: skip
    except Exception as error:  # jinja errors: the messages do not fit the template
        raise RequestError(f"messages could not be rendered by the chat template: {error}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _params(
    engine: AsyncEngine, req: Any, ids: list[int], field: str, max_new_tokens: int | None
) -> SamplingParams:
    requested = -1 if max_new_tokens is None else max_new_tokens
    fitted = check_prompt(ids, field=field, vocab_size=engine.vocab_size, context_len=engine.context_len,
                          max_new_tokens=requested)  # fmt: skip
    params = req.sampling_params(fitted)
    try:
        params.validate()
    except ValueError as error:
        raise RequestError(str(error)) from None
    engine.check_alive()
    return params


def _usage(results: list[GenerationResult], prompt_tokens: int) -> dict:
    completion = sum(r.completion_tokens for r in results)
    cached = max((r.cached_tokens for r in results), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_logprob(tokenizer: Any, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}


# ---------------------------------------------------------------------------------------------------
# chat completions


async def chat_completions(engine: AsyncEngine, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
    prompt_ids = render_chat_prompt(engine, req)
    params = _params(engine, req, prompt_ids, "messages", req.max_new_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        return _chat_stream(engine, req, prompt_ids, params, rid)
    results = await engine.generate_full(prompt_ids, params, rid)
    choices = []
    for result in results:
        choice = {
            "index": result.index,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": _chat_logprobs(engine, result.output_ids, result.logprobs) if req.logprobs else None,
            "finish_reason": finish_reason(result.finish_reason),
            "matched_stop": (result.finish_reason or {}).get("matched"),
        }
        if req.return_token_ids:
            choice["token_ids"] = list(result.output_ids)
        choices.append(choice)
    response = _envelope(engine, rid, "chat.completion", choices, results)
    response["usage"] = _usage(results, len(prompt_ids))
    if req.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return response


def _chat_logprobs(engine: AsyncEngine, token_ids: list[int], logprobs: list[float]) -> dict:
    return {
        "content": [
            _token_logprob(engine.tokenizer, t, lp) for t, lp in zip(token_ids, logprobs, strict=True)
        ]
    }


def _envelope(
    engine: AsyncEngine, rid: str, kind: str, choices: list, results: list[GenerationResult]
) -> dict:
    version = results[-1].weight_version if results else engine.weight_version
    return {"id": rid, "object": kind, "created": int(time.time()), "model": engine.served_model_name,
            "choices": choices, "weight_version": version}  # fmt: skip


async def _chat_stream(engine: AsyncEngine, req: ChatCompletionRequest, prompt_ids: list[int],
                       params: SamplingParams, rid: str) -> AsyncIterator[str]:  # fmt: skip
    created = int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": engine.served_model_name, "choices": choices, **extra})  # fmt: skip

    results = {index: GenerationResult(request_id=rid, index=index) for index in range(params.n)}
    for index in range(params.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])  # fmt: skip
    try:
        async for delta in engine.generate(prompt_ids, params, rid):
            results[delta.index].add(delta)
            choice = {
                "index": delta.index,
                "delta": {"content": delta.text},
                "logprobs": _chat_logprobs(engine, delta.token_ids, delta.logprobs) if req.logprobs else None,
                "finish_reason": finish_reason(delta.finish_reason),
            }
            yield chunk([choice], weight_version=delta.weight_version)
        if req.include_usage:
            yield chunk([], usage=_usage(list(results.values()), len(prompt_ids)))
    except Exception as error:
        yield sse_error(error)
    yield sse("[DONE]")


# ---------------------------------------------------------------------------------------------------
# completions


async def completions(engine: AsyncEngine, req: CompletionRequest) -> dict | AsyncIterator[str]:
    prompts = []
    for position, prompt in enumerate(req.prompts):
        field = "prompt" if len(req.prompts) == 1 else f"prompt[{position}]"
        ids = encode_text(engine, prompt, field) if isinstance(prompt, str) else list(prompt)
        prompts.append((f"cmpl-{uuid.uuid4().hex}", ids, _params(engine, req, ids, field, req.max_tokens)))
    rid = prompts[0][0]
    if req.stream:
        return _completion_stream(engine, req, prompts, rid)
    per_prompt = await asyncio.gather(*(engine.generate_full(ids, p, r) for r, ids, p in prompts))
    choices, flat = [], []
    for position, results in enumerate(per_prompt):
        for result in results:
            flat.append(result)
            choice = {
                "index": position * req.n + result.index,
                "text": result.text,
                "logprobs": (
                    _completion_logprobs(engine, result.output_ids, result.logprobs, 0)
                    if req.logprobs is not None
                    else None
                ),
                "finish_reason": finish_reason(result.finish_reason),
                "matched_stop": (result.finish_reason or {}).get("matched"),
            }
            if req.return_token_ids:
                choice["token_ids"] = list(result.output_ids)
                choice["prompt_token_ids"] = prompts[position][1]
            choices.append(choice)
    response = _envelope(engine, rid, "text_completion", choices, flat)
    response["usage"] = _usage(flat, sum(len(ids) for _, ids, _ in prompts))
    return response


def _completion_logprobs(
    engine: AsyncEngine, token_ids: list[int], logprobs: list[float], text_offset: int
) -> dict:
    tokens = [token_text(engine.tokenizer, t) for t in token_ids]
    offsets, position = [], text_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


async def _completion_stream(engine: AsyncEngine, req: CompletionRequest, prompts: list,
                             rid: str) -> AsyncIterator[str]:  # fmt: skip
    created = int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created,
                    "model": engine.served_model_name, "choices": choices, **extra})  # fmt: skip

    sent_chars: dict[int, int] = {}
    num_completion_tokens = 0
    try:
        streams = [engine.generate(ids, params, r) for r, ids, params in prompts]
        async for position, delta in merge_streams(streams):
            index = position * req.n + delta.index
            offset = sent_chars.get(index, 0)
            logprobs = None
            if req.logprobs is not None:
                logprobs = _completion_logprobs(engine, delta.token_ids, delta.logprobs, offset)
            sent_chars[index] = offset + len(delta.text)
            num_completion_tokens += len(delta.token_ids)
            choice = {"index": index, "text": delta.text, "logprobs": logprobs,
                      "finish_reason": finish_reason(delta.finish_reason)}  # fmt: skip
            yield chunk([choice], weight_version=delta.weight_version)
        if req.include_usage:
            num_prompt_tokens = sum(len(ids) for _, ids, _ in prompts)
            usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                     "total_tokens": num_prompt_tokens + num_completion_tokens}  # fmt: skip
            yield chunk([], usage=usage)
    except Exception as error:
        yield sse_error(error)
    yield sse("[DONE]")
