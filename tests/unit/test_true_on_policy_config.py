"""--true-on-policy-mode (alias --true-on-policy) as configuration: the flag and its alias, the settings
`validate` and EngineConfig refuse with the reason, and --ci-test's exact train/rollout log-prob check.

    .venv/bin/pytest tests/unit/test_true_on_policy_config.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import json

import pytest

from clawrl.config import ConfigError, parse_job_args
from clawrl.engine.config import EngineConfig
from clawrl.metrics.checks import CITestChecks, MetricCheckError, build_checks

BASE = ["--hf-checkpoint", "model", "--num-rollout", "1", "--rollout-batch-size", "2"]


@pytest.fixture
def interpreter(monkeypatch):
    """The CPU tests' way to run the kernels (no CUDA here)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("flag", ["--true-on-policy-mode", "--true-on-policy"])
def test_flag_and_alias(interpreter, flag):
    job = parse_job_args([*BASE, flag])
    assert job.model.uses_true_on_policy
    assert not parse_job_args(BASE).model.uses_true_on_policy


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-impl", "hf"], "--true-on-policy-mode cannot be combined with --model-impl hf"),
        (["--lora-rank", "8"], "--true-on-policy-mode cannot be combined with --lora-rank 8"),
        (["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"],
         "--true-on-policy-mode cannot be combined with --rollout-num-gpus-per-engine 2"),
        (["--rollout-external-engine-addrs", "10.0.0.1:30000"],
         "--true-on-policy-mode cannot be combined with --rollout-external-engine-addrs"),
    ],
)  # fmt: skip
def test_validate_refuses(interpreter, argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_job_args([*BASE, "--true-on-policy-mode", *argv])


def test_validate_refuses_moe_checkpoint_and_names_the_alias(interpreter, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    argv = [*BASE[2:], "--hf-checkpoint", str(tmp_path), "--true-on-policy"]
    with pytest.raises(ConfigError, match=r"--true-on-policy cannot be combined with --hf-checkpoint .*MoE"):
        parse_job_args(argv)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert parse_job_args(argv).model.uses_true_on_policy


def test_validate_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="--true-on-policy-mode needs CUDA GPUs"):
        parse_job_args([*BASE, "--true-on-policy-mode"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp_size": 2}, "needs tp_size 1"),
        ({"model_impl": "hf"}, "needs the native model code"),
        ({"attention_backend": "torch"}, "attention_backend='torch'"),
    ],
)
def test_engine_config_refuses(interpreter, fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", true_on_policy_mode=True, **fields)


def test_engine_config_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="true_on_policy_mode needs a CUDA device, got device='cpu'"):
        EngineConfig(model_path="m", true_on_policy_mode=True)


def test_ci_test_demands_exactly_zero_difference(interpreter):
    check = next(c for c in build_checks(parse_job_args([*BASE, "--ci-test", "--true-on-policy"]))
                 if isinstance(c, CITestChecks))  # fmt: skip
    check.on_log(0, {"train/train_rollout_logprob_abs_diff": 0.0})
    with pytest.raises(MetricCheckError, match=r"= 1e-09 at step 1, expected <= 0 \(--true-on-policy-mode\)"):
        check.on_log(1, {"train/train_rollout_logprob_abs_diff": 1e-9})
    CITestChecks().on_log(1, {"train/train_rollout_logprob_abs_diff": 1e-9})  # default: <= 0.1
