"""One request, from what it asks for to what it gets back.

- `SamplingParams` (SGLang's `sampling_params` vocabulary) and the one place a request is checked: its
  sampling values (`SamplingParams.validate`, and `sampling_value_errors` for the HTTP routes, whose request
  models only check JSON types and then name the bad values with the route's own field names, e.g. OpenAI's
  `max_tokens`) and its prompt against the model's vocabulary and context (`check_prompt`). A failure is
  one `RequestError` (a ValueError) whose message names the field and the bad value; the HTTP layer
  answers it with status 400.
- What a request produces: per-step deltas, per-sample results, and the state that makes them.

Streaming requests: the engine thread hands the request's coroutine core `StepOutput`s (engine.py) or
`Aborted` events; `RequestStream` turns them into `GenerationDelta`s (token ids, logprobs, text decoded by
sequence.py's `IncrementalDetokenizer`, weight version) and `GenerationResult.add` accumulates deltas into
a sample's result.

Non-streaming requests: the engine thread keeps the request's StepOutputs and hands them over once, as a
`Collected` event, when the last sample is done; `collect_results` builds the same GenerationResults that
the deltas would have added up to, decoding each sample's text once instead of once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from clawrl.engine.core.sequence import IncrementalDetokenizer


class RequestError(ValueError):
    """A bad request: the message names the field and the bad value; the HTTP server answers 400."""

    status_code = 400


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request; field names and meanings follow SGLang's `/generate`."""

    max_new_tokens: int = 128
    """Most tokens to generate (>= 0; 0 finishes at once with finish reason "length")."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep only the top_k most likely tokens; -1 or 0 turns it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the decoded output text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the sequence (ignored, like EOS, when ignore_eos is set; SGLang's rule)."""
    ignore_eos: bool = False
    """Keep generating past EOS and stop_token_ids (stop strings and max_new_tokens still apply)."""
    n: int = 1
    """Samples per request; they share the prompt's KV blocks."""
    seed: int | None = None
    """Sampling seed: same seed + prompt + params -> same tokens, whatever else is in the batch."""
    skip_special_tokens: bool = True
    """Drop special tokens when decoding text (text layer and stop-string matching)."""
    no_stop_trim: bool = False
    """Keep the matched stop string / stop token in the output text (text layer)."""
    min_new_tokens: int = 0
    """No stop (EOS, stop token, stop string) before this many tokens: EOS and stop tokens are masked."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it was generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF / SGLang's, > 0: logits of tokens in prompt + output are divided by it when positive, else
    multiplied."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> value added to its logit (OpenAI's logit_bias, in [-100, 100])."""
    top_logprobs_num: int = 0
    """Also report the this-many most likely tokens (with logprobs) at every output position."""
    logprob_start_len: int = -1
    """>= 0: also report the prompt's token logprobs from this position on (-1: none)."""

    def __post_init__(self) -> None:
        # A single string is a common slip (`stop="\n"`); accept it as one stop string.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, logit_bias, min_new_tokens)."""
        return bool(
            self.min_new_tokens or self.presence_penalty or self.frequency_penalty or self.logit_bias
            or self.repetition_penalty != 1.0
        )  # fmt: skip

    @property
    def needs_host_step(self) -> bool:
        """Whether the runner must see this request's tokens on the host every step (no overlap schedule):
        logit rules read the generated tokens; top / prompt logprobs are read back per step."""
        return self.shapes_logits or self.top_logprobs_num > 0 or self.logprob_start_len >= 0

    def validate(self) -> None:
        """Raise RequestError naming every bad field ("sampling_params.top_p must be in (0, 1], got 1.5")."""
        values = {name: getattr(self, name) for name in _FIELD_NAMES}
        errors = sampling_value_errors(values, prefix="sampling_params.")
        if errors:
            raise RequestError("; ".join(errors))


# ---------------------------------------------------------------------------------------------------
# value rules: field -> check returning "must ..., got <value>" or None


def _is_int(value: object) -> bool:
    # bool is an int subclass; `max_new_tokens=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(ok: Callable[[int], bool], must: str) -> Callable[[Any], str | None]:
    def rule(value: Any) -> str | None:
        if not _is_int(value):
            return f"must be an integer, got {value!r}"
        return None if ok(value) else f"must be {must}, got {value!r}"

    return rule


def _number(ok: Callable[[float], bool], must: str) -> Callable[[Any], str | None]:
    def rule(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"must be a number, got {value!r}"
        return None if ok(value) else f"must be {must}, got {value!r}"

    return rule


def _seed(value: Any) -> str | None:
    return None if value is None or _is_int(value) else f"must be an integer or null, got {value!r}"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _stop_strings(value: Any) -> str | None:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return f"must be a string or a list of strings, got {value!r}"
    return None if all(value) else f"must not hold empty strings, got {value!r}"


def _logit_bias(value: Any) -> str | None:
    if not isinstance(value, dict) or not all(_is_int(t) and t >= 0 for t in value):
        return f"must map token ids (integers >= 0) to numbers, got {value!r}"
    for token, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            return f"must hold biases in [-100, 100], got {bias!r} for token {token}"
    return None


def _token_ids(value: Any) -> str | None:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        return f"must be a list of integer token ids, got {value!r}"
    bad = [t for t in value if t < 0]
    return f"must hold token ids >= 0, got {bad[0]}" if bad else None


_RULES: dict[str, Callable[[Any], str | None]] = {
    "max_new_tokens": _integer(lambda v: v >= 0, ">= 0"),
    "temperature": _number(lambda v: v >= 0, ">= 0 (0 means greedy)"),
    "top_p": _number(lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": _integer(lambda v: v >= -1, "-1 or 0 (off) or >= 1"),
    "min_p": _number(lambda v: 0 <= v < 1, "in [0, 1)"),
    "n": _integer(lambda v: v >= 1, ">= 1"),
    "seed": _seed,
    "stop": _stop_strings,
    "stop_token_ids": _token_ids,
    "ignore_eos": _flag,
    "skip_special_tokens": _flag,
    "no_stop_trim": _flag,
    "min_new_tokens": _integer(lambda v: v >= 0, ">= 0"),
    "presence_penalty": _number(lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": _number(lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": _number(lambda v: v > 0, "> 0 (1 = off)"),
    "logit_bias": _logit_bias,
    "top_logprobs_num": _integer(lambda v: v >= 0, ">= 0"),
    "logprob_start_len": _integer(lambda v: v >= -1, ">= 0, or -1 (no prompt logprobs)"),
}


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))

# A value of exactly the default's type and equal to it passes its rule without running it. A request is
# checked three times on its way in (the HTTP model with the route's names, AsyncEngine on the event loop,
# the core on the engine thread) and most of its ~20 fields hold their defaults: the rules were most of
# the event loop's CPU per request of a rollout's /generate calls (bench/rollout_http_overhead.py
# --profile). The exact type keeps `top_p: true` (True == 1.0) going through the rule, and NaN never
# equals itself.
_DEFAULTS = SamplingParams()
_PASSING: dict[str, tuple[type, Any]] = {
    name: (type(getattr(_DEFAULTS, name)), getattr(_DEFAULTS, name)) for name in _RULES
}


def sampling_value_errors(
    values: Mapping[str, Any], *, prefix: str = "", rule_of: Mapping[str, str] | None = None
) -> list[str]:
    """One message per value in `values` (field name -> value) that breaks its SamplingParams rule, in the
    order given: "<prefix><name> must ..., got <value>". `rule_of` maps a caller's field name to the
    SamplingParams field whose rule applies (OpenAI's max_tokens -> max_new_tokens); names without a rule
    are not checked."""
    errors = []
    rule_of = rule_of or {}
    for name, value in values.items():
        field_name = rule_of.get(name, name)
        passing = _PASSING.get(field_name)
        if passing is not None and type(value) is passing[0] and value == passing[1]:
            continue
        rule = _RULES.get(field_name)
        problem = None if rule is None else rule(value)
        if problem is not None:
            errors.append(f"{prefix}{name} {problem}")
    return errors


def check_prompt(
    prompt_ids: list[int], *, field: str, vocab_size: int, context_len: int, max_new_tokens: int
) -> int:
    """Reject prompts the model cannot take (RequestError naming `field`); return max_new_tokens clamped
    to the context left.

    max_new_tokens < 0 means "as many as fit". Clamping (rather than rejecting) prompt + max_new_tokens >
    context matches SGLang: the request then finishes with reason "length". The prompt itself must leave
    room for at least one token.
    """
    if not isinstance(prompt_ids, list):
        raise RequestError(f"{field} must be a list of integer token ids, got {type(prompt_ids).__name__}")
    if not prompt_ids:
        raise RequestError(f"{field} is empty: the prompt needs at least one token")
    # The common case in C-level passes (a rollout's 256 prompts pass here three times on their way in);
    # the loop below only runs to name the first bad id.
    valid = set(map(type, prompt_ids)) == {int} and min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size
    for position, token in enumerate([] if valid else prompt_ids):
        if not _is_int(token):
            raise RequestError(f"{field}[{position}] must be an integer token id, got {token!r}")
        if not 0 <= token < vocab_size:
            raise RequestError(f"{field}[{position}] = {token} is outside the vocabulary (size {vocab_size})")
    room = context_len - len(prompt_ids)
    if room <= 0:
        raise RequestError(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {context_len}"
            + (" (no room left for a new token)" if room == 0 else "")
        )
    return room if max_new_tokens < 0 else min(max_new_tokens, room)


# ---------------------------------------------------------------------------------------------------
# what a request produces


@dataclass(kw_only=True, slots=True)
class StepLogprobs:
    """Logprobs beyond the sampled token's, for requests that ask (core StepOutput.logprob_extras)."""

    output_top: list | None
    """Per new token, its position's top_logprobs_num most likely [logprob, token id] pairs; None if not asked."""
    prompt: list | None
    """Once (sample 0's first output): per prompt position from logprob_start_len, (logprob or None, top
    pairs or None); None otherwise."""


@dataclass(kw_only=True)
class GenerationDelta:
    """What one engine step produced for one sample of a request."""

    request_id: str
    """The request's id (shared by its n samples)."""
    index: int
    """Which of the request's n samples (0..n-1)."""
    token_ids: list[int]
    """New output token ids (usually one; none for an abort)."""
    logprobs: list[float]
    """Log-prob of each new token under the temperature-scaled distribution it was sampled from."""
    text: str
    """New text that is safe to show (stop strings trimmed, incomplete characters held back)."""
    finished: bool
    """True on the sample's last delta."""
    finish_reason: dict | None
    """On the last delta: {"type": "stop", "matched": ...} | {"type": "length", ...} | {"type": "abort"}."""
    weight_version: str
    """Weight version that produced these tokens."""
    prompt_tokens: int
    """Tokens in the prompt."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    top_logprobs: list | None = None
    """Per new token, its position's most likely [logprob, token id] pairs (top_logprobs_num > 0)."""
    prompt_logprobs: list | None = None
    """Once, with sample 0's first delta when logprob_start_len >= 0: (logprob or None, top or None) per
    prompt position from logprob_start_len."""


@dataclass(kw_only=True)
class GenerationResult:
    """One sample of a request: all of it once finished, or what has arrived so far while streaming."""

    request_id: str
    """The request's id."""
    index: int
    """Which of the request's n samples (0..n-1)."""
    output_ids: list[int] = field(default_factory=list)
    """All output token ids."""
    logprobs: list[float] = field(default_factory=list)
    """Per output token, its sampling log-prob."""
    weight_versions: list[str] = field(default_factory=list)
    """Per output token, the weight version that produced it (a weight update while the request runs
    changes it mid-request: the core recomputes the request's K/V with the new weights and goes on)."""
    text: str = ""
    """Output text (special tokens skipped per params, stop string trimmed unless no_stop_trim)."""
    finish_reason: dict | None = None
    """{"type": "stop" | "length" | "abort", ...}."""
    weight_version: str = ""
    """Version of the last token (of the engine at finish when no token was produced)."""
    prompt_tokens: int = 0
    """Tokens in the prompt."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    top_logprobs: list = field(default_factory=list)
    """Per output token, its position's most likely [logprob, token id] pairs (top_logprobs_num > 0)."""
    prompt_logprobs: list | None = None
    """(logprob or None, top pairs or None) per prompt position from logprob_start_len (sample 0 of a
    request that asks; the HTTP layer gives every sample of the request the same list)."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids, when the HTTP layer needs them for its response (set by it)."""
    finished_at: float | None = None
    """time.monotonic() when the engine finished the request (non-streaming requests run to the end)."""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def add(self, delta: GenerationDelta) -> None:
        self.output_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.weight_versions.extend([delta.weight_version] * len(delta.token_ids))
        self.text += delta.text
        self.weight_version = delta.weight_version
        self.prompt_tokens = delta.prompt_tokens
        self.cached_tokens = delta.cached_tokens
        if delta.top_logprobs is not None:
            self.top_logprobs.extend(delta.top_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason


@dataclass
class Aborted:
    """Event for the request's coroutine: these samples were aborted (no further tokens)."""

    indices: list[int]


class OutputCollector:
    """What the core produced for one non-streaming request, kept as flat per-sample lists (the engine
    thread adds every StepOutput; no per-step object outlives the step: holding a rollout's ~65k
    StepOutputs until the end makes the garbage collector's full passes ~100 ms pauses)."""

    __slots__ = ("samples", "last")

    def __init__(self, n: int) -> None:
        self.samples = [_SampleOutputs() for _ in range(n)]
        self.last: Any = None
        """The latest StepOutput of any sample (the request's token counts for an aborted sample)."""

    def add(self, output: Any) -> None:
        """One StepOutput (engine thread, every step: kept short). Outputs of a finished sample are
        ignored, as RequestStream ignores them."""
        sample = self.samples[output.index]
        if sample.finished:
            return
        sample.token_ids += output.token_ids
        sample.logprobs += output.logprobs
        extras = output.logprob_extras
        if extras is not None:
            sample.add_logprob_extras(extras)
        if output.weight_version != sample.weight_version:
            sample.weight_version = output.weight_version
            sample.version_starts.append(
                (len(sample.token_ids) - len(output.token_ids), str(output.weight_version))
            )
        sample.last = self.last = output
        sample.finished = output.finished


class _SampleOutputs:
    """One sample's tokens so far (OutputCollector)."""

    __slots__ = ("token_ids", "logprobs", "weight_version", "version_starts", "last", "finished", "top_logprobs",
                 "prompt_logprobs")  # fmt: skip

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weight_version: Any = None
        self.version_starts: list[tuple[int, str]] = []  # (first token, weight version) at each change
        self.last: Any = None  # its latest StepOutput
        self.finished = False
        self.top_logprobs: list = []
        self.prompt_logprobs: list | None = None

    def add_logprob_extras(self, extras: StepLogprobs) -> None:
        if extras.output_top is not None:
            self.top_logprobs += extras.output_top
        if extras.prompt is not None:
            self.prompt_logprobs = extras.prompt

    def weight_versions(self) -> list[str]:
        """The weight version of each token."""
        if not self.version_starts:
            return []
        bounds = [start for start, _ in self.version_starts[1:]] + [len(self.token_ids)]
        versions: list[str] = []
        for (start, version), end in zip(self.version_starts, bounds, strict=True):
            versions += [version] * (end - start)
        return versions


@dataclass
class Collected:
    """Event for a non-streaming request's coroutine, sent once, when every sample is done."""

    outputs: OutputCollector
    """Everything the core produced for the request."""
    aborted: list[int]
    """Samples aborted before they finished (no further tokens)."""
    finished_at: float | None = None
    """time.monotonic() on the engine thread when the core finished the request's last sample (None when it
    was aborted): the start of the answer path (meta_info.finished_at)."""


def collect_results(
    rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Any, weight_version: str,
    collected: Collected,
) -> list[GenerationResult]:  # fmt: skip
    """The per-sample results (ordered by index) that RequestStream's deltas add up to for the same
    events: a finished sample takes the token counts and version of its last output; an aborted one keeps
    its tokens and version and takes the request's latest token counts; the text is decoded with the same
    prompt context and stop trimming (IncrementalDetokenizer), in one push of the whole output."""
    last = collected.outputs.last
    request_counts = (len(prompt_ids), 0) if last is None else (last.prompt_tokens, last.cached_tokens)
    aborted = set(collected.aborted)
    results = []
    for index, sample in enumerate(collected.outputs.samples):
        result = GenerationResult(
            request_id=rid, index=index, output_ids=sample.token_ids, logprobs=sample.logprobs,
            weight_versions=sample.weight_versions(), weight_version=weight_version,
            top_logprobs=sample.top_logprobs, prompt_logprobs=sample.prompt_logprobs,
        )  # fmt: skip
        if sample.last is not None:
            result.weight_version = str(sample.last.weight_version)
            result.prompt_tokens, result.cached_tokens = sample.last.prompt_tokens, sample.last.cached_tokens
        if sample.finished:
            result.finish_reason = sample.last.finish_reason
        else:
            assert index in aborted, f"request {rid}: sample {index} neither finished nor aborted"
            result.finish_reason = {"type": "abort"}
            result.prompt_tokens, result.cached_tokens = request_counts
        result.text = _text_stream(tokenizer, prompt_ids, params).push(
            result.output_ids, result.finish_reason
        )
        result.finished_at = collected.finished_at
        results.append(result)
    return results


def _text_stream(tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    stops = {"stop": params.stop, "no_stop_trim": params.no_stop_trim}
    return IncrementalDetokenizer(
        tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens, **stops
    )


class RequestStream:
    """Per-request state on the event loop: turns core StepOutputs (and aborts) into GenerationDeltas,
    with one text decoder per sample, and knows which samples are still running."""

    def __init__(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Any, weight_version: str
    ) -> None:
        self.rid = rid
        self.unfinished = set(range(params.n))
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.versions = [weight_version] * params.n
        self.texts = [_text_stream(tokenizer, prompt_ids, params) for _ in range(params.n)]

    def deltas(self, event: Any) -> list[GenerationDelta]:
        """Deltas for one event: a core StepOutput, or Aborted."""
        if isinstance(event, Aborted):
            return [self._abort_delta(index) for index in event.indices if index in self.unfinished]
        if event.index not in self.unfinished:
            return []
        return [self._step_delta(event)]

    def _step_delta(self, output: Any) -> GenerationDelta:
        index = output.index
        reason = output.finish_reason if output.finished else None
        text = self.texts[index].push(list(output.token_ids), reason)
        self.prompt_tokens, self.cached_tokens = output.prompt_tokens, output.cached_tokens
        self.versions[index] = str(output.weight_version)
        if output.finished:
            self.unfinished.discard(index)
        extras = output.logprob_extras
        return GenerationDelta(
            request_id=self.rid, index=index, token_ids=list(output.token_ids), logprobs=list(output.logprobs),
            text=text, finished=bool(output.finished), finish_reason=reason, weight_version=self.versions[index],
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            top_logprobs=None if extras is None else extras.output_top,
            prompt_logprobs=None if extras is None else extras.prompt,
        )  # fmt: skip

    def _abort_delta(self, index: int) -> GenerationDelta:
        self.unfinished.discard(index)
        reason = {"type": "abort"}
        return GenerationDelta(
            request_id=self.rid, index=index, token_ids=[], logprobs=[], text=self.texts[index].push([], reason),
            finished=True, finish_reason=reason, weight_version=self.versions[index],
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
        )  # fmt: skip
