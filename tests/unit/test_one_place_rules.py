"""Each rule in one place: cross-flag rules in clawrl/config/validate.py (errors name the flag and value), the
engine dtype and memory tags in clawrl/config/engine.py, one timing helper (clawrl/metrics/timer.py), and the
settings that used to hide in environment variables or in the loop as flags.

    .venv/bin/pytest tests/unit/test_one_place_rules.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import time

import pytest

from clawrl.cluster.placement import plan_placement
from clawrl.config import ConfigError, parse_job_args
from clawrl.config.engine import (
    GENERATION_MEMORY_TAGS,
    MEMORY_TAGS,
    SYNC_MEMORY_TAGS,
    engine_dtype,
)
from clawrl.config.loop_rules import check_loop_flags
from clawrl.metrics.timer import Timers, timed

# 2 prompts x 2 samples, one trainer process and one engine (no GPU).
BASE = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--hf-checkpoint", "m", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]  # fmt: skip
RUNNABLE = ["--prompt-data", "p.jsonl", "--rm-type", "math"]


def parse(*extra: str):
    return parse_job_args([*BASE, *extra])


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------- moved cross-flag rules
def test_train_async_with_colocate_is_refused_by_the_loop_rules_naming_the_flag():
    job = parse(*RUNNABLE, "--colocate")
    message = _error(check_loop_flags, job, asynchronous=True)
    assert message.startswith("--colocate: clawrl train-async needs separate trainer and engine GPUs")
    check_loop_flags(job, asynchronous=False)  # the synchronous loop takes it
    check_loop_flags(parse(*RUNNABLE), asynchronous=True)


@pytest.mark.parametrize(
    ("flags", "engines"),
    [
        (["--fault-injection", "engine=1,rollout=0,mode=kill"], 1),
        (["--fault-injection", "engine=2,rollout=0,mode=hang", "--rollout-num-gpus", "2"], 2),
    ],
)
def test_fault_injection_on_an_engine_the_job_lacks_is_refused_while_validating(flags, engines):
    message = _error(parse, *flags)
    assert message.startswith(f"--fault-injection '{flags[1]}': the job has {engines} engine(s)")
    assert f"--rollout-num-gpus {engines}" in message


def test_fault_injection_target_counts_the_engines_colocate_derives():
    # --colocate without --rollout-num-gpus: one engine per trainer GPU, so engine 1 exists with 2 GPUs only
    colocated = [*BASE[:-2], "--colocate", "--fault-injection", "engine=1,rollout=0,mode=kill"]
    job = parse_job_args([*colocated, "--actor-num-gpus-per-node", "2"])
    assert job.resources.rollout_num_gpus == 2 and job.fault.fault_injection == "engine=1,rollout=0,mode=kill"
    assert "the job has 1 engine(s)" in _error(parse_job_args, colocated)


def test_loop_rules_name_the_missing_inputs_and_the_rank_count():
    assert _error(check_loop_flags, parse("--rm-type", "math"), asynchronous=False).startswith(
        "--prompt-data is required (unset)"
    )
    assert "--rm-type or --custom-rm-path" in _error(
        check_loop_flags, parse("--prompt-data", "p.jsonl"), asynchronous=False
    )
    ranks = parse(*RUNNABLE, "--global-batch-size", "2", "--actor-num-gpus-per-node", "4")
    message = _error(check_loop_flags, ranks, asynchronous=False)
    assert message.startswith("--global-batch-size 2 (samples per optimizer step) is smaller than the 4")
    assert "--actor-num-gpus-per-node 4" in message


# ------------------------------------------------------------------------------- flags instead of env vars
def test_multi_node_defaults_to_on_with_ray_address_only():
    assert parse().resources.multi_node is False
    assert parse("--ray-address", "10.0.0.1:6379").resources.multi_node is True
    assert parse("--ray-address", "10.0.0.1:6379", "--no-multi-node").resources.multi_node is False
    assert parse("--multi-node").resources.multi_node is True


def test_engines_listen_on_loopback_unless_multi_node():
    from clawrl.cluster.engine_actor import listen_host

    assert listen_host(multi_node=False) == "127.0.0.1"


def test_train_kernels_is_a_flag_with_two_values():
    assert parse().train.train_kernels == "triton"
    assert parse("--train-kernels", "torch").train.train_kernels == "torch"
    assert "--train-kernels: invalid choice: 'eager'" in _error(parse, "--train-kernels", "eager")


# ------------------------------------------------------------------------------- engine config, decided once
def test_engine_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    assert engine_dtype("cpu") == "float32"
    assert engine_dtype("cuda") == engine_dtype("cuda:1") == "bfloat16"


def test_every_released_memory_tag_is_resumed_exactly_once():
    assert sorted(MEMORY_TAGS) == sorted(SYNC_MEMORY_TAGS + GENERATION_MEMORY_TAGS)
    assert not set(SYNC_MEMORY_TAGS) & set(GENERATION_MEMORY_TAGS)


def test_engine_sizing_flags_reach_each_engine_config():
    from clawrl.loops.run import engine_config

    job = parse(
        "--sglang-chunked-prefill-size", "512", "--sglang-page-size", "32", "--sglang-max-total-tokens", "1000",
        "--sglang-disable-overlap-schedule", "--sglang-max-running-requests", "5",
    )  # fmt: skip
    plan = plan_placement(job.resources, cluster_gpus=0)
    config = engine_config(job, plan, 0)
    assert config["max_num_batched_tokens"] == 512 and config["block_size"] == 32
    assert config["num_kv_blocks"] == 32  # ceil(1000 / 32): whole pages
    assert config["enable_overlap_schedule"] is False and config["max_running_requests"] == 5
    assert config["dtype"] == "float32" and config["device"] == "cpu"
    # the engine's own page size (16) when only the token count is given: ceil(1000 / 16) = 63
    assert engine_config(parse("--sglang-max-total-tokens", "1000"), plan, 0)["num_kv_blocks"] == 63
    defaults = engine_config(parse(), plan, 0)
    for name in ("max_num_batched_tokens", "block_size", "num_kv_blocks", "enable_overlap_schedule"):
        assert name not in defaults, name  # unset flags leave the engine's defaults


def test_engine_config_built_from_the_flags_is_accepted_by_the_engine():
    from clawrl.engine.config import EngineConfig
    from clawrl.loops.run import engine_config

    job = parse(
        "--sglang-page-size", "8", "--sglang-max-total-tokens", "100", "--sglang-chunked-prefill-size", "64"
    )
    config = EngineConfig(**engine_config(job, plan_placement(job.resources, cluster_gpus=0), 0))
    assert (config.block_size, config.num_kv_blocks, config.max_num_batched_tokens) == (8, 13, 64)


@pytest.mark.parametrize(
    "flag", ["--sglang-chunked-prefill-size", "--sglang-page-size", "--sglang-max-total-tokens"]
)
def test_engine_sizing_flags_must_be_positive(flag):
    assert f"{flag} must be >= 1, got 0" in _error(parse, flag, "0")


# ------------------------------------------------------------------------------- one timing helper
def test_timed_returns_the_result_and_the_wall_seconds():
    out, seconds = timed(lambda a, b: time.sleep(0.05) or a + b, 2, 3)
    assert out == 5 and 0.05 <= seconds < 1.0


def test_timers_totals_accumulate_per_name_without_the_step_time():
    ticks = iter([0.0, 1.0, 3.0, 10.0, 14.0])
    timers = Timers(clock=lambda: next(ticks))
    with timers("log_probs"):  # 0 -> 1
        pass
    with timers("log_probs"):  # 3 -> 10
        pass
    assert timers.totals() == {"log_probs": 8.0}
    assert timers.pop() == {"perf/log_probs_time": 8.0, "perf/step_time": 14.0}
    assert timers.totals() == {}
