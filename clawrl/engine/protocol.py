"""Request models of the engine's HTTP API: SGLang's `/generate` and OpenAI's `/v1/chat/completions`,
`/v1/completions`, plus the control routes.

Every model validates its fields with messages that name the field and the bad value
("sampling_params.max_new_tokens must be >= 0, got -1"); `format_validation_error` turns pydantic's
error list into that one line, so a bad request becomes one HTTP 400 the caller can act on.

`/generate` models forbid unknown fields (a typo such as `max_new_token` must not be silently ignored);
they accept SGLang fields that slime sends and that have no effect here (`spaces_between_special_tokens`,
`logprob_start_len`, `custom_params`) and reject the SGLang features this engine lacks unless they hold
their neutral value. OpenAI models ignore unknown fields (agent frameworks send many optional ones) but
reject the known ones we cannot honour (penalties, logit_bias, top-k alternatives).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clawrl.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A bad request: the message names the field and the bad value; the server answers HTTP 400."""

    status_code = 400


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve (stuck step, crashed thread, shut down); the server answers HTTP 503."""

    status_code = 503


# ---------------------------------------------------------------------------------------------------
# validation messages

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


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into `model`, raising RequestError with a field-naming message."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise RequestError(format_validation_error(error.errors())) from None


# ---------------------------------------------------------------------------------------------------
# shared field checks (each raises ValueError with the phrase after the field name)


def _normalise_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [item for item in value if item]
    raise ValueError(f"must be a string or a list of strings, got {value!r}")


def _check_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"must be a list of integer token ids, got {value!r}")
    bad = [t for t in value if t < 0]
    if bad:
        raise ValueError(f"must hold token ids >= 0, got {bad[0]}")
    return value


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    # Control routes: SGLang clients may send fields we do not use (load_format, is_async, ...).
    model_config = ConfigDict(strict=True, extra="ignore")


class _SamplingFields(BaseModel):
    """Sampling knobs shared by /generate and the OpenAI routes (validated once, here)."""

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

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if value < 0:
            raise ValueError(f"must be >= 0 (0 means greedy), got {value!r}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"must be in (0, 1], got {value!r}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"must be -1 or 0 (off) or >= 1, got {value!r}")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise ValueError(f"must be in [0, 1), got {value!r}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value!r}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        return _normalise_stop(value)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> list[int]:
        return _check_token_ids(value)

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """The core's SamplingParams, with max_new_tokens already fitted to the context (check_prompt)."""
        return SamplingParams(
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
# SGLang /generate


class GenerateSamplingParams(_SamplingFields):
    """SGLang `sampling_params`: max_new_tokens None means "up to the model's context"."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = 128
    # Accepted for slime/SGLang compatibility; they do not change what this engine does.
    spaces_between_special_tokens: bool = True
    custom_params: dict | None = None
    # SGLang features this engine lacks: accepted only at their neutral value.
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value!r}")
        return value

    @field_validator("min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty")
    @classmethod
    def _neutral_only(cls, value: float, info: Any) -> float:
        neutral = cls.model_fields[info.field_name].default
        if value != neutral:
            raise ValueError(f"is not supported by this engine (only {neutral!r}), got {value!r}")
        return value

    @field_validator("regex", "json_schema", "ebnf")
    @classmethod
    def _no_constraints(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("(constrained decoding) is not supported by this engine")
        return value


class GenerateRequest(_Strict):
    """SGLang `POST /generate`: one prompt (`text` or `input_ids`) or a batch of them."""

    text: Any = None
    input_ids: Any = None
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Any = None
    # Accepted for compatibility; input-token logprobs are not computed by this engine.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    image_data: Any = None
    lora_path: Any = None

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
            (_is_token_list(self.input_ids) and self.input_ids)
            or (
                isinstance(self.input_ids, list)
                and self.input_ids
                and all(_is_token_list(ids) for ids in self.input_ids)
            )
        ):
            raise ValueError(
                "input_ids must be a non-empty list of integer token ids or a list of such lists, "
                f"got {_short(self.input_ids)}"
            )
        self._check_unsupported()
        self._check_rid()
        return self

    def _check_unsupported(self) -> None:
        if self.top_logprobs_num:
            raise ValueError(
                f"top_logprobs_num is not supported by this engine (only 0), got {self.top_logprobs_num}"
            )
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


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------
# OpenAI


class _OpenAICommon(_SamplingFields):
    """Fields shared by chat completions and completions."""

    # OpenAI clients send many optional fields we do not use; unknown ones are ignored, not rejected.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = ""
    stream: bool = False
    stream_options: dict | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _unsupported_penalties(self) -> _OpenAICommon:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported by this engine (only 0), got {value!r}")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this engine")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


def _check_message(index: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, got {_short(message)}")
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
                    f'{{"type": "text", "text": ...}}, got {_short(part)}'
                )
            texts.append(part["text"])
        message = {**message, "content": "".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise ValueError(
            f"messages[{index}].content must be a string or a list of text parts, got {_short(content)}"
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

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[Any]) -> list[dict]:
        if not value:
            raise ValueError("must hold at least one message")
        return [_check_message(index, message) for index, message in enumerate(value)]

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _unsupported_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise ValueError(
                f"top_logprobs is not supported by this engine (only 0: the sampled tokens' logprobs), "
                f"got {self.top_logprobs}"
            )
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
            or (_is_token_list(value) and value)
            or (isinstance(value, list) and value and all(_is_token_list(p) and p for p in value))
        )
        if not ok:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                f"got {_short(value)}"
            )
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        if self.logprobs is not None and self.logprobs != 0:
            raise ValueError(
                "logprobs > 0 (top alternatives) is not supported by this engine; use logprobs=0 for the "
                f"sampled tokens' logprobs, got {self.logprobs}"
            )
        if self.echo:
            raise ValueError("echo is not supported by this engine")
        if self.suffix:
            raise ValueError("suffix is not supported by this engine")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of is not supported by this engine (only equal to n), got {self.best_of}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or _is_token_list(self.prompt):
            return [self.prompt]
        return list(self.prompt)


# ---------------------------------------------------------------------------------------------------
# control routes


class UpdateWeightsFromDiskRequest(_Lenient):
    """SGLang `POST /update_weights_from_disk`."""

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    load_format: str | None = None
    flush_cache: bool = True


class MemoryOccupationRequest(_Lenient):
    """`POST /release_memory_occupation` and `/resume_memory_occupation`: tags None means all."""

    tags: list[str] | None = None


class PauseGenerationRequest(_Strict):
    """`POST /pause_generation`: abort (SGLang's default) aborts in-flight requests; in_place and retract
    keep them, and they resume at `/continue_generation`."""

    mode: Literal["abort", "in_place", "retract"] = "abort"


class AbortRequest(_Lenient):
    """`POST /abort_request`: one request id, or every request."""

    rid: str | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _target(self) -> AbortRequest:
        if not self.abort_all and not self.rid:
            raise ValueError('give rid ("...") or abort_all (true)')
        return self


def check_prompt(
    prompt_ids: list[int], *, field: str, vocab_size: int, context_len: int, max_new_tokens: int
) -> int:
    """Reject prompts the model cannot take; return max_new_tokens clamped to the context left.

    max_new_tokens < 0 means "as many as fit". Clamping (rather than rejecting) prompt + max_new_tokens >
    context matches SGLang: the request then finishes with reason "length". The prompt itself must leave
    room for at least one token (the engine core's rule).
    """
    if not prompt_ids:
        raise RequestError(f"{field} is empty: the prompt needs at least one token")
    for position, token in enumerate(prompt_ids):
        if not 0 <= token < vocab_size:
            raise RequestError(f"{field}[{position}] = {token} is outside the vocabulary (size {vocab_size})")
    room = context_len - len(prompt_ids)
    if room <= 0:
        raise RequestError(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {context_len}"
            + (" (no room left for a new token)" if room == 0 else "")
        )
    return room if max_new_tokens < 0 else min(max_new_tokens, room)
