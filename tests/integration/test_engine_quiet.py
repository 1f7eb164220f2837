"""Quiet requests (Engine.add_request(quiet=True), what every non-streaming /generate uses): a sample's tokens
are reported once, when it finishes, instead of one StepOutput per step. Per sample, the outputs must
concatenate to exactly what the per-step outputs give: tokens, logprobs, each token's weight version, the
finish reason and the top / prompt logprobs — with both schedules, stops at different steps, n > 1, stop
strings, score-only and top-logprob requests, an abort while a step is in flight, and weight-version
changes in the middle of generation."""

import sys
from pathlib import Path

import pytest

from clawrl.engine.core.request import SamplingParams
from clawrl.engine.core.sequence import PENDING_TOKEN
from clawrl.models.loader import iter_safetensors

sys.path.insert(0, str(Path(__file__).parent))
from test_engine_core import PROMPTS, make_checkpoint, make_engine, mixed_params  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_quiet"), seed=1)


def requests(host_steps=True):
    """(request id, prompt, params): stops at different steps, n > 1, a stop string, and (host_steps) top
    logprobs, score-only and a request finished before it starts. Top / prompt logprobs need the host every
    step: while such a request runs the engine does not overlap its steps."""
    reqs = [
        (f"mixed-{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, mixed_params(), strict=True))
    ]
    reqs += [
        ("n3", PROMPTS[3], SamplingParams(n=3, max_new_tokens=9, temperature=1.0, seed=5, ignore_eos=True)),
        ("stop", PROMPTS[2], SamplingParams(max_new_tokens=16, temperature=1.0, seed=6, stop=["e"])),
    ]
    if not host_steps:
        return reqs
    reqs += [
        ("top", PROMPTS[1], SamplingParams(max_new_tokens=5, temperature=0.0, top_logprobs_num=2)),
        ("score", PROMPTS[0], SamplingParams(max_new_tokens=0, logprob_start_len=0)),
        ("empty", PROMPTS[0], SamplingParams(max_new_tokens=0)),
    ]
    return reqs


def collect(outputs, per_sample=None):
    """Per (request, index): tokens, logprobs, each token's version, finish reason, extras, outputs seen."""
    per_sample = {} if per_sample is None else per_sample
    for out in outputs:
        got = per_sample.setdefault((out.request_id, out.index), {
            "tokens": [], "logprobs": [], "versions": [], "finish": None, "top": [], "prompt": None, "outputs": 0,
        })  # fmt: skip
        got["tokens"] += out.token_ids
        got["logprobs"] += out.logprobs
        got["versions"] += [out.weight_version] * len(out.token_ids)
        got["outputs"] += 1
        if out.logprob_extras is not None:
            got["top"] += out.logprob_extras.output_top or []
            if out.logprob_extras.prompt is not None:
                got["prompt"] = out.logprob_extras.prompt
        if out.finished:
            got["finish"] = out.finish_reason
    return per_sample


def run(engine, *, quiet, between_steps=None, host_steps=True):
    """Add requests(), step to the end (calling between_steps(engine, step) after each step); per sample."""
    for rid, prompt, params in requests(host_steps):
        engine.add_request(rid, prompt, params, quiet=quiet)
    per_sample, step = {}, 0
    while engine.has_unfinished_requests():
        collect(engine.step(), per_sample)
        step += 1
        if between_steps is not None:
            between_steps(engine, step)
    return per_sample


def both_ways(ckpt, overlap, between_steps):
    """The requests without host steps, per step and quiet, on fresh engines: (per-step run, quiet run)."""
    return tuple(
        run(make_engine(ckpt, enable_overlap_schedule=overlap), quiet=quiet, between_steps=between_steps,
            host_steps=False)
        for quiet in (False, True)
    )  # fmt: skip


def without_counts(per_sample):
    return {key: {k: v for k, v in got.items() if k != "outputs"} for key, got in per_sample.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_quiet_outputs_concatenate_to_the_per_step_outputs(ckpt, overlap):
    loud = run(make_engine(ckpt, enable_overlap_schedule=overlap), quiet=False)
    quiet = run(make_engine(ckpt, enable_overlap_schedule=overlap), quiet=True)
    assert without_counts(quiet) == without_counts(loud)
    assert len({len(v["tokens"]) for k, v in loud.items() if k[0].startswith("mixed")}) > 1  # stops differ
    assert loud[("stop", 0)]["finish"]["type"] == "stop" and loud[("top", 0)]["top"]
    assert loud[("score", 0)]["prompt"] and all(PENDING_TOKEN not in v["tokens"] for v in quiet.values())
    # one output per quiet sample; per step for those with top logprobs; the per-step run one per token
    for key, got in quiet.items():
        expected = len(loud[key]["tokens"]) if key[0] == "top" else 1
        assert got["outputs"] == expected, key
    assert loud[("n3", 2)]["outputs"] == 9


@pytest.mark.parametrize("overlap", [False, True])
def test_an_abort_while_a_step_is_in_flight_reports_the_tokens_so_far(ckpt, overlap):
    def abort_some(engine, step):
        if step == 4:
            assert (engine._inflight is not None) == overlap  # with overlap the next step is on its way
            engine.abort_request("n3")
            engine.abort_request("mixed-1")

    loud, quiet = both_ways(ckpt, overlap, abort_some)
    assert without_counts(quiet) == without_counts(loud)
    aborted = quiet[("n3", 1)]
    assert aborted["finish"] == {"type": "abort"} and 0 < len(aborted["tokens"]) < 9


@pytest.mark.parametrize("overlap", [False, True])
def test_weight_version_changes_mid_generation_keep_each_tokens_version(ckpt, overlap):
    def update(engine, step):
        if step == 3:  # the same weights, a new version: the tokens stay, their versions change
            engine.update_weights_from_tensors(iter_safetensors(ckpt))
        if step == 6:
            engine.set_weight_version("v-six")

    loud, quiet = both_ways(ckpt, overlap, update)
    assert without_counts(quiet) == without_counts(loud)
    versions = quiet[("n3", 0)]["versions"]
    assert versions[0] == "0" and "1" in versions and versions[-1] == "v-six"
    assert versions == sorted(versions, key=["0", "1", "v-six"].index)  # in order, no token relabelled
    assert quiet[("n3", 0)]["outputs"] == 3  # one per version
