"""Contract tests of the rollout plugins, called by a real RolloutManager exactly as in a training job.

Each plugin is given by import path (this module's functions), with slime's signatures:
--custom-generate-function-path (with and without `evaluation`, returning a Sample or a list),
per-sample `generate_function_path`, --rollout-function-path (train and eval, record and legacy returns),
--custom-rm-path, --dynamic-sampling-filter-path (bool and DynamicFilterOutput). The generate functions
here fill samples themselves, so no engine is needed; the engine URL points at a closed port (the abort of
leftover groups reaches no engine, which the manager tolerates). A plugin that returns the wrong type must
fail with one error naming its flag and path.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from clawrl.config.data import DataConfig
from clawrl.config.eval import EvalConfig
from clawrl.config.job import JobConfig
from clawrl.config.plugins import PluginError
from clawrl.config.rollout import RolloutConfig
from clawrl.config.validate import validate
from clawrl.data.sample import Sample
from clawrl.rollout.filters import DynamicFilterOutput
from clawrl.rollout.hooks import RolloutFnEvalOutput, RolloutFnTrainOutput
from clawrl.rollout.manager import RolloutManager

HERE = __name__
NO_ENGINE = ["http://127.0.0.1:9"]  # nothing listens there
CALLS: list[tuple] = []


# ---------------------------------------------------------------------------------------------------------------
# plugins
# ---------------------------------------------------------------------------------------------------------------
def _respond(sample: Sample, token: int, status: str = "stop") -> Sample:
    sample.tokens = [7, 8, 9]
    sample.append_response([token, token + 1], [-0.5, -0.25], f"r{token}")
    sample.apply_finish({"type": status}, "v3")
    return sample


async def gen_plain(args, sample, sampling_params):
    CALLS.append(("plain", sample.index, dict(sampling_params)))
    await asyncio.sleep(0.02 * sample.group_index)  # groups finish in index order
    return _respond(sample, 100 + sample.index)


async def gen_with_evaluation(args, sample, sampling_params, evaluation=False):
    CALLS.append(("evaluation", sample.index, evaluation, sampling_params["temperature"]))
    return _respond(sample, 200 + sample.index, status="length" if evaluation else "stop")


async def gen_fanout(args, sample, sampling_params):
    """Two samples per call (e.g. two agents of one episode)."""
    twin = Sample.from_dict(sample.to_dict())
    return [_respond(sample, 300), _respond(twin, 400)]


def gen_sync(args, sample, sampling_params):
    return _respond(sample, 500)


async def gen_bad_type(args, sample, sampling_params):
    return 42


async def rm_index_parity(args, sample, **kwargs):
    """slime's custom-rm signature; reward 0 for even sample indices, 1 for odd ones."""
    assert args.rollout_batch_size >= 1  # the flat slime namespace
    return float(sample.index % 2)


async def rm_token_based(args, sample, **kwargs):
    return 1.0 if sample.tokens[-2] == 300 else 0.0


def filter_bool_odd_groups(args, samples, **kwargs):
    return samples[0].group_index % 2 == 1


def filter_output_even_groups(args, samples, **kwargs):
    keep = samples[0].group_index % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_group")


def filter_bad_type(args, samples, **kwargs):
    return "yes"


def rollout_record(args, rollout_id, data_source, evaluation=False):
    CALLS.append(("rollout", rollout_id, evaluation))
    if evaluation:
        return RolloutFnEvalOutput(
            data={"toy": {"rewards": [1, 0, 1, 1], "truncated": [False, True, False, False]}},
            metrics={"eval/custom": 5.0},
        )
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            _respond(sample, 600)
            sample.reward = float(sample.index)
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/custom": 2.0})


async def rollout_legacy(args, rollout_id, data_source, evaluation=False):
    if evaluation:
        return {"toy": {"rewards": [0.5, 1.0]}}
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            _respond(sample, 700)
            sample.reward = {"score": 2.0 * (sample.index % 2), "other": -1.0}
    return groups


def rollout_bad_type(args, rollout_id, data_source, evaluation=False):
    return "not samples"


def rollout_without_reward(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            _respond(sample, 800)
    return groups


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"prompt {i}", "label": str(i)}) + "\n" for i in range(8)))
    return str(path)


def _manager(prompts, *, eval_data=None, **rollout) -> RolloutManager:
    rollout = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 1, **rollout}
    job = JobConfig(
        data=DataConfig(prompt_data=prompts, label_key="label"),
        rollout=RolloutConfig(**rollout),
        eval=EvalConfig(eval_prompt_data=eval_data or {}),
    )
    return RolloutManager(validate(job), NO_ENGINE, abort_timeout_s=10.0, rollout_timeout_s=60.0)


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


# ---------------------------------------------------------------------------------------------------------------
# --custom-generate-function-path and --custom-rm-path
# ---------------------------------------------------------------------------------------------------------------
def test_custom_generate_plain_signature_and_custom_rm(prompts):
    with _manager(
        prompts,
        custom_generate_function_path=f"{HERE}.gen_plain",
        custom_rm_path=f"{HERE}.rm_index_parity",
        rollout_max_response_len=16,
        rollout_temperature=0.7,
    ) as manager:
        batch, metrics = manager.generate(0)
    assert batch.sample_indices == [0, 1, 2, 3]
    assert batch.tokens[0] == [7, 8, 9, 100, 101]
    assert batch.response_lengths == [2, 2, 2, 2]
    assert batch.rollout_log_probs == [[-0.5, -0.25]] * 4
    assert batch.raw_rewards == [0.0, 1.0, 0.0, 1.0]
    # grpo: (r - mean) / (unbiased std + 1e-6) per group of 2: std of {0, 1} is 1/sqrt(2)
    assert batch.rewards == pytest.approx([-0.7071058, 0.7071058, -0.7071058, 0.7071058], abs=1e-6)
    kinds = {call[0] for call in CALLS}
    assert kinds == {"plain"}
    params = CALLS[0][2]
    assert params["max_new_tokens"] == 16 and params["temperature"] == 0.7
    assert metrics["rollout/raw_reward"] == 0.5


def test_custom_generate_with_evaluation_parameter(prompts, tmp_path):
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text(json.dumps({"input": "q", "label": "1"}) + "\n")
    with _manager(
        prompts,
        eval_data={"toy": str(eval_path)},
        custom_generate_function_path=f"{HERE}.gen_with_evaluation",
        custom_rm_path=f"{HERE}.rm_index_parity",
    ) as manager:
        batch, _ = manager.generate(0)
        metrics = manager.eval(0)
    train_calls = [c for c in CALLS if not c[2]]
    eval_calls = [c for c in CALLS if c[2]]
    assert len(train_calls) == 4 and len(eval_calls) == 1
    assert batch.truncated == [0, 0, 0, 0]
    # one eval prompt, one sample (index 0: reward 0), finish "length" -> truncated
    assert metrics == {"eval/toy": 0.0, "eval/toy-truncated_ratio": 1.0, "eval/toy/response_len/mean": 2.0}


def test_custom_generate_returning_a_list(prompts):
    with _manager(
        prompts, custom_generate_function_path=f"{HERE}.gen_fanout", custom_rm_path=f"{HERE}.rm_token_based"
    ) as manager:
        batch, _ = manager.generate(0)
    # 2 prompts x 2 samples x 2 returned per call; each group (4 samples) is normalised together
    assert len(batch) == 8
    assert batch.raw_rewards == [1.0, 0.0] * 4
    assert batch.group_indices == [0, 0, 0, 0, 1, 1, 1, 1]
    # group {1, 0, 1, 0}: mean 0.5, unbiased std sqrt(1/3) = 0.57735
    assert batch.rewards == pytest.approx([0.8660239, -0.8660239] * 4, abs=1e-5)


def test_sync_generate_function_is_accepted(prompts):
    with _manager(
        prompts, custom_generate_function_path=f"{HERE}.gen_sync", custom_rm_path=f"{HERE}.rm_index_parity"
    ) as manager:
        batch, _ = manager.generate(0)
    assert [t[3] for t in batch.tokens] == [500] * 4


def test_per_sample_generate_function_path_overrides(prompts):
    with _manager(
        prompts, custom_generate_function_path=f"{HERE}.gen_plain", custom_rm_path=f"{HERE}.rm_index_parity"
    ) as manager:
        groups = [[Sample(prompt="p", index=100 + i, group_index=50) for i in range(2)]]
        for sample in groups[0]:
            sample.generate_function_path = f"{HERE}.gen_sync"
        manager.data_source.add_samples(groups)
        batch, _ = manager.generate(0)
    # the buffered group comes first in the data source but sorts after index 0..1 of the fresh prompt
    assert batch.sample_indices == [0, 1, 100, 101]
    assert [t[3] for t in batch.tokens] == [100, 101, 500, 500]


def test_generate_function_with_wrong_return_type_names_flag_and_path(prompts):
    path = f"{HERE}.gen_bad_type"
    manager = _manager(prompts, custom_generate_function_path=path, custom_rm_path=f"{HERE}.rm_index_parity")
    with manager, pytest.raises(PluginError) as info:
        manager.generate(0)
    message = str(info.value)
    assert "--custom-generate-function-path" in message and path in message and "int 42" in message


def test_unloadable_generate_function_fails_at_construction(prompts):
    with pytest.raises(PluginError, match="--custom-generate-function-path.*no attribute 'missing'"):
        _manager(prompts, custom_generate_function_path=f"{HERE}.missing", rm_type="math")


# ---------------------------------------------------------------------------------------------------------------
# --dynamic-sampling-filter-path
# ---------------------------------------------------------------------------------------------------------------
def test_filter_returning_bool(prompts):
    with _manager(
        prompts,
        custom_generate_function_path=f"{HERE}.gen_plain",
        custom_rm_path=f"{HERE}.rm_index_parity",
        dynamic_sampling_filter_path=f"{HERE}.filter_bool_odd_groups",
        over_sampling_batch_size=3,
    ) as manager:
        batch, metrics = manager.generate(0)
        state = manager.state_dict()
    # groups 0..2 submitted; 0 and 2 dropped -> 3..5 submitted; 3 completes the batch; 4, 5 are leftovers
    assert batch.group_indices == [1, 1, 3, 3]
    assert metrics["rollout/dynamic_filter/drop_filter_bool_odd_groups"] == 2.0
    assert state["data_source"]["source"]["offset"] == 6  # leftovers stay consumed (slime)


def test_filter_returning_dynamic_filter_output(prompts):
    with _manager(
        prompts,
        custom_generate_function_path=f"{HERE}.gen_plain",
        custom_rm_path=f"{HERE}.rm_index_parity",
        dynamic_sampling_filter_path=f"{HERE}.filter_output_even_groups",
    ) as manager:
        batch, metrics = manager.generate(0)
    # over-sampling = rollout batch (2): 0 kept, 1 dropped -> 2 more submitted (2, 3); 2 completes the batch
    assert batch.group_indices == [0, 0, 2, 2]
    assert metrics["rollout/dynamic_filter/drop_odd_group"] == 1.0


def test_builtin_zero_std_filter(prompts):
    with _manager(
        prompts,
        custom_generate_function_path=f"{HERE}.gen_plain",
        custom_rm_path=f"{HERE}.rm_token_based",  # every reward 0: every group has zero std
        dynamic_sampling_filter_path="clawrl.rollout.filters.check_reward_nonzero_std",
        rollout_batch_size=1,
    ) as manager:
        # nothing can ever be kept: the rollout runs into its deadline instead of hanging
        manager.rollout_timeout_s = 1.0
        with pytest.raises(TimeoutError, match="within 1.0 s"):
            manager.generate(0)


def test_filter_with_wrong_return_type_names_flag_and_path(prompts):
    path = f"{HERE}.filter_bad_type"
    manager = _manager(
        prompts,
        custom_generate_function_path=f"{HERE}.gen_plain",
        custom_rm_path=f"{HERE}.rm_index_parity",
        dynamic_sampling_filter_path=path,
    )
    with (
        manager,
        pytest.raises(PluginError, match=f"--dynamic-sampling-filter-path '{path}' returned str 'yes'"),
    ):
        manager.generate(0)


# ---------------------------------------------------------------------------------------------------------------
# --rollout-function-path
# ---------------------------------------------------------------------------------------------------------------
def test_rollout_function_returning_records(prompts, tmp_path):
    with _manager(prompts, rollout_function_path=f"{HERE}.rollout_record") as manager:
        batch, metrics = manager.generate(3)
        eval_metrics = manager.eval(3)
    assert CALLS == [("rollout", 3, False), ("rollout", 3, True)]
    assert batch.rollout_id == 3 and batch.sample_indices == [0, 1, 2, 3]
    assert batch.raw_rewards == [0.0, 1.0, 2.0, 3.0]
    assert batch.rewards == pytest.approx([-0.7071058, 0.7071058] * 2, abs=1e-6)
    assert metrics["rollout/custom"] == 2.0 and metrics["rollout/raw_reward"] == 1.5
    assert eval_metrics == {"eval/toy": 0.75, "eval/toy-truncated_ratio": 0.25, "eval/custom": 5.0}


def test_rollout_function_legacy_returns_are_wrapped(prompts):
    with _manager(prompts, rollout_function_path=f"{HERE}.rollout_legacy", reward_key="score") as manager:
        batch, _ = manager.generate(0)
        eval_metrics = manager.eval(0)
    assert batch.raw_rewards == [0.0, 2.0, 0.0, 2.0]
    assert eval_metrics == {"eval/toy": 0.75}


def test_rollout_function_with_wrong_return_type_names_flag_and_path(prompts):
    path = f"{HERE}.rollout_bad_type"
    with _manager(prompts, rollout_function_path=path) as manager:
        with pytest.raises(PluginError, match=f"--rollout-function-path '{path}' returned str"):
            manager.generate(0)
        with pytest.raises(
            PluginError, match=f"--rollout-function-path '{path}' \\(evaluation=True\\) returned str"
        ):
            manager.eval(0)


def test_rollout_function_samples_without_reward_are_rejected(prompts):
    path = f"{HERE}.rollout_without_reward"
    with (
        _manager(prompts, rollout_function_path=path) as manager,
        pytest.raises(PluginError, match=f"--rollout-function-path '{path}': sample index=0 has no reward"),
    ):
        manager.generate(0)


def test_data_source_api_round_trip(prompts, tmp_path):
    with _manager(prompts, rollout_function_path=f"{HERE}.rollout_record") as manager:
        source = manager.data_source
        assert len(source) == 8
        first = source.get_samples(3)
        assert [[s.index for s in g] for g in first] == [[0, 1], [2, 3], [4, 5]]
        source.add_samples([first[1]])
        state = manager.state_dict()
        json.dumps(state)  # plain types only
        replay = source.get_samples(2)
        assert [g[0].index for g in replay] == [2, 6]
        manager.load_state_dict(state)
        assert [g[0].index for g in source.get_samples(2)] == [2, 6]
        with pytest.raises(ValueError, match="group 0 has 1 samples, --n-samples-per-prompt is 2"):
            source.add_samples([[Sample()]])
