"""Tests of clawrl/config and `clawrl train`: per-field checks, cross-flag validation, serialisation, help.

Every rule is tested with input that passes and input that fails, and failures must name the flag and value.
"""

import argparse
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from clawrl.config import (
    ConfigError,
    JobConfig,
    build_job_parser,
    job_from_namespace,
    parse_job_args,
    validate,
)
from clawrl.config.algo import AlgoConfig
from clawrl.config.eval import EvalConfig
from clawrl.config.fields import field_docstrings, field_specs
from clawrl.config.rollout import RolloutConfig
from clawrl.config.train import TrainConfig

# 4 prompts x 2 samples = 8 samples per rollout.
BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3"]
GROUPS = [
    "model",
    "data",
    "rollout",
    "eval",
    "engine",
    "train",
    "algo",
    "resources",
    "logging",
    "ci",
    "fault",
    "debug",
]


def parse(*extra: str) -> JobConfig:
    return parse_job_args([*BASE, *extra])


def error_of(*extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(*extra)
    return str(info.value)


# ---- defaults -------------------------------------------------------------------------------------------


def test_defaults_are_slimes():
    job = parse()
    assert (job.train.lr, job.train.micro_batch_size, job.train.seed, job.train.clip_grad) == (
        1e-6,
        1,
        1234,
        1.0,
    )
    assert (job.train.adam_beta1, job.train.adam_beta2, job.train.loss_type) == (0.9, 0.95, "policy_loss")
    assert (job.rollout.rollout_temperature, job.rollout.rollout_top_p, job.rollout.rollout_top_k) == (
        1.0,
        1.0,
        -1,
    )
    assert job.rollout.rollout_seed == 42
    assert (job.data.input_key, job.data.metadata_key, job.data.tool_key) == ("input", "metadata", "tools")
    assert job.data.label_key is None
    assert job.model.update_weight_buffer_size == 512 * 1024 * 1024
    assert job.model.model_impl == "native"
    assert (job.algo.advantage_estimator, job.algo.eps_clip, job.algo.kl_loss_type) == ("grpo", 0.2, "k1")
    assert (job.algo.tis_clip, job.algo.tis_clip_low, job.algo.gamma, job.algo.lambd) == (2.0, 0.0, 1.0, 1.0)
    assert job.algo.rewards_normalization and job.algo.grpo_std_normalization
    assert (job.resources.actor_num_nodes, job.resources.actor_num_gpus_per_node) == (
        1,
        None,
    )  # the machine's
    assert job.resources.rollout_num_gpus_per_engine == 1


def test_typed_values_and_lists_parse():
    job = parse("--rollout-stop", "</s>", "\n\n", "--rollout-stop-token-ids", "2", "7", "--lr", "3e-6")
    assert job.rollout.rollout_stop == ["</s>", "\n\n"]
    assert job.rollout.rollout_stop_token_ids == [2, 7]
    assert job.train.lr == 3e-6


def test_disable_flags_store_false_into_slime_dests():
    job = parse("--disable-rewards-normalization", "--disable-grpo-std-normalization")
    assert job.algo.rewards_normalization is False
    assert job.algo.grpo_std_normalization is False


def test_fast_single_rank_is_unset_by_default_and_switches_both_ways():
    from clawrl.trainer.single_rank import use_single_rank

    assert parse().train.fast_single_rank is None
    assert parse("--no-fast-single-rank").train.fast_single_rank is False
    assert parse("--fast-single-rank").train.fast_single_rank is True
    # unset: on exactly at one rank; --no-fast-single-rank forces FSDP2 there
    assert use_single_rank(None, 1) and not use_single_rank(None, 2) and not use_single_rank(False, 1)
    with pytest.raises(ValueError, match="--fast-single-rank needs a trainer of one rank, this one has 4"):
        use_single_rank(True, 4)


# ---- single-field checks (__post_init__) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rollout-temperature", "0"], "--rollout-temperature must be > 0, got 0.0"),
        (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1], got 1.5"),
        (["--rollout-top-k", "0"], "--rollout-top-k must be -1 (off) or >= 1, got 0"),
        (["--rollout-batch-size", "0"], "--rollout-batch-size must be >= 1, got 0"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1, got 0"),
        (["--rollout-stop-token-ids", "3", "-1"], "--rollout-stop-token-ids must be >= 0, got -1"),
        (["--rollout-stop", ""], "--rollout-stop must not be empty, got ''"),
        (["--eval-top-p", "0"], "--eval-top-p must be in (0, 1], got 0.0"),
        (["--eval-temperature", "-0.5"], "--eval-temperature must be >= 0, got -0.5"),
        (["--eps-clip-c", "1.0"], "--eps-clip-c must be > 1, got 1.0"),
        (["--gamma", "1.5"], "--gamma must be in [0, 1], got 1.5"),
        (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1], got 1.5"),
        (["--lr", "-0.5"], "--lr must be >= 0, got -0.5"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (["--save-interval", "0"], "--save-interval must be >= 1, got 0"),
        (["--update-weight-buffer-size", "0"], "--update-weight-buffer-size must be >= 1, got 0"),
        (["--actor-num-gpus-per-node", "0"], "--actor-num-gpus-per-node must be >= 1, got 0"),
        (["--rollout-num-gpus-per-engine", "0"], "--rollout-num-gpus-per-engine must be >= 1, got 0"),
        (["--run-name", "a/b"], "--run-name must be non-empty without '/', got 'a/b'"),
        (
            ["--ci-metric-checker-key", "eval/gsm8k"],
            "--ci-metric-checker-key and --ci-metric-checker-threshold go together; got key 'eval/gsm8k' and "
            "threshold None",
        ),
        (
            ["--ci-train-rollout-logprob-abs-diff-threshold", "-1"],
            "--ci-train-rollout-logprob-abs-diff-threshold must be >= 0, got -1.0",
        ),
    ],
)
def test_bad_single_values_name_flag_and_value(flags, message):
    assert error_of(*flags) == message


def test_single_field_checks_pass_at_their_bounds():
    job = parse("--rollout-top-p", "1", "--rollout-top-k", "1", "--eval-temperature", "0", "--gamma", "0")
    assert (job.rollout.rollout_top_p, job.rollout.rollout_top_k, job.eval.eval_temperature) == (1.0, 1, 0.0)
    assert parse("--eps-clip-c", "3").algo.eps_clip_c == 3.0


@pytest.mark.parametrize(
    "flags, parts",
    [
        (["--advantage-estimator", "a2c"], ["--advantage-estimator", "a2c"]),
        (["--lr", "fast"], ["--lr", "fast"]),
        (["--rollout-batch", "4"], ["unrecognized arguments", "--rollout-batch"]),  # no abbreviations
    ],
)
def test_parse_errors_are_config_errors(flags, parts):
    message = error_of(*flags)
    assert all(part in message for part in parts), message


def test_missing_rollout_batch_size_is_named():
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        parse_job_args(["--num-rollout", "3"])


def test_python_construction_is_type_checked():
    with pytest.raises(ConfigError, match=r"^--rollout-batch-size must be an int, got '4'$"):
        RolloutConfig(rollout_batch_size="4")
    with pytest.raises(ConfigError, match="--rollout-batch-size must be an int, got True"):
        RolloutConfig(rollout_batch_size=True)
    with pytest.raises(ConfigError, match="--rollout-stop must be a list of str, got '</s>'"):
        RolloutConfig(rollout_batch_size=1, rollout_stop="</s>")
    with pytest.raises(ConfigError, match=r"--advantage-estimator must be one of grpo, gspo, .*, got 'a2c'"):
        AlgoConfig(advantage_estimator="a2c")
    with pytest.raises(ConfigError, match="--eval-prompt-data must map names"):
        EvalConfig(eval_prompt_data={"gsm8k": 1})
    lr = TrainConfig(lr=1).lr  # an int where a float is expected becomes a float
    assert lr == 1.0 and isinstance(lr, float)


# ---- --eval-prompt-data ---------------------------------------------------------------------------------


def test_eval_prompt_data_is_an_ordered_name_to_path_dict():
    job = parse("--eval-prompt-data", "zeta", "z.jsonl", "alpha", "a.parquet@[0:10]")
    assert job.eval.eval_prompt_data == {"zeta": "z.jsonl", "alpha": "a.parquet@[0:10]"}
    assert list(job.eval.eval_prompt_data) == ["zeta", "alpha"]
    assert parse().eval.eval_prompt_data == {}


def test_eval_prompt_data_odd_count_and_duplicates_are_errors():
    message = error_of("--eval-prompt-data", "gsm8k", "g.jsonl", "math")
    assert (
        message == "--eval-prompt-data takes NAME PATH pairs, got an odd number of values: gsm8k g.jsonl math"
    )
    assert error_of("--eval-prompt-data", "a", "x", "a", "y") == "--eval-prompt-data names 'a' twice"


# ---- cross-flag validation ------------------------------------------------------------------------------


def test_eps_clip_high_defaults_to_eps_clip():
    assert parse("--eps-clip", "0.3").algo.eps_clip_high == 0.3
    job = parse("--eps-clip-high", "0.28")
    assert (job.algo.eps_clip, job.algo.eps_clip_high) == (0.2, 0.28)


def test_kl_coef_and_kl_loss_coef_not_both():
    message = error_of(
        "--hf-checkpoint", "m", "--advantage-estimator", "ppo", "--kl-coef", "0.1", "--kl-loss-coef", "0.01"
    )
    assert "--kl-coef 0.1" in message and "--kl-loss-coef 0.01" in message
    job = parse("--hf-checkpoint", "m", "--use-kl-loss", "--kl-loss-coef", "0.01")
    assert (job.algo.kl_coef, job.algo.kl_loss_coef) == (0.0, 0.01)


def test_kl_terms_need_a_reference_model():
    assert error_of("--use-kl-loss").startswith("--use-kl-loss needs a reference model")
    message = error_of("--advantage-estimator", "ppo", "--kl-coef", "0.05")
    assert message.startswith("--kl-coef 0.05 needs a reference model")


def test_ref_load_defaults_to_hf_checkpoint_without_touching_disk():
    job = parse("--use-kl-loss", "--hf-checkpoint", "models/not-on-disk")
    assert job.model.ref_load == "models/not-on-disk"
    assert parse("--hf-checkpoint", "m").model.ref_load == "m"
    assert parse().model.ref_load is None  # no KL term, no model: nothing to default from


def test_explicit_ref_load_must_exist(tmp_path):
    missing = str(tmp_path / "missing")
    assert error_of("--use-kl-loss", "--ref-load", missing) == f"--ref-load {missing!r} does not exist"
    assert parse("--use-kl-loss", "--ref-load", str(tmp_path)).model.ref_load == str(tmp_path)


def test_one_sample_per_prompt_turns_off_std_normalisation(caplog):
    with caplog.at_level(logging.INFO, logger="clawrl.config"):
        job = parse("--n-samples-per-prompt", "1")
    assert job.algo.grpo_std_normalization is False
    assert "--n-samples-per-prompt 1" in caplog.text
    assert parse("--n-samples-per-prompt", "2").algo.grpo_std_normalization is True


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_needs_normalize_advantages(estimator):
    message = error_of("--advantage-estimator", estimator)
    assert message == f"--advantage-estimator {estimator} requires --normalize-advantages"
    assert parse("--advantage-estimator", estimator, "--normalize-advantages").algo.normalize_advantages


def test_num_steps_per_rollout_sets_global_batch_size():
    job = parse("--num-steps-per-rollout", "2")
    assert (job.train.global_batch_size, job.train.num_steps_per_rollout) == (4, 2)
    assert parse("--num-steps-per-rollout", "2", "--global-batch-size", "4").train.global_batch_size == 4
    message = error_of("--num-steps-per-rollout", "2", "--global-batch-size", "2")
    assert message.startswith("--global-batch-size 2 disagrees with --num-steps-per-rollout 2")
    assert message.endswith("= 8 samples per rollout // 2 = 4")
    message = error_of("--num-steps-per-rollout", "3")
    assert message.startswith("--num-steps-per-rollout 3 must divide")
    assert "--rollout-batch-size 4 x --n-samples-per-prompt 2 = 8 samples per rollout" in message


def test_global_batch_size_defaults_to_one_step_and_must_divide_the_rollout():
    job = parse()
    assert (job.train.global_batch_size, job.train.num_steps_per_rollout) == (8, 1)
    assert parse("--global-batch-size", "2").train.num_steps_per_rollout == 4
    for gbs in ("3", "16"):
        message = error_of("--global-batch-size", gbs)
        assert message.startswith(f"--global-batch-size {gbs} must divide the --rollout-batch-size 4")


def test_over_sampling_batch_size_defaults_to_and_is_at_least_the_rollout_batch_size():
    assert parse().rollout.over_sampling_batch_size == 4
    assert parse("--over-sampling-batch-size", "8").rollout.over_sampling_batch_size == 8
    message = error_of("--over-sampling-batch-size", "3")
    assert message == "--over-sampling-batch-size 3 must be >= --rollout-batch-size 4"


def test_dynamic_batch_size_needs_max_tokens_per_gpu():
    assert "--max-tokens-per-gpu" in error_of("--use-dynamic-batch-size")
    assert parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096").train.max_tokens_per_gpu == 4096


def test_eval_interval_needs_eval_data_and_eval_sampling_defaults_to_rollout():
    assert error_of("--eval-interval", "5").startswith("--eval-interval 5 requires --eval-prompt-data")
    job = parse(
        "--eval-interval", "5", "--eval-prompt-data", "gsm8k", "g.jsonl", "--rollout-temperature", "0.7",
        "--rollout-top-p", "0.9", "--rollout-top-k", "20", "--rollout-max-response-len", "64",
    )  # fmt: skip
    e = job.eval
    assert (e.eval_temperature, e.eval_top_p, e.eval_top_k, e.eval_max_response_len) == (0.7, 0.9, 20, 64)
    e = parse("--rollout-top-p", "0.9", "--eval-temperature", "0", "--eval-top-k", "1").eval
    assert (e.eval_temperature, e.eval_top_p, e.eval_top_k) == (0.0, 0.9, 1)


def test_save_interval_needs_save(tmp_path):
    assert error_of("--save-interval", "10") == "--save-interval 10 requires --save DIR or --save-hf TEMPLATE"
    assert parse("--save-interval", "10", "--save", str(tmp_path)).model.save_interval == 10


def test_offload_and_colocate_resolve_like_slime():
    r = parse().resources
    assert (r.offload_train, r.offload_rollout, r.rollout_num_gpus) == (False, False, None)
    r = parse("--offload").resources
    assert (r.offload_train, r.offload_rollout) == (True, True)
    r = parse("--offload-rollout").resources
    assert (r.offload_train, r.offload_rollout) == (False, True)
    r = parse("--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2").resources
    assert (r.offload_train, r.offload_rollout, r.rollout_num_gpus) == (True, True, 4)
    r = parse("--colocate", "--no-offload-train", "--rollout-num-gpus", "1").resources
    assert (r.offload_train, r.offload_rollout, r.rollout_num_gpus) == (False, True, 1)


def test_rollout_num_gpus_per_engine_must_divide_rollout_num_gpus():
    message = error_of("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "3")
    assert message == "--rollout-num-gpus-per-engine 3 must divide --rollout-num-gpus 4"
    message = error_of("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "4")
    assert message.startswith(
        "--rollout-num-gpus-per-engine 4 must divide --rollout-num-gpus 2 (from --colocate"
    )
    assert (
        parse("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2").resources.rollout_num_gpus == 4
    )
    assert (
        parse("--rollout-num-gpus", "0", "--rollout-num-gpus-per-engine", "2").resources.rollout_num_gpus == 0
    )


def test_num_rollout_or_num_epoch_is_required():
    with pytest.raises(ConfigError, match="one of --num-rollout or --num-epoch is required"):
        parse_job_args(["--rollout-batch-size", "4"])
    with pytest.raises(ConfigError, match=r"^--num-epoch 2 requires --prompt-data"):
        parse_job_args(["--rollout-batch-size", "4", "--num-epoch", "2"])
    job = parse_job_args(["--rollout-batch-size", "4", "--num-epoch", "2", "--prompt-data", "p.jsonl"])
    assert (job.data.num_epoch, job.rollout.num_rollout) == (2, None)


def test_remote_rm_custom_loss_and_lr_rules():
    assert error_of("--rm-type", "remote_rm") == "--rm-type remote_rm requires --rm-url URL (unset)"
    assert (
        parse("--rm-type", "remote_rm", "--rm-url", "http://localhost:1").rollout.rm_url
        == "http://localhost:1"
    )
    assert "--custom-loss-function-path" in error_of("--loss-type", "custom_loss")
    assert (
        parse("--loss-type", "custom_loss", "--custom-loss-function-path", "m.f").train.loss_type
        == "custom_loss"
    )
    assert error_of("--lr", "1e-6", "--min-lr", "1e-5") == "--min-lr 1e-05 must be <= --lr 1e-06"
    assert (
        error_of("--tis-clip", "2", "--tis-clip-low", "3") == "--tis-clip-low 3.0 must be <= --tis-clip 2.0"
    )


def test_kl_coef_without_effect_is_an_error():
    # grpo folds no KL into rewards, and the advantage code refuses a --kl-coef it would ignore
    message = error_of("--hf-checkpoint", "m", "--kl-coef", "0.1")
    assert message.startswith("--kl-coef 0.1 has no effect with --advantage-estimator grpo")


def test_run_name_and_output_dir_defaults():
    log = parse().logging
    assert re.fullmatch(r"run-\d{8}-\d{6}", log.run_name)
    assert log.output_dir == os.path.join("outputs", log.run_name)
    assert parse("--run-name", "exp1").logging.output_dir == os.path.join("outputs", "exp1")
    assert parse("--output-dir", "/data/out").logging.output_dir == "/data/out"


def test_validate_returns_a_copy_and_is_idempotent():
    namespace = build_job_parser().parse_args([*BASE, "--colocate", "--actor-num-gpus-per-node", "2"])
    job = job_from_namespace(namespace)
    resolved = validate(job)
    assert job.resources.offload_train is None and job.train.global_batch_size is None  # input untouched
    assert resolved.resources.offload_train is True and resolved.train.global_batch_size == 8
    assert validate(resolved) == resolved


# ---- serialisation and the slime namespace --------------------------------------------------------------

RICH = [
    "--eval-prompt-data", "gsm8k", "g.jsonl", "math", "m.jsonl", "--rollout-stop", "</s>",
    "--rollout-stop-token-ids", "2", "--disable-rewards-normalization", "--colocate",
    "--actor-num-gpus-per-node", "1", "--run-name", "r",
]  # fmt: skip


def test_to_dict_from_dict_round_trip_through_json():
    job = parse(*RICH)
    plain = json.loads(json.dumps(job.to_dict()))
    assert plain == job.to_dict()
    assert list(plain) == GROUPS
    back = JobConfig.from_dict(plain)
    assert back == job
    assert list(back.eval.eval_prompt_data) == ["gsm8k", "math"]


def test_from_dict_rejects_unknown_missing_and_bad_values():
    plain = parse().to_dict()
    with pytest.raises(ConfigError, match="unknown config component"):
        JobConfig.from_dict({**plain, "optim": {}})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['rollout_batchsize'\]"):
        JobConfig.from_dict({**plain, "rollout": {**plain["rollout"], "rollout_batchsize": 3}})
    with pytest.raises(ConfigError, match="no 'rollout' component"):
        JobConfig.from_dict({"model": plain["model"]})
    with pytest.raises(ConfigError, match=r"^--rollout-temperature must be > 0, got 0.0$"):
        JobConfig.from_dict({**plain, "rollout": {**plain["rollout"], "rollout_temperature": 0.0}})
    assert JobConfig.from_dict({"rollout": {"rollout_batch_size": 2}}).rollout.rollout_batch_size == 2


def test_to_namespace_has_every_slime_dest_name():
    job = parse(*RICH)
    namespace = job.to_namespace()
    assert isinstance(namespace, argparse.Namespace)
    names = [spec.name for _, cls in JobConfig.components() for spec in field_specs(cls)]
    assert len(names) == len(set(names)) == len(vars(namespace))  # unique across components, all present
    assert namespace.rollout_batch_size == 4 and namespace.n_samples_per_prompt == 2
    assert namespace.global_batch_size == 8  # derived by validate
    assert namespace.rewards_normalization is False and namespace.grpo_std_normalization is True
    assert namespace.eval_prompt_data == ["gsm8k", "g.jsonl", "math", "m.jsonl"]  # slime's flat list
    assert namespace.offload_train is True and namespace.rollout_stop == ["</s>"]
    namespace.rollout_stop.append("x")  # a plugin mutating args does not reach the job
    assert job.rollout.rollout_stop == ["</s>"]
    assert parse().to_namespace().eval_prompt_data is None


# ---- help text ------------------------------------------------------------------------------------------


def test_every_field_has_a_one_line_docstring_shown_in_help():
    help_text = "".join(build_job_parser().format_help().split())  # argparse re-wraps lines, even at hyphens
    for _, cls in JobConfig.components():
        docs = field_docstrings(cls)
        assert list(docs) == [f.name for f in dataclasses.fields(cls)], cls
        for name, doc in docs.items():
            assert doc and "\n" not in doc, f"{cls.__name__}.{name}"
            assert "".join(doc.split()) in help_text, name


# ---- the CLI, as a user runs it -------------------------------------------------------------------------


def clawrl(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "clawrl.cli.main", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_help_lists_every_flag_in_its_components_group(command):
    result = clawrl(command, "--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    starts = [lines.index(f"{title}:") for title in GROUPS]  # each group title is a line of its own
    assert starts == sorted(starts)
    ends = [*starts[1:], len(lines)]
    for (component, cls), begin, end in zip(JobConfig.components(), starts, ends, strict=True):
        section = "\n".join(lines[begin:end])
        for spec in field_specs(cls):
            flag_line = rf"^ +{re.escape(spec.flag)}(?=[ ,]|$)"
            assert re.search(flag_line, section, re.MULTILINE), (component, spec.flag)
    assert "--no-offload-train" in result.stdout and "--help" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rollout-temperature", "0"], "clawrl train: error: --rollout-temperature must be > 0, got 0.0"),
        (
            ["--rollout-batch-size", "four"],
            "clawrl train: error: argument --rollout-batch-size: invalid int value: 'four'",
        ),
        (["--num-steps-per-rollout", "3"], "clawrl train: error: --num-steps-per-rollout 3 must divide the"),
    ],
)
def test_bad_value_is_one_line_and_exit_code_2(argv, message):
    result = clawrl("train", *BASE, *argv)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(message)
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_train_async_refuses_colocate_before_starting_anything():
    result = clawrl("train-async", *BASE, "--colocate")
    assert result.returncode == 2
    assert result.stderr == (
        "clawrl train-async: error: --colocate: clawrl train-async needs separate trainer and engine GPUs; "
        "drop --colocate\n"
    )
