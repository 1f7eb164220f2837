"""The train/rollout mismatch flags' cross-flag rules in `validate` (slime's rules and the flags slime would
silently ignore): each broken rule is one ConfigError naming the flags, raised while parsing, before Ray.

    .venv/bin/pytest tests/unit/test_mismatch_validate.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

from clawrl.config import ConfigError, parse_job_args

BASE = ["--hf-checkpoint", "model", "--num-rollout", "1", "--rollout-batch-size", "2"]
MIS = ["--custom-tis-function-path", "clawrl.algo.tis:mis_function"]


def parse(*extra: str):
    return parse_job_args([*BASE, *extra])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--use-tis", "--use-rollout-logprobs"], "--use-tis and --use-rollout-logprobs exclude each other"),
        (["--get-mismatch-metrics"], "--get-mismatch-metrics requires --custom-tis-function-path MODULE:FN"),
        (
            MIS,
            "--custom-tis-function-path 'clawrl.algo.tis:mis_function' is only called with --use-tis or "
            "--get-mismatch-metrics",
        ),  # fmt: skip
        (["--use-tis", "--loss-type", "sft_loss"], "--use-tis applies to --loss-type policy_loss only"),
        (
            [
                "--get-mismatch-metrics",
                *MIS,
                "--loss-type",
                "custom_loss",
                "--custom-loss-function-path",
                "m.f",
            ],
            "--get-mismatch-metrics applies to --loss-type policy_loss only, got --loss-type custom_loss",
        ),  # fmt: skip
        (
            ["--use-tis", "--tis-level", "sequence"],
            "--tis-level sequence is read only by a --custom-tis-function",
        ),
        (["--use-tis", "--use-rs"], "--use-rs is read only by a --custom-tis-function-path function"),
        (
            ["--use-tis", *MIS, "--rs-veto-threshold", "0.1"],
            "--rs-veto-threshold 0.1 has no effect without --use-rs",
        ),
        (
            ["--use-tis", *MIS, "--tis-mode", "clip", "--tis-lower-bound", "2", "--tis-upper-bound", "1.5"],
            "--tis-lower-bound 2.0 must be < --tis-upper-bound 1.5 (--tis-mode clip)",
        ),  # fmt: skip
        (
            ["--use-tis", *MIS, "--tis-mode", "mask", "--tis-upper-bound", "1"],
            "--tis-lower-bound 1.0 must be < --tis-upper-bound 1.0",
        ),  # fmt: skip
        (
            ["--use-tis", *MIS, "--use-rs", "--rs-lower-bound", "3"],
            "--rs-lower-bound 3.0 must be < --rs-upper-bound 2.0",
        ),  # fmt: skip
        (
            ["--use-tis", *MIS, "--tis-batch-normalize", "--tis-level", "geometric"],
            "--tis-batch-normalize works with --tis-level token or sequence, got geometric",
        ),  # fmt: skip
        (["--rs-veto-threshold", "0"], "--rs-veto-threshold must be > 0, got 0.0"),
        (["--tis-upper-bound", "-1"], "--tis-upper-bound must be > 0, got -1.0"),
    ],
)
def test_broken_rule_is_one_error_naming_the_flags(argv, message):
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--use-tis"],
        ["--use-rollout-logprobs"],
        ["--use-rollout-logprobs", "--get-mismatch-metrics", *MIS],
        ["--use-tis", "--custom-tis-function-path", "clawrl.algo.tis.icepop_function", "--tis-clip", "1.5"],
        ["--use-tis", *MIS, "--tis-level", "sequence", "--tis-mode", "mask", "--tis-lower-bound", "0.5"],
        [
            "--get-mismatch-metrics",
            *MIS,
            "--use-rs",
            "--rs-level",
            "geometric",
            "--rs-veto-threshold",
            "1e-4",
        ],
        ["--use-tis", *MIS, "--tis-batch-normalize", "--tis-level", "sequence"],
        [
            "--use-tis",
            *MIS,
            "--tis-mode",
            "truncate",
            "--tis-upper-bound",
            "1",
        ],  # truncate has no lower bound
    ],
)
def test_valid_combinations_parse(argv):
    job = parse(*argv)
    assert job.algo.use_tis == ("--use-tis" in argv)
    assert job.algo.use_rollout_logprobs == ("--use-rollout-logprobs" in argv)


def test_mis_flags_reach_the_plugin_namespace():
    job = parse("--use-tis", *MIS, "--tis-mode", "clip", "--tis-lower-bound", "0.25", "--use-rs",
                "--rs-veto-threshold", "1e-3")  # fmt: skip
    args = job.to_namespace()
    assert (args.tis_mode, args.tis_lower_bound, args.use_rs, args.rs_veto_threshold) == (
        "clip",
        0.25,
        True,
        1e-3,
    )
    assert args.custom_tis_function_path == "clawrl.algo.tis:mis_function"
