"""OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Chat prompts are rendered by the model's own chat template (tokenizer_config.json) with `tools` passed to
it, then tokenized without adding special tokens (the template already wrote them). Streaming is real: one
SSE chunk per engine step per sample (token by token), ending with `data: [DONE]`.

Logprobs (`logprobs`, `top_logprobs` / completions' `logprobs: k`), penalties, `logit_bias` and `n` follow
OpenAI's shapes. With `tools` in a chat request, a finished turn is parsed for tool calls, in Qwen's format
(`<tool_call>{json}</tool_call>`, through clawrl/rollout/tool_parse.py) or Llama 3's (the turn one JSON
object {"name", "parameters"}): they become `message.tool_calls` and the finish reason "tool_calls". With
`separate_reasoning` (or the server's `reasoning_parser`), `<think>...</think>` becomes
`message.reasoning_content` (SGLang's field) and the content is what follows.

Extensions over OpenAI's schema (ignored by the `openai` package, read by clawrl's own tools):
- every response carries `weight_version` (the version of the last generated token);
- `return_token_ids: true` adds `prompt_token_ids` and per-choice `token_ids` (vLLM's field names);
- SGLang sampling knobs are accepted: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
  ignore_eos, skip_special_tokens, no_stop_trim, separate_reasoning, and `chat_template_kwargs` for the
  template (e.g. enable_thinking).

Request models (types only, unknown fields ignored: agent frameworks send many optional ones) sit next to
their handlers; they reject the known fields we cannot honour (echo, suffix, best_of != n, non-text
response_format). Sampling values are checked by the engine's rule table under OpenAI's names (max_tokens, ...).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from pydantic import ConfigDict, field_validator, model_validator

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.core.request import GenerationResult, RequestError, SamplingParams, check_prompt
from clawrl.engine.http.generate import (
    SamplingFields,
    clip_repr,
    encode_text,
    is_token_list,
    merge_streams,
    read_request,
    respond,
    sse,
    sse_error,
    token_text,
)
from clawrl.rollout.tool_parse import TOOL_CALL_OPEN, ToolCall, parse_tool_calls

router = APIRouter()

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


# ---------------------------------------------------------------------------------------------------
# routes


@router.post("/v1/chat/completions")
async def chat_completions_route(request: Request):
    req = await read_request(request, ChatCompletionRequest)
    if req.separate_reasoning is None:  # the server's --reasoning-parser (SGLang's flag) turns it on
        req.separate_reasoning = getattr(request.app.state, "reasoning_parser", None) is not None
    return respond(await chat_completions(request.app.state.engine, req))


@router.post("/v1/completions")
async def completions_route(request: Request):
    req = await read_request(request, CompletionRequest)
    return respond(await completions(request.app.state.engine, req))


@router.get("/v1/models")
async def models_route(request: Request):
    return models(request.app.state.engine)


# ---------------------------------------------------------------------------------------------------
# request models


class _OpenAICommon(SamplingFields):
    """Fields shared by chat completions and completions."""

    # OpenAI clients send many optional fields we do not use; unknown ones are ignored, not rejected.
    model_config = ConfigDict(strict=True, extra="ignore")
    rule_of: ClassVar[dict[str, str]] = {
        "max_tokens": "max_new_tokens",
        "max_completion_tokens": "max_new_tokens",
        "min_tokens": "min_new_tokens",
    }

    model: str = ""
    stream: bool = False
    stream_options: dict | None = None
    min_tokens: int = 0
    user: str | None = None
    return_token_ids: bool = False

    def min_new_tokens_value(self) -> int:
        return self.min_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


def _check_message(index: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, got {clip_repr(message)}")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise ValueError(
            f"messages[{index}].role must be one of system, user, assistant, tool, developer, got {role!r}"
        )
    content = message.get("content")
    if isinstance(content, list):
        # Text parts are joined: the chat templates of text models expect a string.
        texts = []
        for part_index, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"messages[{index}].content[{part_index}] must be a text part "
                    f'{{"type": "text", "text": ...}}, got {clip_repr(part)}'
                )
            texts.append(part["text"])
        message = {**message, "content": "".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise ValueError(
            f"messages[{index}].content must be a string or a list of text parts, got {clip_repr(content)}"
        )
    return message


class ChatCompletionRequest(_OpenAICommon):
    """OpenAI `POST /v1/chat/completions`; `tools` are passed to the model's chat template."""

    messages: list[Any]
    tools: list[dict] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None
    response_format: dict | None = None
    separate_reasoning: bool | None = None
    """Split `<think>...</think>` into message.reasoning_content (None: the server's --reasoning-parser)."""

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[Any]) -> list[dict]:
        if not value:
            raise ValueError("must hold at least one message")
        return [_check_message(index, message) for index, message in enumerate(value)]

    @model_validator(mode="after")
    def _unsupported_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and (self.top_logprobs < 0 or self.top_logprobs > 20):
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(
                f"response_format {self.response_format.get('type')!r} is not supported (only text)"
            )
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_OpenAICommon):
    """OpenAI `POST /v1/completions` (legacy text completions)."""

    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        ok = (
            (isinstance(value, str))
            or (isinstance(value, list) and value and all(isinstance(p, str) for p in value))
            or (is_token_list(value) and value)
            or (isinstance(value, list) and value and all(is_token_list(p) and p for p in value))
        )
        if not ok:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                f"got {clip_repr(value)}"
            )
        return value

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20] (top alternatives per token), got {self.logprobs}")
        if self.echo:
            raise ValueError("echo is not supported by this engine")
        if self.suffix:
            raise ValueError("suffix is not supported by this engine")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of is not supported by this engine (only equal to n), got {self.best_of}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or is_token_list(self.prompt):
            return [self.prompt]
        return list(self.prompt)


# ---------------------------------------------------------------------------------------------------
# responses


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
    engine.check_alive()
    return req.sampling_params(fitted)


def _usage(results: list[GenerationResult], prompt_tokens: int) -> dict:
    completion = sum(r.completion_tokens for r in results)
    cached = max((r.cached_tokens for r in results), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_logprob(tokenizer: Any, token: int, logprob: float, top: list | None = None) -> dict:
    text = token_text(tokenizer, token)
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    alternatives = [_token_logprob(tokenizer, t, lp) for lp, t in top or []]
    return {**entry, "top_logprobs": alternatives}


# ---------------------------------------------------------------------------------------------------
# tool calls and reasoning in the generated text


def parse_tool_call_text(text: str) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls) of an assistant turn in Qwen's format (`<tool_call>{...}
    </tool_call>`, parsed by clawrl/rollout/tool_parse.py) or Llama 3's (the whole turn one JSON object
    {"name", "parameters"}, or several joined by ";", optionally after <|python_tag|>). A turn whose calls
    do not all parse is plain content: ([text], [])."""
    if TOOL_CALL_OPEN in text:
        calls = parse_tool_calls(text)
        if calls and all(isinstance(call, ToolCall) for call in calls):
            return text[: text.find(TOOL_CALL_OPEN)].strip(), calls
        return text, []
    calls = _llama_tool_calls(text)
    return ("", calls) if calls else (text, [])


def _llama_tool_calls(text: str) -> list[ToolCall] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    for index, part in enumerate(p for p in body.split(";") if p.strip()):
        try:
            data = json.loads(part)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("parameters", data.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(index=index, name=data["name"], arguments=arguments))
    return calls or None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of `<think>reasoning</think>content`; the opening tag may sit in the prompt
    (Qwen3's template writes it), and a turn cut off inside the reasoning has no content yet."""
    if THINK_CLOSE in text:
        reasoning, content = text.split(THINK_CLOSE, 1)
        return reasoning.replace(THINK_OPEN, "", 1).strip(), content.strip()
    if text.lstrip().startswith(THINK_OPEN):
        return text.lstrip()[len(THINK_OPEN) :].strip(), ""
    return None, text


def assistant_message(
    text: str, reason: dict | None, *, tools: bool, reasoning: bool
) -> tuple[dict, str | None]:
    """The chat message of a finished turn, and its OpenAI finish reason ("tool_calls" when it calls tools)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = finish_reason(reason)
    if reasoning:
        message["reasoning_content"], message["content"] = split_reasoning(text)
    if tools:
        content, calls = parse_tool_call_text(message["content"])
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "index": call.index, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                for call in calls
            ]  # fmt: skip
            finish = "tool_calls" if finish == "stop" else finish
    return message, finish


# ---------------------------------------------------------------------------------------------------
# chat completions


async def chat_completions(engine: AsyncEngine, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
    prompt_ids = render_chat_prompt(engine, req)
    params = _params(engine, req, prompt_ids, "messages", req.max_new_tokens)
    params.top_logprobs_num = (req.top_logprobs or 0) if req.logprobs else 0
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        return _chat_stream(engine, req, prompt_ids, params, rid)
    results = await engine.generate_full(prompt_ids, params, rid)
    choices = []
    for result in results:
        message, finish = assistant_message(
            result.text, result.finish_reason, tools=bool(req.tools), reasoning=bool(req.separate_reasoning)
        )
        choice = {
            "index": result.index,
            "message": message,
            "logprobs": _chat_logprobs(engine, result) if req.logprobs else None,
            "finish_reason": finish,
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


def _chat_logprobs(engine: AsyncEngine, part: Any) -> dict:
    """OpenAI's chat `logprobs` of a result or delta (its token_ids / output_ids, logprobs, top_logprobs)."""
    token_ids = part.output_ids if isinstance(part, GenerationResult) else part.token_ids
    tops = part.top_logprobs or [None] * len(token_ids)
    return {
        "content": [
            _token_logprob(engine.tokenizer, t, lp, top)
            for t, lp, top in zip(token_ids, part.logprobs, tops, strict=True)
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
            content, finish = _stream_delta(req, results[delta.index], delta)
            choice = {
                "index": delta.index,
                "delta": content,
                "logprobs": _chat_logprobs(engine, delta) if req.logprobs else None,
                "finish_reason": finish,
            }
            yield chunk([choice], weight_version=delta.weight_version)
        if req.include_usage:
            yield chunk([], usage=_usage(list(results.values()), len(prompt_ids)))
    except Exception as error:
        yield sse_error(error)
    yield sse("[DONE]")


def _stream_delta(
    req: ChatCompletionRequest, result: GenerationResult, delta: Any
) -> tuple[dict, str | None]:
    """A chunk's `delta` and finish reason. Tool calls and the reasoning split need the whole turn: with
    `tools` or separate_reasoning the text is held back and sent, parsed, in the sample's last chunk."""
    if not (req.tools or req.separate_reasoning):
        return {"content": delta.text}, finish_reason(delta.finish_reason)
    if not delta.finished:
        return {"content": ""}, None
    message, finish = assistant_message(
        result.text, delta.finish_reason, tools=bool(req.tools), reasoning=bool(req.separate_reasoning)
    )
    return {key: value for key, value in message.items() if key != "role"}, finish


# ---------------------------------------------------------------------------------------------------
# completions


async def completions(engine: AsyncEngine, req: CompletionRequest) -> dict | AsyncIterator[str]:
    prompts = []
    for position, prompt in enumerate(req.prompts):
        field = "prompt" if len(req.prompts) == 1 else f"prompt[{position}]"
        ids = encode_text(engine, prompt, field) if isinstance(prompt, str) else list(prompt)
        params = _params(engine, req, ids, field, req.max_tokens)
        params.top_logprobs_num = req.logprobs or 0
        prompts.append((f"cmpl-{uuid.uuid4().hex}", ids, params))
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
                    _completion_logprobs(engine, result.output_ids, result.logprobs, 0, result.top_logprobs)
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
    engine: AsyncEngine,
    token_ids: list[int],
    logprobs: list[float],
    text_offset: int,
    tops: list | None = None,
) -> dict:
    """OpenAI's legacy shape; `top_logprobs` is one {token text: logprob} per token when logprobs > 0."""
    tokens = [token_text(engine.tokenizer, t) for t in token_ids]
    offsets, position = [], text_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    top_maps = None
    if tops:
        top_maps = [{token_text(engine.tokenizer, t): lp for lp, t in pairs} for pairs in tops]
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }


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
                logprobs = _completion_logprobs(
                    engine, delta.token_ids, delta.logprobs, offset, delta.top_logprobs
                )
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
