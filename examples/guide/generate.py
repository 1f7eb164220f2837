"""A custom generate function (slime's signature): one /generate call to the engines, written out in full.

    clawrl train ... --custom-generate-function-path examples/guide/generate.py:generate

It does what clawrl's default generate function does for a single-turn sample, so it is the starting point
for your own (a different prompt format, several calls per sample, a tool call in between, ...). A generate
function must leave on the sample: `tokens` (prompt + response ids), `response_length`,
`rollout_log_probs` (one per response token), `response` (the text the reward sees), `status` and the
weight version(s) that generated it. `Sample.append_response` and `Sample.apply_finish` do that bookkeeping.
`rollout_context()` gives the engines (`ctx.router`, SGLang's /generate protocol) and the tokenizer.
"""

from __future__ import annotations

from clawrl.data.chat import encode_text
from clawrl.data.sample import Sample, Status
from clawrl.rollout.context import rollout_context


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """Extend `sample` with one response. `evaluation` is True during --eval-prompt-data evaluation."""
    ctx = rollout_context()
    if ctx.aborted:  # the rollout already has enough samples: send nothing more
        sample.status = Status.ABORTED
        return sample
    # The dataset rendered the chat template already (--apply-chat-template), so the prompt is plain text.
    prompt_ids = encode_text(ctx.tokenizer, sample.prompt)
    params = dict(sampling_params)
    if params.get("seed") is None and sample.index is not None:
        params["seed"] = args.rollout_seed + sample.index  # reproducible, and different for each sibling
    output = await ctx.router.generate(
        {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True},
        session_id=sample.session_id,
    )
    meta = output["meta_info"]
    logprob_pairs = meta["output_token_logprobs"]  # [[log-prob, token id, ...], ...] as SGLang returns them
    sample.tokens = list(prompt_ids)
    sample.append_response(
        [int(pair[1]) for pair in logprob_pairs], [float(pair[0]) for pair in logprob_pairs], output["text"]
    )
    sample.apply_finish(meta.get("finish_reason"), meta.get("weight_version"))
    sample.metadata = {**(sample.metadata or {}), "generated_by": "examples/guide/generate.py"}
    return sample
