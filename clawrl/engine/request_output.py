"""What a request produces: per-step deltas, per-sample results, and the state that makes them.

Streaming requests: the engine thread hands the request's coroutine core `StepOutput`s
(clawrl/engine/engine.py) or `Aborted` events; `RequestStream` turns them into `GenerationDelta`s (token
ids, logprobs, text, weight version) and `GenerationResult.add` accumulates deltas into a sample's result.

Non-streaming requests: the engine thread keeps the request's StepOutputs and hands them over once, as a
`Collected` event, when the last sample is done; `collect_results` builds the same GenerationResults that
the deltas would have added up to, decoding each sample's text once instead of once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clawrl.engine.sampling_params import SamplingParams
from clawrl.engine.text_stream import IncrementalText


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
        if output.weight_version != sample.weight_version:
            sample.weight_version = output.weight_version
            sample.version_starts.append(
                (len(sample.token_ids) - len(output.token_ids), str(output.weight_version))
            )
        sample.last = self.last = output
        sample.finished = output.finished


class _SampleOutputs:
    """One sample's tokens so far (OutputCollector)."""

    __slots__ = ("token_ids", "logprobs", "weight_version", "version_starts", "last", "finished")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weight_version: Any = None
        self.version_starts: list[tuple[int, str]] = []  # (first token, weight version) at each change
        self.last: Any = None  # its latest StepOutput
        self.finished = False

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


def collect_results(
    rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Any, weight_version: str,
    collected: Collected,
) -> list[GenerationResult]:  # fmt: skip
    """The per-sample results (ordered by index) that RequestStream's deltas add up to for the same
    events: a finished sample takes the token counts and version of its last output; an aborted one keeps
    its tokens and version and takes the request's latest token counts; the text is decoded with the same
    prompt context and stop trimming (IncrementalText), in one push of the whole output."""
    last = collected.outputs.last
    request_counts = (len(prompt_ids), 0) if last is None else (last.prompt_tokens, last.cached_tokens)
    aborted = set(collected.aborted)
    results = []
    for index, sample in enumerate(collected.outputs.samples):
        result = GenerationResult(
            request_id=rid, index=index, output_ids=sample.token_ids, logprobs=sample.logprobs,
            weight_versions=sample.weight_versions(), weight_version=weight_version,
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
        results.append(result)
    return results


def _text_stream(tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> IncrementalText:
    stops = {"stop": params.stop, "no_stop_trim": params.no_stop_trim}
    return IncrementalText(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens, **stops)


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
        return GenerationDelta(
            request_id=self.rid, index=index, token_ids=list(output.token_ids), logprobs=list(output.logprobs),
            text=text, finished=bool(output.finished), finish_reason=reason, weight_version=self.versions[index],
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
        )  # fmt: skip

    def _abort_delta(self, index: int) -> GenerationDelta:
        self.unfinished.discard(index)
        reason = {"type": "abort"}
        return GenerationDelta(
            request_id=self.rid, index=index, token_ids=[], logprobs=[], text=self.texts[index].push([], reason),
            finished=True, finish_reason=reason, weight_version=self.versions[index],
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
        )  # fmt: skip
