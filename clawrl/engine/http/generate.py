"""SGLang's `POST /generate`: its request models, its handler, and what every route of the app shares.

Request (`GenerateRequest`): one prompt (`text` or `input_ids`) or a batch, `sampling_params` (for a batch also
a list, one per prompt, as SGLang allows), `stream`, ...
Response item (one per prompt and sample; a batch or n > 1 gives a list, prompt-major):

    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort",
     ...}, "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
     "output_token_logprobs": [[logprob, token_id, text_or_null], ...]  (with return_logprob),
     "output_top_logprobs": [[[logprob, token_id, text_or_null], ...] per output token]  (top_logprobs_num > 0),
     "input_token_logprobs": [[logprob or null, token_id, text_or_null] per prompt token from
        logprob_start_len]  (logprob_start_len >= 0; the first prompt token has null),
     "input_top_logprobs": [null or [[logprob, token_id, text_or_null], ...] per prompt token]  (both),
     "output_token_weight_versions": [str, ...]  (with return_logprob),
     "output_token_logprobs_b64": str, "output_token_weight_version_runs": [[str, count], ...]  (clawrl's
        `compact_logprobs`: instead of output_token_logprobs and output_token_weight_versions, the logprobs
        of output_ids as clawrl.fast_json.pack_floats and the versions as runs; the rollout asks its own
        engines for them: ~2x less CPU per answer on the server, ~3x on the client),
     "received_at", "finished_at", "answered_at"  (clawrl's, non-streaming: time.monotonic() of this host
        when the handler got the request, the engine finished it, the answer was built; a client on the
        same host compares them with its own monotonic clock: clawrl/rollout/timeline.py)}}

Streaming follows SGLang's default (non-incremental) output: every `data:` chunk carries the item so far
(cumulative text, output_ids and logprobs), chunks of different items are told apart by "index", and
the stream ends with `data: [DONE]`.

Shared by every route (openai.py and app.py import them from here): `read_request` parses a JSON body into
a request model. The models check JSON types only, with messages naming the field and the bad value
("sampling_params.max_new_tokens must be an integer, got '8'"); the values of the sampling fields are then
checked by the engine's one rule table (core/request.py), under the route's own field names. Either
failure is one RequestError, which the app answers with HTTP 400. `/generate` models forbid unknown fields
(a typo such as `max_new_token` must not be silently ignored); they accept SGLang fields that slime sends and
that have no effect here (`spaces_between_special_tokens`, `custom_params`) and reject the SGLang features
this engine lacks (constrained decoding, hidden states, images, LoRA) unless they hold their neutral value.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clawrl import fast_json
from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.core.request import (
    GenerationResult,
    RequestError,
    SamplingParams,
    check_prompt,
    sampling_value_errors,
)

router = APIRouter()


# ---------------------------------------------------------------------------------------------------
# parsing requests (every route)

_TYPE_PHRASES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "missing": "is required",
    "extra_forbidden": "is not a known field",
    "json_invalid": "is not valid JSON",
}
_BOUND_PHRASES = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_BOUND_KEYS = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le", "less_than": "lt"}


def _field_path(loc: tuple, skip_prefix: tuple = ("body",)) -> str:
    parts = list(loc)
    if parts and parts[0] in skip_prefix:
        parts = parts[1:]
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def describe_error(error: dict) -> str:
    """One pydantic error dict -> "field.path must ..., got <value>"."""
    path = _field_path(tuple(error.get("loc", ())))
    kind = error.get("type", "")
    if kind == "value_error":
        phrase = str(error.get("msg", "")).removeprefix("Value error, ")
        # Validators that know a deeper path (messages[2].role) write it themselves.
        return f"{path} {phrase}" if path and not phrase.startswith(path) else phrase
    if kind in _BOUND_PHRASES:
        phrase = f"must be {_BOUND_PHRASES[kind]} {error['ctx'][_BOUND_KEYS[kind]]}"
    elif kind == "literal_error":
        phrase = f"must be one of {error['ctx']['expected']}"
    else:
        phrase = _TYPE_PHRASES.get(kind, str(error.get("msg", "is invalid")).lower())
    name = path or "request body"
    if kind in ("missing", "extra_forbidden"):
        return f"{name} {phrase}"
    return f"{name} {phrase}, got {error.get('input')!r}"


def format_validation_error(errors: list[dict]) -> str:
    """All errors of one request, one per clause; the first names the field a caller fixes first."""
    return "; ".join(describe_error(error) for error in errors)


def parse_request(model: type[RequestModel], body: Any) -> Any:
    """Validate a JSON body into `model` (types), then its sampling values; RequestError names the field."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as error:
        raise RequestError(format_validation_error(error.errors())) from None
    errors = req.value_errors()
    if errors:
        raise RequestError("; ".join(errors))
    return req


async def read_request(request: Request, model: type[RequestModel]) -> Any:
    """The HTTP request's JSON body as `model` (an empty body is `{}`)."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    return parse_request(model, data)


class FastJSONResponse(Response):
    """A JSON response rendered with orjson (clawrl/fast_json.py; FastAPI's JSONResponse uses the standard library)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return fast_json.dumps(content)


def respond(result: Any) -> Any:
    """A handler's result as JSON, or as a server-sent event stream."""
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return FastJSONResponse(result)


def _normalise_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [item for item in value if item]
    raise ValueError(f"must be a string or a list of strings, got {value!r}")


def _logit_bias_map(value: Any) -> dict[int, Any] | None:
    # JSON object keys are strings: OpenAI clients send {"1234": 5.0}.
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"must be an object mapping token ids to biases, got {clip_repr(value)}")
    out = {}
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if token is None:
            raise ValueError(f"must map token ids to biases; key {key!r} is not a token id")
        out[token] = bias
    return out


def _token_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if not is_token_list(value):
        raise ValueError(f"must be a list of integer token ids, got {value!r}")
    return value


def is_token_list(value: Any) -> bool:
    """A list of ints (bools excluded)."""
    if not isinstance(value, list):
        return False
    if set(map(type, value)) <= {int}:  # the common case in one C-level pass
        return True
    # int subclasses other than bool (an IntEnum) pass here
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def clip_repr(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RequestModel(BaseModel):
    """A request body; `value_errors` lists bad values that JSON types cannot express (none by default)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    def value_errors(self) -> list[str]:
        return []


class LenientRequest(RequestModel):
    # Control routes: SGLang clients may send fields we do not use (load_format, is_async, ...).
    model_config = ConfigDict(strict=True, extra="ignore")


class SamplingFields(RequestModel):
    """Sampling knobs shared by /generate and the OpenAI routes. Types are checked here; values by the
    engine's rule table (core/request.py), named as the route names them."""

    value_prefix: ClassVar[str] = ""
    """What the route's field names start with ("sampling_params." for /generate)."""
    rule_of: ClassVar[dict[str, str]] = {}
    """Route field -> the SamplingParams field whose rule applies (OpenAI's max_tokens -> max_new_tokens)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: Any = Field(default_factory=list)
    stop_token_ids: Any = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Any = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, Any] | None:
        return _logit_bias_map(value)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        return _normalise_stop(value)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> list[int]:
        return _token_id_list(value)

    def value_errors(self) -> list[str]:
        # None means "the route's default" (max_new_tokens: up to the context; seed: none).
        values = {name: getattr(self, name) for name in type(self).model_fields}
        values = {name: value for name, value in values.items() if value is not None}
        return sampling_value_errors(values, prefix=self.value_prefix, rule_of=self.rule_of)

    def min_new_tokens_value(self) -> int:
        """The route's minimum output length (min_new_tokens or min_tokens; 0 when it has none)."""
        return 0

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """The core's SamplingParams, with max_new_tokens already fitted to the context (check_prompt)."""
        return SamplingParams(
            min_new_tokens=min(self.min_new_tokens_value(), max_new_tokens),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}),
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            n=self.n,
            seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
        )


# ---------------------------------------------------------------------------------------------------
# the /generate request


class GenerateSamplingParams(SamplingFields):
    """SGLang `sampling_params`: max_new_tokens None means "up to the model's context"."""

    value_prefix: ClassVar[str] = "sampling_params."

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    # Accepted for slime/SGLang compatibility; they do not change what this engine does.
    spaces_between_special_tokens: bool = True
    custom_params: dict | None = None
    # SGLang features this engine lacks: accepted only at their neutral value.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def min_new_tokens_value(self) -> int:
        return self.min_new_tokens

    @field_validator("regex", "json_schema", "ebnf")
    @classmethod
    def _no_constraints(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("(constrained decoding) is not supported by this engine")
        return value


class GenerateRequest(RequestModel):
    """SGLang `POST /generate`: one prompt (`text` or `input_ids`) or a batch of them."""

    text: Any = None
    input_ids: Any = None
    # A batch may give one sampling_params per prompt (SGLang's list form: per-sample seeds, for one).
    sampling_params: Any = GenerateSamplingParams()
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    compact_logprobs: bool = False  # clawrl's: the output logprobs packed (module docstring); SGLang has none
    stream: bool = False
    rid: Any = None
    # With return_logprob: the prompt's logprobs from this position (-1: none), and the top alternatives.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    image_data: Any = None
    lora_path: Any = None

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _sampling_params(cls, value: Any) -> GenerateSamplingParams | list[GenerateSamplingParams]:
        # Validated by hand (not as a pydantic union) so an error names the one field path a caller wrote.
        if isinstance(value, GenerateSamplingParams):
            return value
        if isinstance(value, list):
            return [_sampling_entry(item, f"sampling_params[{i}]") for i, item in enumerate(value)]
        return _sampling_entry(value, "sampling_params")

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        if self.text is not None and not (
            isinstance(self.text, str)
            or (isinstance(self.text, list) and self.text and all(isinstance(t, str) for t in self.text))
        ):
            raise ValueError(f"text must be a string or a non-empty list of strings, got {self.text!r}")
        if self.input_ids is not None and not (
            (is_token_list(self.input_ids) and self.input_ids)
            or (
                isinstance(self.input_ids, list)
                and self.input_ids
                and all(is_token_list(ids) for ids in self.input_ids)
            )
        ):
            raise ValueError(
                "input_ids must be a non-empty list of integer token ids or a list of such lists, "
                f"got {clip_repr(self.input_ids)}"
            )
        self._check_unsupported()
        if self.compact_logprobs and self.return_text_in_logprobs:
            raise ValueError("compact_logprobs packs the logprobs without token texts: "
                             "send return_text_in_logprobs false with it")  # fmt: skip
        self._check_rid()
        self._check_sampling_list()
        return self

    def _check_sampling_list(self) -> None:
        specs = self.sampling_params
        if not isinstance(specs, list):
            return
        if not self.is_batch:
            raise ValueError("sampling_params may be a list only for a batch of prompts")
        if len(specs) != len(self.prompts):
            raise ValueError(
                f"sampling_params has {len(specs)} entries for a batch of {len(self.prompts)} prompts"
            )
        if len({spec.n for spec in specs}) > 1:
            raise ValueError(
                f"sampling_params[].n must be the same for every prompt, got {[s.n for s in specs]}"
            )

    def spec(self, position: int) -> GenerateSamplingParams:
        """The sampling params of prompt `position` (the one dict, or its entry of the list)."""
        specs = self.sampling_params
        return specs[position] if isinstance(specs, list) else specs

    @property
    def n(self) -> int:
        """Samples per prompt (the same for every prompt of a batch)."""
        return self.spec(0).n

    def value_errors(self) -> list[str]:
        values = {"logprob_start_len": self.logprob_start_len, "top_logprobs_num": self.top_logprobs_num}
        specs = self.sampling_params
        if isinstance(specs, list):
            errors = [error.replace("sampling_params.", f"sampling_params[{i}].", 1)
                      for i, spec in enumerate(specs) for error in spec.value_errors()]  # fmt: skip
        else:
            errors = specs.value_errors()
        return errors + sampling_value_errors(values)

    def _check_unsupported(self) -> None:
        for name in ("return_hidden_states", "return_routed_experts"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this engine")
        for name in ("image_data", "lora_path"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this engine")

    def _check_rid(self) -> None:
        if self.rid is None:
            return
        if self.is_batch:
            if not (isinstance(self.rid, list) and all(isinstance(r, str) for r in self.rid)):
                raise ValueError(f"rid must be a list of strings for a batch request, got {self.rid!r}")
            if len(self.rid) != len(self.prompts):
                raise ValueError(f"rid has {len(self.rid)} ids for a batch of {len(self.prompts)} prompts")
            if len(set(self.rid)) != len(self.rid):
                raise ValueError(f"rid must not repeat an id within a batch, got {self.rid!r}")
        elif not isinstance(self.rid, str):
            raise ValueError(f"rid must be a string, got {self.rid!r}")

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return isinstance(self.input_ids[0], list)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt as given: text, or token ids."""
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        return list(self.input_ids) if self.is_batch else [self.input_ids]

    @property
    def prompt_field(self) -> str:
        return "text" if self.text is not None else "input_ids"

    def request_ids(self) -> list[str | None]:
        if self.rid is None:
            return [None] * len(self.prompts)
        return list(self.rid) if self.is_batch else [self.rid]


def _sampling_entry(value: Any, path: str) -> GenerateSamplingParams:
    """One sampling_params object; a type error becomes one ValueError naming `path`.field."""
    if not isinstance(value, dict):
        raise ValueError(f"{path} must be an object, got {clip_repr(value)}")
    try:
        return GenerateSamplingParams.model_validate(value)
    except ValidationError as error:
        clauses = [describe_error({**e, "loc": (path, *e.get("loc", ()))}) for e in error.errors()]
        raise ValueError("; ".join(clauses)) from None


# ---------------------------------------------------------------------------------------------------
# helpers of every generating route


def sse(payload: Any) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    data = payload if isinstance(payload, str) else fast_json.dumps(payload).decode()
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


# ---------------------------------------------------------------------------------------------------
# the /generate handler


@router.post("/generate")
async def generate_route(request: Request):
    req = await read_request(request, GenerateRequest)
    return respond(await generate(request.app.state.engine, req))


def _prepare(engine: AsyncEngine, req: GenerateRequest) -> list[tuple[str, list[int], SamplingParams]]:
    """Tokenize, check every prompt against the model, resolve ids and max_new_tokens."""
    prompts: list[tuple[str, list[int], SamplingParams]] = []
    for position, (prompt, rid) in enumerate(zip(req.prompts, req.request_ids(), strict=True)):
        spec = req.spec(position)
        requested = -1 if spec.max_new_tokens is None else spec.max_new_tokens
        field = req.prompt_field + (f"[{position}]" if req.is_batch else "")
        ids = encode_text(engine, prompt, field) if isinstance(prompt, str) else list(prompt)
        max_new = check_prompt(ids, field=field, vocab_size=engine.vocab_size, context_len=engine.context_len,
                               max_new_tokens=requested)  # fmt: skip
        params = spec.sampling_params(max_new)
        if req.return_logprob:
            params.logprob_start_len, params.top_logprobs_num = req.logprob_start_len, req.top_logprobs_num
        prompts.append((rid or uuid.uuid4().hex, ids, params))
    engine.check_alive()
    return prompts


def generate_item(
    result: GenerationResult, req: GenerateRequest, tokenizer: Any, started: float,
    prompt_logprobs: list | None = None,
) -> dict:  # fmt: skip
    """One SGLang response item from a (possibly partial) result; `prompt_logprobs` are those of the
    request's sample 0 (every sample of a request reports them, as SGLang does)."""
    meta: dict[str, Any] = {
        "id": result.request_id,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "weight_version": result.weight_version,
        "e2e_latency": round(time.monotonic() - started, 6),
    }
    if result.finished_at is not None:  # clawrl's answer-path stamps (non-streaming requests)
        meta.update(received_at=started, finished_at=result.finished_at, answered_at=time.monotonic())
    if req.return_logprob:
        meta.update(_logprob_meta(result, req, tokenizer, prompt_logprobs))
        if req.compact_logprobs:
            meta["output_token_weight_version_runs"] = fast_json.version_runs(result.weight_versions)
        else:
            meta["output_token_weight_versions"] = list(result.weight_versions)
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta}


def _logprob_meta(
    result: GenerationResult, req: GenerateRequest, tokenizer: Any, prompt: list | None
) -> dict:
    """SGLang's logprob fields: [logprob, token id, text or null] per token; top lists per position."""

    def entry(logprob: float | None, token: int) -> list:
        return [logprob, token, token_text(tokenizer, token) if req.return_text_in_logprobs else None]

    def tops(pairs: list | None) -> list | None:
        return None if pairs is None else [entry(logprob, token) for logprob, token in pairs]

    tokens, logprobs = result.output_ids, result.logprobs
    if len(logprobs) != len(tokens):
        raise ValueError(f"request {result.request_id}: {len(logprobs)} logprobs for {len(tokens)} tokens")
    meta: dict[str, Any]
    if req.compact_logprobs:  # the rollout's own engines: the logprobs of output_ids, packed
        meta = {"output_token_logprobs_b64": fast_json.pack_floats(logprobs)}
    elif req.return_text_in_logprobs:
        meta = {"output_token_logprobs": [entry(lp, t) for lp, t in zip(logprobs, tokens, strict=True)]}
    else:  # every token of every sample: tuples built by zip in C (JSON arrays alike)
        triples = zip(logprobs, tokens, itertools.repeat(None, len(tokens)), strict=True)
        meta = {"output_token_logprobs": list(triples)}
    if req.top_logprobs_num > 0:
        meta["output_top_logprobs"] = [tops(pairs) for pairs in result.top_logprobs]
    if req.logprob_start_len >= 0:
        start, scored = req.logprob_start_len, prompt or []
        prompt_ids = result.prompt_ids[start:] if result.prompt_ids else []
        meta["input_token_logprobs"] = [entry(lp, t) for (lp, _), t in zip(scored, prompt_ids, strict=False)]
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [tops(top) for _, top in scored]
    return meta


async def generate(engine: AsyncEngine, req: GenerateRequest) -> dict | list[dict] | AsyncIterator[str]:
    """The whole `/generate` route: items (single dict for one prompt with n == 1) or an SSE stream."""
    started = time.monotonic()  # e2e_latency and received_at count from here (tokenisation included)
    prompts = _prepare(engine, req)
    if req.stream:
        return _stream(engine, req, prompts, started)
    per_prompt = await asyncio.gather(*(engine.generate_full(ids, p, rid) for rid, ids, p in prompts))
    items = []
    for (_, ids, _), results in zip(prompts, per_prompt, strict=True):
        for result in results:
            result.prompt_ids = ids
            items.append(generate_item(result, req, engine.tokenizer, started, results[0].prompt_logprobs))
    single = not req.is_batch and req.n == 1
    return items[0] if single else items


async def _stream(
    engine: AsyncEngine, req: GenerateRequest, prompts: list, started: float
) -> AsyncIterator[str]:
    n = req.n
    results: dict[int, GenerationResult] = {}
    scored: dict[int, list] = {}  # prompt position -> its sample 0's prompt logprobs
    streams = [engine.generate(ids, params, rid) for rid, ids, params in prompts]
    try:
        async for position, delta in merge_streams(streams):
            index = position * n + delta.index
            result = results.setdefault(
                index, GenerationResult(request_id=delta.request_id, index=delta.index)
            )
            result.prompt_ids = prompts[position][1]
            result.add(delta)
            if delta.prompt_logprobs is not None:
                scored[position] = delta.prompt_logprobs
            item = generate_item(result, req, engine.tokenizer, started, scored.get(position))
            if req.is_batch or n > 1:
                item["index"] = index
            yield sse(item)
    except Exception as error:
        yield sse_error(error)
    yield sse("[DONE]")
