"""Reward dispatch: build_reward_fn errors, boxed_ prefix, custom paths (both signatures), overrides, batching."""

import argparse
import asyncio
import textwrap
import time

import pytest

from clawrl.config.plugins import PluginError
from clawrl.data.sample import Sample
from clawrl.rollout.rewards import RM_TYPES, batched_reward, build_reward_fn, compute_reward

PLUGIN_SOURCE = textwrap.dedent(
    """
    import asyncio

    async def clawrl_style(sample, **kw):
        return float(len(sample.response))

    async def slime_style(args, sample, **kw):
        return args.bonus + float(sample.label)

    def sync_style(sample, **kw):
        return sample.response == "yes"

    async def dict_style(sample, **kw):
        return {"score": 2.0, "acc": True}

    async def bad_type(sample, **kw):
        return "high"

    async def slow(sample, **kw):
        await asyncio.sleep(0.3)
        return float(sample.index)

    def no_params():
        return 1.0
    """
)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN_SOURCE)
    return path


def _run(fn, sample, **kw):
    return asyncio.run(compute_reward(sample, fn, **kw))


def test_unknown_rm_type_lists_valid_types():
    with pytest.raises(ValueError, match="--rm-type 'mathh' is not a reward type") as info:
        build_reward_fn(rm_type="mathh")
    for rm_type in RM_TYPES:
        assert rm_type in str(info.value)


def test_neither_rm_type_nor_custom_path_names_both_flags():
    with pytest.raises(ValueError, match="--rm-type.*--custom-rm-path"):
        build_reward_fn()


def test_remote_rm_needs_rm_url():
    with pytest.raises(ValueError, match="--rm-type 'remote_rm' needs --rm-url"):
        build_reward_fn(rm_type="remote_rm")


def test_boxed_prefix_reduces_response_to_last_box():
    sample = Sample(response=r"Let me think about New Jersey... \boxed{New York}", label="new york")
    assert _run(build_reward_fn(rm_type="boxed_f1"), sample) == 1.0
    assert _run(build_reward_fn(rm_type="f1"), sample) == pytest.approx(2 * (2 / 8) * 1 / (2 / 8 + 1))
    assert _run(build_reward_fn(rm_type="boxed_f1"), Sample(response="New York", label="new york")) == 0.0


def test_custom_clawrl_signature_from_file_path(plugin_file):
    fn = build_reward_fn(custom_rm_path=f"{plugin_file}:clawrl_style", rm_type="math")  # custom path wins
    assert _run(fn, Sample(response="abcd")) == 4.0


def test_custom_slime_signature_receives_args(plugin_file, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    args = argparse.Namespace(bonus=0.5)
    fn = build_reward_fn(custom_rm_path="my_rewards.slime_style", args=args)  # dotted form
    assert _run(fn, Sample(label="2")) == 2.5
    assert _run(fn, Sample(label="2"), args=argparse.Namespace(bonus=10.0)) == 12.0  # per-call args win


def test_custom_sync_function_returns_float(plugin_file, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    fn = build_reward_fn(custom_rm_path="my_rewards:sync_style")
    assert _run(fn, Sample(response="yes")) == 1.0
    assert _run(fn, Sample(response="no")) == 0.0


def test_custom_function_without_sample_parameter_is_rejected(plugin_file):
    with pytest.raises(PluginError, match="--custom-rm-path .*no_params.*cannot tell how to call it"):
        build_reward_fn(custom_rm_path=f"{plugin_file}:no_params")


def test_reward_of_wrong_type_and_missing_reward_key_are_clear_errors(plugin_file):
    with pytest.raises(ValueError, match="bad_type.*returned str 'high'"):
        _run(build_reward_fn(custom_rm_path=f"{plugin_file}:bad_type"), Sample())
    fn = build_reward_fn(custom_rm_path=f"{plugin_file}:dict_style", reward_key="reward")
    with pytest.raises(ValueError, match=r"keys \['acc', 'score'\]; --reward-key 'reward'"):
        _run(fn, Sample())


def test_dapo_dict_reward_with_reward_key():
    fn = build_reward_fn(rm_type="dapo", reward_key="score")
    sample = Sample(response="Answer: 7", label="7")
    sample.reward = _run(fn, sample)
    assert sample.reward == {"score": 1.0, "acc": True, "pred": "7"}
    assert sample.get_reward_value("score") == 1.0


def test_per_sample_overrides_take_precedence(plugin_file):
    default = build_reward_fn(rm_type="gsm8k")
    response = "#### 5 apples"
    plain = Sample(response=response, label="5")
    by_type = Sample(response=response, label="5", metadata={"rm_type": "f1"})
    by_path = Sample(
        response=response, label="5", metadata={"rm_type": "f1"}, custom_rm_path=f"{plugin_file}:clawrl_style"
    )
    assert _run(default, plain) == 1.0  # gsm8k: 5 == 5
    assert _run(default, by_type) == pytest.approx(2 / 3)  # f1: "5 apples" vs "5" -> P = 1/2, R = 1
    assert _run(default, by_path) == 13.0  # custom path beats metadata: len(response)


def test_unknown_per_sample_rm_type_names_the_sample():
    sample = Sample(index=17, response="x", label="x", metadata={"rm_type": "nope"})
    with pytest.raises(ValueError, match=r"sample 17: metadata\['rm_type'\] 'nope' is not a reward type"):
        _run(build_reward_fn(rm_type="math"), sample)


def test_batched_reward_is_concurrent_and_keeps_order(plugin_file):
    fn = build_reward_fn(custom_rm_path=f"{plugin_file}:slow")
    samples = [Sample(index=i) for i in range(8)]
    start = time.monotonic()
    rewards = asyncio.run(batched_reward(samples, fn))
    assert rewards == [float(i) for i in range(8)]
    assert time.monotonic() - start < 1.5  # 8 x 0.3 s sequentially would be 2.4 s

    start = time.monotonic()
    assert asyncio.run(batched_reward(samples, fn, max_concurrency=4)) == [float(i) for i in range(8)]
    assert time.monotonic() - start >= 0.55  # two waves of 0.3 s


def test_batched_reward_mixes_builtin_types():
    fn = build_reward_fn(rm_type="math")
    samples = [
        Sample(response=r"\boxed{\frac{1}{2}}", label="0.5"),
        Sample(response=r"\boxed{3}", label="4"),
        Sample(response="#### 1,000", label="1000", metadata={"rm_type": "gsm8k"}),
    ]
    assert asyncio.run(batched_reward(samples, fn)) == [1.0, 0.0, 1.0]


def test_custom_rm_path_beats_a_samples_rm_type_as_in_slime(plugin_file):
    # slime's order: sample.custom_rm_path, then --custom-rm-path, then metadata["rm_type"], then --rm-type.
    fn = build_reward_fn(custom_rm_path=f"{plugin_file}:clawrl_style", rm_type="math")
    sample = Sample(response="#### 5 apples", label="5", metadata={"rm_type": "gsm8k"})
    assert _run(fn, sample) == 13.0  # len(response), not gsm8k's 1.0
    by_path = Sample(response="#### 5", label="5", custom_rm_path=f"{plugin_file}:sync_style")
    assert _run(fn, by_path) == 0.0  # the sample's own path still wins


def test_samples_rm_type_is_stripped_and_ignored_when_empty():
    default = build_reward_fn(rm_type="f1")
    padded = Sample(response="#### 5 apples", label="5", metadata={"rm_type": " gsm8k "})
    blank = Sample(response="#### 5 apples", label="5", metadata={"rm_type": "  "})
    assert _run(default, padded) == 1.0  # gsm8k
    assert _run(default, blank) == pytest.approx(2 / 3)  # f1: "5 apples" vs "5"


@pytest.mark.parametrize("rm_type", ["math", "deepscaler"])
def test_text_answers_are_case_insensitive_for_math_graders(rm_type):
    # slime's math grader lower-cases text answers: \boxed{monday} is right for "Monday".
    response = r"<think>which day?</think> It is \boxed{monday}."
    assert _run(build_reward_fn(rm_type=rm_type), Sample(response=response, label="Monday")) == 1.0
    assert _run(build_reward_fn(rm_type=rm_type), Sample(response=response, label="Tuesday")) == 0.0
