"""Partial rollouts and the staleness bound, piece by piece: staleness arithmetic, resuming, the buffer
round trip through the real RolloutDataSource, segment versions of an engine response, the flag rules
(validate, check_loop_flags, `clawrl train` exiting on them) and the async loop's sync schedule.

    .venv/bin/pytest tests/unit/test_partial_rollout_units.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from clawrl import fast_json
from clawrl.cli.main import main
from clawrl.config import ConfigError, build_job_parser, job_from_namespace, validate
from clawrl.config.loop_rules import check_loop_flags
from clawrl.data.sample import Sample, Status
from clawrl.loops.async_ import sync_due
from clawrl.rollout.data_source import RolloutDataSource
from clawrl.rollout.default_rollout import GroupGenerator
from clawrl.rollout.generate import _logprob_fields, apply_output, segment_versions
from clawrl.rollout.hooks import GenerateFunctions
from clawrl.rollout.partial import (
    PartialStats,
    check_staleness,
    partial_metrics,
    prepare_resume,
    requeue,
    staleness,
    staleness_metrics,
    take_groups,
)


def _sample(index: int, versions: list[str], *, status=Status.ABORTED, num_tokens: int = 0) -> Sample:
    sample = Sample(index=index, group_index=index, tokens=[7, 8], status=status, weight_versions=versions)
    if num_tokens:
        sample.append_response(list(range(num_tokens)), [-0.5] * num_tokens, "x" * num_tokens)
    return sample


# ------------------------------------------------------------------------------------------------ staleness
def test_staleness_is_policy_version_minus_the_oldest_segment():
    assert staleness(_sample(0, ["3", "4"]), 5) == 2
    assert staleness(_sample(0, ["4", "3"]), 4) == 1  # the oldest, not the first
    assert staleness(_sample(0, []), 5) is None
    assert staleness(_sample(0, ["default"]), 5) is None  # external engine names carry no order


def test_staleness_metrics_by_hand():
    samples = [_sample(0, ["0", "1"]), _sample(1, ["1"]), _sample(2, ["2"]), _sample(3, ["main"])]
    # lags at policy version 2: 2, 1, 0 (the named version is skipped)
    assert staleness_metrics(samples, 2) == {
        "rollout/weight_staleness/max": 2.0,
        "rollout/weight_staleness/mean": 1.0,
    }
    assert staleness_metrics(samples, None) == {}
    assert staleness_metrics([_sample(0, [])], 3) == {}


def test_check_staleness_names_the_sample_and_the_bound():
    check_staleness([_sample(0, ["1"]), _sample(1, ["2"])], 3, 2)  # lags 2 and 1: within the bound
    with pytest.raises(
        RuntimeError, match=r"sample 4 .*\['1'\], 3 behind .*version 4.*--max-weight-staleness 2"
    ):
        check_staleness([_sample(4, ["1"])], 4, 2)


# ------------------------------------------------------------------------------------------------- resuming
def test_prepare_resume_continues_aborted_samples_only():
    partial = _sample(0, ["0"], num_tokens=3)
    assert prepare_resume(partial, mask_offpolicy=False) is True
    assert partial.status == Status.PENDING and partial.loss_mask == [1, 1, 1]
    assert partial.tokens == [7, 8, 0, 1, 2] and partial.rollout_log_probs == [-0.5] * 3

    masked = _sample(1, ["0"], num_tokens=2)
    assert prepare_resume(masked, mask_offpolicy=True) is True
    assert masked.loss_mask == [0, 0]  # --mask-offpolicy-in-partial-rollout: earlier tokens not trained on

    empty = _sample(2, [])  # aborted before its first token: starts again from the prompt
    assert prepare_resume(empty, mask_offpolicy=True) is False
    assert empty.status == Status.PENDING and empty.loss_mask is None

    done = _sample(3, ["0"], status=Status.COMPLETED, num_tokens=2)
    assert prepare_resume(done, mask_offpolicy=True) is False
    assert done.status == Status.COMPLETED and done.loss_mask == [1, 1]


def test_finished_samples_of_a_requeued_group_are_not_generated_again():
    # The default generate function would raise here: no rollout (engines) is running.
    gen = GroupGenerator(args=SimpleNamespace(), generate_fns=GenerateFunctions(None), reward_fn=None)
    done = _sample(0, ["0"], status=Status.TRUNCATED, num_tokens=2)
    done.reward = 1.0
    [out] = asyncio.run(gen.sample(done, {"max_new_tokens": 8}, evaluation=False))
    assert out is done and out.tokens == [7, 8, 0, 1] and out.weight_versions == ["0"]


def test_requeue_then_take_groups_through_the_data_source():
    source = RolloutDataSource(None, 1)  # no dataset: fresh groups are empty Samples with new indices
    source.get_samples(10)  # indices 0..9 handed out
    stats = PartialStats()
    old = _sample(0, ["2"], num_tokens=2)
    old.metadata["start_rollout_id"] = 1  # requeued before: keeps the rollout that started it
    leftovers = [[old], [_sample(1, ["3"], num_tokens=1)], [_sample(2, [])]]
    requeue(leftovers, 4, source.add_samples, stats)
    assert stats.num_requeued_groups == 3 and source.buffer_size == 3
    assert [g[0].metadata["start_rollout_id"] for g in leftovers] == [1, 4, 4]

    # Trained by version 5 with K = 2: sample 0 (oldest "2", lag 3) is dropped, sample 1 (lag 2) resumed,
    # sample 2 (no segment) restarts, and one fresh group (index 10) fills the dropped one's place.
    groups = take_groups(
        source.get_samples, 3, policy_version=5, max_staleness=2, mask_offpolicy=False, stats=stats
    )
    assert [g[0].index for g in groups] == [1, 2, 10]
    assert [g[0].status for g in groups] == [Status.PENDING] * 3
    assert (stats.num_dropped_stale_groups, stats.num_resumed_samples) == (1, 1)
    assert partial_metrics(stats) == {
        "rollout/partial/requeued_groups": 3.0,
        "rollout/partial/resumed_samples": 1.0,
        "rollout/partial/dropped_stale_groups": 1.0,
    }


def test_take_groups_without_a_bound_keeps_every_buffered_group():
    source = RolloutDataSource(None, 1)
    source.add_samples([[_sample(0, ["0"], num_tokens=1)]])
    groups = take_groups(
        source.get_samples,
        1,
        policy_version=100,
        max_staleness=None,
        mask_offpolicy=False,
        stats=PartialStats(),
    )
    assert groups[0][0].index == 0 and groups[0][0].status == Status.PENDING


def test_partial_groups_survive_the_state_dict():
    source = RolloutDataSource(None, 1)
    requeue([[_sample(5, ["0"], num_tokens=2)]], 0, source.add_samples, PartialStats())
    restored = RolloutDataSource(None, 1)
    restored.load_state_dict(source.state_dict())
    [[sample]] = restored.get_samples(1)
    assert (sample.tokens, sample.weight_versions, sample.status) == ([7, 8, 0, 1], ["0"], Status.ABORTED)
    assert sample.rollout_log_probs == [-0.5, -0.5] and sample.metadata == {"start_rollout_id": 0}


# ------------------------------------------------------------------------------------------ segment versions
def test_apply_output_takes_sglangs_triples_and_clawrls_packed_logprobs_alike():
    logprobs, ids = [-0.1234567890123, -2.5, -7.75], [11, 12, 13]
    finish = {"type": "length", "length": 3}
    triples = {"text": "abc", "output_ids": ids, "meta_info": {"finish_reason": finish, "weight_version": "4",
               "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
               "output_token_weight_versions": ["3", "4", "4"]}}  # fmt: skip
    packed = {"text": "abc", "output_ids": ids, "meta_info": {"finish_reason": finish, "weight_version": "4",
              "output_token_logprobs_b64": fast_json.pack_floats(logprobs),
              "output_token_weight_version_runs": [["3", 1], ["4", 2]]}}  # fmt: skip
    samples = [Sample(index=0, group_index=0, tokens=[7, 8]) for _ in range(2)]
    for sample, output in zip(samples, (triples, packed), strict=True):
        apply_output(sample, output)
    a, b = samples
    assert b.tokens == a.tokens == [7, 8, 11, 12, 13] and b.response == a.response == "abc"
    assert b.rollout_log_probs == a.rollout_log_probs == logprobs
    assert b.weight_versions == a.weight_versions == ["3", "4"] and b.status == a.status
    short = {
        **packed,
        "meta_info": {**packed["meta_info"], "output_token_logprobs_b64": fast_json.pack_floats([-1.0])},
    }
    with pytest.raises(
        ValueError, match=r"sample 0: the engine's /generate response has 1 logprobs for 3 output_ids"
    ):
        apply_output(Sample(index=0, group_index=0, tokens=[7]), short)
    # the request asks for packed logprobs only where every engine is clawrl's own (an SGLang server refuses it)
    assert _logprob_fields(SimpleNamespace(compact_answers=True)) == {
        "return_logprob": True,
        "compact_logprobs": True,
    }
    assert _logprob_fields(SimpleNamespace(compact_answers=False)) == {"return_logprob": True}
    assert _logprob_fields(object()) == {"return_logprob": True}  # a plugin's own router


def test_segment_versions_of_one_generate_response():
    assert segment_versions({"weight_version": "3", "finish_reason": {"type": "stop"}}, 2) == ["3"]
    per_token = {"weight_version": "4", "output_token_weight_versions": ["3", "3", "4", "4"]}
    assert segment_versions(per_token, 4) == ["3", "4"]  # the weights changed while the request ran
    aborted_empty = {"weight_version": "3", "finish_reason": {"type": "abort"}}
    assert segment_versions(aborted_empty, 0) == []  # nothing generated: no segment
    assert segment_versions({"weight_version": "3", "finish_reason": {"type": "stop"}}, 0) == ["3"]
    runs = {"weight_version": "4", "output_token_weight_version_runs": [["3", 2], ["4", 2]]}
    assert segment_versions(runs, 4) == ["3", "4"]  # compact answers carry the runs


# ---------------------------------------------------------------------------------------------- flag rules
BASE = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2"]


def _job(*flags: str):
    data = [
        "--prompt-data",
        "train.jsonl",
        "--rm-type",
        "math",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
    ]  # what check_loop_flags asks of any run
    return validate(job_from_namespace(build_job_parser().parse_args([*BASE, *data, *flags])))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--partial-rollout"], "--over-sampling-batch-size 2 = --rollout-batch-size 2"),
        (["--mask-offpolicy-in-partial-rollout"], "--mask-offpolicy-in-partial-rollout only acts"),
        (["--max-weight-staleness", "3"], "--max-weight-staleness 3 only acts"),
        (["--partial-rollout", "--over-sampling-batch-size", "4", "--rollout-function-path", "m.fn"],
         "--rollout-function-path m.fn replaces it"),
        (["--partial-rollout", "--over-sampling-batch-size", "4", "--custom-generate-function-path",
          "clawrl.rollout.multi_turn.generate", "--custom-env-path", "m:Env"], "cannot be continued"),
        (["--update-weights-interval", "0"], "--update-weights-interval must be >= 1, got 0"),
        (["--max-weight-staleness", "-1"], "--max-weight-staleness must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_validate_rejects(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _job(*flags)


def test_validate_accepts_partial_rollout_with_over_sampling_or_a_filter():
    job = _job("--partial-rollout", "--over-sampling-batch-size", "3", "--mask-offpolicy-in-partial-rollout")
    assert job.rollout.partial_rollout and job.rollout.mask_offpolicy_in_partial_rollout
    filtered = _job(
        "--partial-rollout",
        "--dynamic-sampling-filter-path",
        "clawrl.rollout.filters.check_reward_nonzero_std",
    )
    assert filtered.rollout.over_sampling_batch_size == 2


def test_loop_rules():
    check_loop_flags(_job("--update-weights-interval", "3"), asynchronous=True)
    with pytest.raises(ConfigError, match="--update-weights-interval 3 is for clawrl train-async"):
        check_loop_flags(_job("--update-weights-interval", "3"), asynchronous=False)
    partial = ("--partial-rollout", "--over-sampling-batch-size", "4")
    check_loop_flags(_job(*partial, "--max-weight-staleness", "1"), asynchronous=False)
    with pytest.raises(ConfigError, match="--max-weight-staleness 0 must be >= 1 with clawrl train:"):
        check_loop_flags(_job(*partial, "--max-weight-staleness", "0"), asynchronous=False)
    with pytest.raises(ConfigError, match="--max-weight-staleness 1 must be >= 2 with clawrl train-async"):
        check_loop_flags(_job(*partial, "--max-weight-staleness", "1"), asynchronous=True)
    interval = ("--update-weights-interval", "3")
    with pytest.raises(ConfigError, match="--max-weight-staleness 2 must be >= 3 with clawrl train-async"):
        check_loop_flags(_job(*partial, *interval, "--max-weight-staleness", "2"), asynchronous=True)
    check_loop_flags(_job(*partial, *interval, "--max-weight-staleness", "3"), asynchronous=True)


def test_clawrl_train_refuses_an_update_interval_before_starting_anything(capsys):
    assert main(["train", *BASE, "--update-weights-interval", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "clawrl train: error: --update-weights-interval 2 is for clawrl train-async; clawrl train updates "
        "the engines after every rollout"
    )


# ------------------------------------------------------------------------------------------ async schedule
def test_async_sync_schedule():
    assert [sync_due(k, 1, 4) for k in range(4)] == [True] * 4
    assert [sync_due(k, 2, 4) for k in range(4)] == [False, True, False, True]
    assert [sync_due(k, 3, 5) for k in range(5)] == [False, False, True, False, True]  # the last one always
