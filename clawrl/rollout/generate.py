"""The default generate function (slime's signature) and the sampling parameters built from the flags.

    sample = await generate(args, sample, sampling_params)

One `/generate` call through the rollout's router: the prompt is tokenised as it is (a chat prompt was
already rendered by the dataset with --apply-chat-template; no special tokens are added), or, for a sample
that already has tokens (a continued, multi-turn sample), those tokens are sent. The response tokens,
their log-probs, text, weight version and finish status are appended with `Sample.append_response` /
`Sample.apply_finish`: one weight version per call, or one per weight change when the engine's weights
changed while the request ran (from meta_info.output_token_weight_versions), and none for a request
aborted before its first token (it generated nothing, so no segment). `max_new_tokens` is --rollout-max-response-len minus the response tokens the sample
already has; at 0 the sample is TRUNCATED without a request. After the rollout was aborted (enough samples
collected) the sample comes back ABORTED without a request.

Seeds: a request without a seed gets `--rollout-seed + sample.index`, so a rollout is reproducible from
(weights, seed, data cursor) and sibling samples of a prompt still differ.
"""

from __future__ import annotations

import itertools
import operator
import time
from typing import Any

from clawrl import fast_json
from clawrl.data.chat import encode_text
from clawrl.data.sample import Sample, Status
from clawrl.rollout.context import rollout_context

_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def train_sampling_params(args: Any) -> dict[str, Any]:
    """SGLang sampling params from the --rollout-* flags (slime's defaults for the text options)."""
    return _sampling_params(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
    )


def eval_sampling_params(args: Any) -> dict[str, Any]:
    """Sampling params from the --eval-* flags, each falling back to its --rollout-* flag when unset."""

    def pick(name: str) -> Any:
        value = getattr(args, f"eval_{name}", None)
        return getattr(args, f"rollout_{name}") if value is None else value

    return _sampling_params(
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k"),
        max_new_tokens=pick("max_response_len"),
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
    )


def _sampling_params(**values: Any) -> dict[str, Any]:
    params = dict(values)
    params["stop"] = list(params["stop"] or [])
    params["stop_token_ids"] = list(params["stop_token_ids"] or [])
    # slime sends these: keep special tokens and stop strings in the text the reward function sees.
    params.update(skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False)
    return params


def prompt_token_ids(sample: Sample, tokenizer: Any) -> list[int]:
    """Token ids to send: the sample's tokens if it has some, else its (already rendered) prompt, encoded."""
    if sample.tokens:
        return list(sample.tokens)
    if not isinstance(sample.prompt, str):
        raise ValueError(
            f"sample {sample.index}: the prompt is a list of chat messages; the default generate function "
            "needs text: pass --apply-chat-template so the dataset renders it"
        )
    if tokenizer is None:
        raise ValueError(
            f"sample {sample.index}: cannot tokenise the prompt: the RolloutManager has no tokenizer "
            "(set --hf-checkpoint or pass tokenizer_path)"
        )
    return encode_text(tokenizer, sample.prompt)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Extend `sample` with one engine response (see the module docstring); returns the same sample."""
    ctx = rollout_context()
    if ctx.aborted:
        sample.status = Status.ABORTED
        return sample
    request = _request_of(args, sample, sampling_params, ctx.tokenizer)
    if request is None:
        return sample
    input_ids, params = request
    payload = {"input_ids": input_ids, "sampling_params": params, **_logprob_fields(ctx.router)}
    sent = time.monotonic()
    output = await ctx.router.generate(payload, session_id=sample.session_id)
    if ctx.timeline is not None:  # the answer path's stamps (clawrl/rollout/timeline.py)
        ctx.timeline.add_engine_call(sent, time.monotonic(), [output])
    apply_output(sample, output)
    return sample


async def generate_group(args: Any, samples: list[Sample], sampling_params: dict[str, Any]) -> list[Sample]:
    """`generate` for several samples in one `/generate` batch request (one sampling_params entry per sample,
    each with the sample's own seed): the same requests to the engine, so the same tokens, for one HTTP
    round trip instead of one per sample (the rollout client's cost per request is ~1-3 ms of CPU)."""
    ctx = rollout_context()
    if ctx.aborted:
        for sample in samples:
            sample.status = Status.ABORTED
        return samples
    requests = [(s, _request_of(args, s, sampling_params, ctx.tokenizer)) for s in samples]
    todo = [(s, request) for s, request in requests if request is not None]
    sent = time.monotonic()
    if len(todo) == 1:
        payload = {
            "input_ids": todo[0][1][0],
            "sampling_params": todo[0][1][1],
            **_logprob_fields(ctx.router),
        }
        outputs = [await ctx.router.generate(payload, session_id=todo[0][0].session_id)]
    elif todo:
        payload = {"input_ids": [ids for _, (ids, _) in todo], "sampling_params": [p for _, (_, p) in todo],
                   **_logprob_fields(ctx.router)}  # fmt: skip
        outputs = await ctx.router.generate(payload, session_id=todo[0][0].session_id)
        if not isinstance(outputs, list) or len(outputs) != len(todo):
            raise ValueError(f"the engine answered a batch of {len(todo)} prompts with {_describe(outputs)}")
    else:
        outputs = []
    if todo and ctx.timeline is not None:  # the answer path's stamps (clawrl/rollout/timeline.py)
        ctx.timeline.add_engine_call(sent, time.monotonic(), outputs)
    for (sample, _), output in zip(todo, outputs, strict=True):
        apply_output(sample, output)
    return samples


def _request_of(
    args: Any, sample: Sample, sampling_params: dict[str, Any], tokenizer: Any
) -> tuple[list[int], dict[str, Any]] | None:
    """(input_ids, sampling params) of the sample's next request; None when it is TRUNCATED already."""
    input_ids = prompt_token_ids(sample, tokenizer)
    params = dict(sampling_params)
    limit = params.get("max_new_tokens")
    if limit is not None:
        params["max_new_tokens"] = limit - sample.response_length
        if params["max_new_tokens"] <= 0:
            sample.status = Status.TRUNCATED
            return None
    if params.get("seed") is None and sample.index is not None:
        params["seed"] = int(args.rollout_seed) + sample.index
    if not sample.tokens:
        sample.tokens = list(input_ids)
    return input_ids, params


_LOGPROBS = {"return_logprob": True}
_COMPACT_LOGPROBS = {"return_logprob": True, "compact_logprobs": True}


def _logprob_fields(router: Any) -> dict[str, bool]:
    """The request's logprob fields: packed answers from the run's own engines (EngineRouter.compact_answers;
    clawrl/fast_json.py says why), SGLang's triples from any other server."""
    return _COMPACT_LOGPROBS if getattr(router, "compact_answers", False) else _LOGPROBS


def apply_output(sample: Sample, output: dict[str, Any]) -> None:
    """Append one `/generate` response item to the sample: tokens, log-probs, text, versions, finish.
    Takes SGLang's `output_token_logprobs` triples or clawrl's packed `output_token_logprobs_b64`."""
    meta = output["meta_info"]
    packed = meta.get("output_token_logprobs_b64")
    if packed is not None:
        token_ids = output["output_ids"]  # ints: clawrl's own server wrote them
        log_probs = fast_json.unpack_floats(packed, field="meta_info.output_token_logprobs_b64")
        if len(log_probs) != len(token_ids):
            raise ValueError(f"sample {sample.index}: the engine's /generate response has {len(log_probs)} "
                             f"logprobs for {len(token_ids)} output_ids")  # fmt: skip
    else:
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise ValueError(
                f"sample {sample.index}: the engine's /generate response has no meta_info.output_token_logprobs "
                "although return_logprob was requested"
            )
        # Every token of every sample passes here, on the rollout's event loop: conversions by map, in C.
        token_ids = list(map(int, map(_SECOND, pairs)))
        log_probs = list(map(float, map(_FIRST, pairs)))
    sample.append_response(token_ids, log_probs, output.get("text", ""))
    versions = segment_versions(meta, len(token_ids))
    sample.weight_versions.extend(versions[:-1])
    sample.apply_finish(meta.get("finish_reason"), versions[-1] if versions else None)


def _describe(value: Any) -> str:
    return f"a list of {len(value)} items" if isinstance(value, list) else type(value).__name__


def segment_versions(meta: dict[str, Any], num_tokens: int) -> list[str]:
    """The weight versions one /generate response was produced by, oldest first (see module docstring)."""
    finish = meta.get("finish_reason") or {}
    if num_tokens == 0 and finish.get("type") == "abort":
        return []
    runs = meta.get("output_token_weight_version_runs")  # compact answers: [[version, count], ...]
    if runs:
        return [str(version) for version, _ in runs]
    per_token = meta.get("output_token_weight_versions")
    if not per_token:
        version = meta.get("weight_version")
        return [] if version is None else [str(version)]
    return [version for version, _ in itertools.groupby(map(str, per_token))]
