"""GPU counts the user left unset, filled from the machine: CPU, 1 GPU, 8 GPUs, explicit flags, train-async;
and the throughput label of the progress line per device kind.

    .venv/bin/pytest tests/unit/test_resource_defaults.py -q
"""

from __future__ import annotations

import pytest

from clawrl.cluster.placement import PlacementError, plan_placement
from clawrl.config import ConfigError, validate
from clawrl.config.resources import ResourcesConfig, resolve_resource_defaults
from clawrl.metrics.progress import format_progress


def resolved(num_gpus: int, *, can_colocate: bool = True, **flags) -> tuple[ResourcesConfig, str | None]:
    res = ResourcesConfig(**flags)
    return res, resolve_resource_defaults(res, num_gpus, can_colocate=can_colocate)


def counts(res: ResourcesConfig) -> tuple[int, int | None, bool]:
    return res.actor_num_gpus, res.rollout_num_gpus, res.colocate


def test_cpu_machine_runs_one_trainer_process_and_one_engine():
    res, note = resolved(0)
    assert counts(res) == (1, 1, False)
    assert note == (
        "no GPU found: 1 trainer process and 1 engine on CPU "
        "(set --actor-num-gpus-per-node / --rollout-num-gpus to change)"
    )
    plan = plan_placement(res, cluster_gpus=0)
    assert (plan.mode, plan.trainer_slots, plan.engine_slots) == ("cpu", [0], [1])


def test_cpu_machine_keeps_explicit_counts_and_counts_them_in_the_note():
    res, note = resolved(0, actor_num_gpus_per_node=2)
    assert counts(res) == (2, 1, False)
    assert note.startswith("no GPU found: 2 trainer processes and 1 engine on CPU")
    res, note = resolved(0, rollout_num_gpus=3)
    assert counts(res) == (1, 3, False)
    assert note.startswith("no GPU found: 1 trainer process and 3 engines on CPU")


def test_one_gpu_machine_colocates_trainer_and_engine():
    res, note = resolved(1)
    assert counts(res) == (1, 1, True)
    assert note == (
        "1 GPU found: 1 trainer rank and 1 engine colocated on them, taking turns "
        "(set --actor-num-gpus-per-node / --rollout-num-gpus / --colocate to change)"
    )
    plan = plan_placement(res, cluster_gpus=1)
    assert (plan.mode, plan.num_gpus, plan.trainer_slots, plan.engine_slots) == ("colocate", 1, [0], [0])


def test_eight_gpu_machine_uses_every_gpu_colocated_and_validate_turns_on_the_offloads():
    res, note = resolved(8)
    assert counts(res) == (8, 8, True)
    assert note.startswith("8 GPUs found: 8 trainer ranks and 8 engines colocated on them, taking turns")
    plan = plan_placement(res, cluster_gpus=8)
    assert (plan.mode, plan.num_gpus, plan.engine_slots) == ("colocate", 8, list(range(8)))
    from clawrl.config.flags import build_job_parser, job_from_namespace

    job = job_from_namespace(
        build_job_parser().parse_args(["--rollout-batch-size", "8", "--num-rollout", "1"])
    )
    resolve_resource_defaults(job.resources, 8)
    r = validate(job).resources
    assert (r.colocate, r.offload_train, r.offload_rollout) == (True, True, True)


def test_explicit_flags_win_and_nothing_is_said_when_every_count_was_given():
    res, note = resolved(8, actor_num_gpus_per_node=2, rollout_num_gpus=3)
    assert (counts(res), note) == ((2, 3, False), None)
    res, note = resolved(0, actor_num_gpus_per_node=4, colocate=True)
    assert (counts(res), note) == ((4, None, True), None)  # validate derives the engines from --colocate


def test_one_count_given_on_a_gpu_machine_takes_the_gpus_left():
    res, note = resolved(8, actor_num_gpus_per_node=6)
    assert counts(res) == (6, 2, False)
    assert note == (
        "8 GPUs found: 6 trainer ranks and 2 engines, each on its own GPU (set --rollout-num-gpus to change)"
    )
    assert plan_placement(res, cluster_gpus=8).engine_slots == [6, 7]
    res, note = resolved(8, rollout_num_gpus=2)
    assert counts(res) == (6, 2, False)
    assert note.endswith("(set --actor-num-gpus-per-node to change)")
    res, note = resolved(8, colocate=True)  # --colocate alone: every GPU; validate derives the engines
    assert counts(res) == (8, None, True)
    assert note.startswith("8 GPUs found: 8 trainer ranks and 8 engines, colocated on the same GPUs")


def test_train_async_splits_the_gpus_instead_of_colocating():
    res, note = resolved(8, can_colocate=False)
    assert counts(res) == (4, 4, False)
    assert note.startswith("8 GPUs found: 4 trainer ranks and 4 engines, each on its own GPU")
    res, _ = resolved(3, can_colocate=False)
    assert counts(res) == (1, 2, False)
    with pytest.raises(ConfigError, match=r"this machine \(1 GPU\) cannot hold separate trainer and engine"):
        resolved(1, can_colocate=False)


def test_impossible_defaults_name_the_flag_the_user_gave():
    with pytest.raises(ConfigError) as info:
        resolved(8, actor_num_gpus_per_node=8)
    assert str(info.value) == (
        "--actor-num-nodes 1 x --actor-num-gpus-per-node 8 takes every GPU of this machine (8 GPUs), none is "
        "left for the engines: pass --colocate to share them, or --rollout-num-gpus"
    )
    with pytest.raises(ConfigError, match=r"^--rollout-num-gpus 4 leaves no GPU for the trainer on the Ray "):
        resolved(4, rollout_num_gpus=4, ray_address="10.0.0.1:6379")


def test_an_unresolved_job_never_reports_a_count_nobody_passed():
    with pytest.raises(PlacementError) as info:
        plan_placement(ResourcesConfig(actor_num_gpus_per_node=1), cluster_gpus=0)
    assert str(info.value) == "--rollout-num-gpus is unset: pass it (engines' GPUs), or --colocate"


def test_throughput_label_names_the_device_kind():
    metrics = {"perf/tokens_per_gpu_per_sec": 1234.5}
    assert format_progress(0, 2, metrics) == "[rollout 1/2] 1.2k tok/s/gpu"
    assert format_progress(0, 2, metrics, on_gpu=False) == "[rollout 1/2] 1.2k tok/s/engine"


def test_unset_response_length_is_warned_once_with_the_bound_that_applies(tmp_path, caplog):
    from clawrl.cli.train import _warn_unbounded_response
    from clawrl.config import parse_job_args

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    base = ["--rollout-batch-size", "8", "--num-rollout", "1", "--hf-checkpoint", str(tmp_path)]
    with caplog.at_level("WARNING", logger="clawrl"):
        _warn_unbounded_response(parse_job_args(base))
        _warn_unbounded_response(parse_job_args([*base, "--rollout-max-response-len", "256"]))
        _warn_unbounded_response(parse_job_args([*base, "--rollout-max-prompt-len", "100"]))
    assert [r.getMessage() for r in caplog.records] == [
        "--rollout-max-response-len is unset: each response runs until EOS or a stop, at worst to the context "
        f"length ({bound}); set it to bound generation (slime recipes use e.g. 1024-8192)"
        for bound in (
            "2048 tokens, the model's max_position_embeddings",
            "--rollout-max-prompt-len 100 + 1024 tokens",
        )
    ]


def test_the_end_of_a_run_says_where_its_outputs_are():
    from clawrl.cli.train import outputs_summary
    from clawrl.config import parse_job_args

    base = ["--rollout-batch-size", "8", "--num-rollout", "1", "--output-dir", "out/r1"]
    assert outputs_summary(parse_job_args(base)) == (
        "clawrl: run finished; outputs:\n"
        "  metrics      out/r1/metrics.jsonl (config.json beside it)\n"
        "  report       clawrl report out/r1   -> out/r1/report/index.html\n"
        "  checkpoints  none (--save DIR to keep them)\n"
        "  HF export    none (--save-hf DIR to write one)"
    )
    saved = outputs_summary(parse_job_args([*base, "--save", "ck", "--save-hf", "hf/{rollout_id}"]))
    assert saved.splitlines()[3:] == [
        "  checkpoints  ck (--save; resume with --load ck)",
        "  HF export    hf/0 (the final weights; --save-hf hf/{rollout_id})",
    ]
