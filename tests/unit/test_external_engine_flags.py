"""--rollout-external-engine-addrs and --update-weight-transport: parsing, the flags they exclude, the resource
defaults they change, and the same-model check of discovery (on records, without a server).

    .venv/bin/pytest tests/unit/test_external_engine_flags.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import json

import pytest

from clawrl.cluster.external_engines import (
    ExternalEngineError,
    ExternalEngineInfo,
    ExternalEnginePool,
    check_same_model,
)
from clawrl.cluster.placement import plan_placement
from clawrl.config import ConfigError
from clawrl.config.flags import parse_job_args
from clawrl.config.resources import ResourcesConfig, resolve_resource_defaults

BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--actor-num-gpus-per-node", "1"]  # fmt: skip
EXTERNAL = ["--rollout-external-engine-addrs", "127.0.0.1:30000"]


def test_addresses_split_on_spaces_and_commas_and_drop_http():
    job = parse_job_args([*BASE, "--rollout-external-engine-addrs", "10.0.0.5:30000,h2:1", "http://h3:2/"])
    assert job.resources.rollout_external_engine_addrs == ["10.0.0.5:30000", "h2:1", "h3:2"]


@pytest.mark.parametrize("bad", ["10.0.0.5", "host:port", ":30000", "h:0", "h:70000"])
def test_a_bad_address_names_the_flag_and_the_entry(bad):
    with pytest.raises(ConfigError, match=rf"--rollout-external-engine-addrs: '{bad}' is not HOST:PORT"):
        parse_job_args([*BASE, "--rollout-external-engine-addrs", bad])


def test_the_same_address_twice_is_refused():
    with pytest.raises(ConfigError, match="distinct"):
        parse_job_args([*BASE, "--rollout-external-engine-addrs", "h:1", "h:1"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--colocate"], "--colocate"),
        (["--rollout-num-gpus", "2"], "--rollout-num-gpus 2"),
        (["--offload-rollout"], "--offload-rollout"),
        (["--fault-injection", "engine=0,rollout=1,mode=kill"], "--fault-injection"),
        (["--debug-train-only", "--load-debug-rollout-data", "d_{rollout_id}.pt"], "--debug-train-only"),
    ],
)
def test_flags_about_local_engines_are_refused_with_external_engines(argv, flag):
    with pytest.raises(ConfigError) as info:
        parse_job_args([*BASE, *EXTERNAL, *argv])
    message = str(info.value)
    assert message.startswith(flag) and "--rollout-external-engine-addrs 127.0.0.1:30000" in message


def test_rollout_num_gpus_zero_is_accepted_with_external_engines():
    job = parse_job_args([*BASE, *EXTERNAL, "--rollout-num-gpus", "0"])
    assert job.resources.rollout_num_gpus == 0 and not job.resources.colocate


@pytest.mark.parametrize("num_gpus", [0, 8])
def test_external_engines_give_every_local_device_to_the_trainer(num_gpus):
    res = ResourcesConfig(rollout_external_engine_addrs=["h:1"])
    resolve_resource_defaults(res, num_gpus)
    assert (res.actor_num_gpus, res.rollout_num_gpus, res.colocate) == (max(num_gpus, 1), 0, False)
    plan = plan_placement(res, cluster_gpus=num_gpus, engines=False)
    assert plan.num_engines == 0 and plan.num_trainer_ranks == max(num_gpus, 1)


def test_disk_transport_needs_its_dir_and_the_disk_flags_need_the_disk_transport(tmp_path):
    with pytest.raises(ConfigError, match="--update-weight-transport disk needs --update-weight-disk-dir"):
        parse_job_args([*BASE, "--update-weight-transport", "disk"])
    with pytest.raises(
        ConfigError, match="--update-weight-disk-dir is used only with --update-weight-transport disk"
    ):
        parse_job_args([*BASE, "--update-weight-disk-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="--update-weight-disk-keep-files is used only with"):
        parse_job_args([*BASE, "--update-weight-transport", "distributed", "--update-weight-disk-keep-files"])
    job = parse_job_args(
        [*BASE, *EXTERNAL, "--update-weight-transport", "disk", "--update-weight-disk-dir", "w"]
    )
    assert (job.model.update_weight_transport, job.model.update_weight_disk_dir) == ("disk", "w")


def test_distributed_transport_cannot_share_gpus():
    with pytest.raises(
        ConfigError, match="--update-weight-transport distributed cannot be used with --colocate"
    ):
        parse_job_args([*BASE, "--colocate", "--update-weight-transport", "distributed"])


def write_config(path, **fields):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(fields))
    return str(path)


QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 2048}


def test_same_model_passes_and_a_vocab_mismatch_names_the_address_and_both_values(tmp_path):
    ours = write_config(tmp_path / "ours", **QWEN)
    check_same_model(ExternalEngineInfo(url="http://h:1", model=dict(QWEN)), ours)
    other = ExternalEngineInfo(url="http://h:1", model_path="/m/other", model={**QWEN, "vocab_size": 4096})
    with pytest.raises(ExternalEngineError) as info:
        check_same_model(other, ours)
    message = str(info.value)
    assert "external engine http://h:1" in message and "vocab_size 4096 != 2048" in message
    assert "'/m/other'" in message


def test_an_architecture_mismatch_is_named(tmp_path):
    ours = write_config(tmp_path / "ours", **QWEN)
    llama = ExternalEngineInfo(
        url="http://h:2", model={"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    )
    with pytest.raises(ExternalEngineError, match=r"model_type 'llama' != 'qwen2'; architectures"):
        check_same_model(llama, ours)


def test_an_unknown_served_model_only_warns(tmp_path, caplog):
    ours = write_config(tmp_path / "ours", **QWEN)
    check_same_model(ExternalEngineInfo(url="http://h:3", model_path="/elsewhere"), ours)
    assert "cannot tell whether it serves --hf-checkpoint's model" in caplog.text


def test_an_external_engine_cannot_be_restarted_and_the_error_says_so():
    pool = ExternalEnginePool(["10.0.0.5:30000"], hf_checkpoint=None)
    assert pool.urls == ["http://10.0.0.5:30000"] and pool.actor_infos() == []
    with pytest.raises(
        ExternalEngineError, match="external engine http://10.0.0.5:30000 failed its health check"
    ):
        pool.restart(0, 10.0)
