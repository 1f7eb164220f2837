"""The debugging flags' cross-flag rules (validate) and the engine flags' way into each engine's config."""

import logging

import pytest

from clawrl.cluster.placement import plan_placement
from clawrl.config import ConfigError, parse_job_args
from clawrl.loops.run import engine_config

BASE = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--num-rollout",
    "1",
    "--hf-checkpoint",
    "m",
]


def parse(*extra):
    return parse_job_args([*BASE, *extra])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--debug-rollout-only", "--debug-train-only"], "--debug-rollout-only and --debug-train-only exclude"),
        (["--debug-rollout-only", "--load-debug-rollout-data", "d/{rollout_id}.pt"], "exclude each other"),
        (["--debug-train-only"], "--debug-train-only needs --load-debug-rollout-data"),
        (["--save-debug-rollout-data", "x/{rollout_id}.pt", "--save-debug-train-data", "x/{rollout_id}.pt"],
         "are the same template"),
        (["--save-debug-rollout-data", "x/{step}.pt"], "only {rollout_id} may appear in braces, found {step}"),
        (["--save-debug-rollout-data", "x/{rollout_id.pt"], "is not a valid template"),
        (["--load-debug-rollout-data-subsample", "0"], "--load-debug-rollout-data-subsample must be in (0.0, 1.0]"),
        (["--sglang-mem-fraction-static", "1.0"], "--sglang-mem-fraction-static must be in (0, 1), got 1.0"),
    ],
)  # fmt: skip
def test_bad_debug_flags_are_one_clear_error(flags, message):
    with pytest.raises(ConfigError, match=None) as error:
        parse(*flags)
    assert message in str(error.value)


def test_load_implies_train_only_and_dump_details_sets_both_templates():
    job = parse("--load-debug-rollout-data", "d/{rollout_id}.pt", "--dump-details", "out")
    assert job.debug.debug_train_only is True
    assert job.debug.save_debug_rollout_data == "out/rollout_data/{rollout_id}.pt"
    assert job.debug.save_debug_train_data == "out/train_data/{rollout_id}.pt"


def test_template_without_rollout_id_warns_that_dumps_overwrite(caplog):
    with caplog.at_level(logging.WARNING, logger="clawrl"):
        parse("--save-debug-rollout-data", "one.pt")
    assert "has no {rollout_id}: every dump overwrites one.pt" in caplog.text


def test_rollout_only_gives_the_trainer_gpus_to_the_engines(caplog):
    with caplog.at_level(logging.INFO, logger="clawrl"):
        job = parse("--debug-rollout-only", "--colocate", "--actor-num-gpus-per-node", "4")
    res = job.resources
    assert (res.colocate, res.offload_train, res.offload_rollout, res.rollout_num_gpus) == (
        False,
        False,
        False,
        4,
    )
    assert "--colocate turned off" in caplog.text and "--rollout-num-gpus 4" in caplog.text
    plan = plan_placement(res, cluster_gpus=4, trainer=False)
    assert (plan.mode, plan.trainer_slots, plan.engine_slots) == ("split", [], [0, 1, 2, 3])


def test_train_only_places_the_trainer_alone():
    job = parse("--load-debug-rollout-data", "d/{rollout_id}.pt", "--actor-num-gpus-per-node", "2")
    plan = plan_placement(job.resources, cluster_gpus=2, engines=False)
    assert (plan.num_gpus, plan.trainer_slots, plan.engine_slots) == (2, [0, 1], [])


def test_ci_test_implies_the_weight_checksum_check_except_in_half_runs():
    assert parse("--ci-test").ci.check_weight_update_equal is True
    assert (
        parse("--ci-test", "--debug-rollout-only", "--rollout-num-gpus", "1").ci.check_weight_update_equal
        is False
    )


def test_engine_flags_reach_the_engine_config():
    job = parse(
        "--sglang-mem-fraction-static", "0.3", "--sglang-disable-cuda-graph", "--sglang-context-length", "640",
        "--sglang-max-running-requests", "7", "--sglang-disable-radix-cache", "--attention-backend", "torch",
        "--colocate", "--actor-num-gpus-per-node", "1",
    )  # fmt: skip
    plan = plan_placement(job.resources, cluster_gpus=1)
    config = engine_config(job, plan, 0)
    assert config["mem_fraction_static"] == 0.3 and config["enable_cuda_graph"] is False
    assert config["context_length"] == 640 and config["max_running_requests"] == 7
    assert config["enable_prefix_caching"] is False and config["attention_backend"] == "torch"
    defaults = engine_config(parse("--colocate", "--actor-num-gpus-per-node", "1"), plan, 0)
    assert defaults["mem_fraction_static"] == 0.4 and defaults["enable_cuda_graph"] is True
    assert defaults["attention_backend"] == "triton" and "max_running_requests" not in defaults


def test_wandb_mode_honours_the_flag_then_wandb_mode_then_online(monkeypatch):
    from clawrl.loops.run import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(None) == "offline"
    assert wandb_mode("disabled") == "disabled"
