"""The accepted flag list is frozen: adding, renaming or removing a flag must change this file too.

Flag names are a product interface (slime-compatible, ARCHITECTURE.md decision 5), so a change to them should be
a reviewed decision rather than a side effect of editing a dataclass.
"""

import argparse

from clawrl.cli.main import build_parser
from clawrl.config import build_job_parser

FROZEN_FLAGS = [
    "--actor-num-gpus-per-node",
    "--actor-num-nodes",
    "--adam-beta1",
    "--adam-beta2",
    "--advantage-estimator",
    "--apply-chat-template",
    "--calculate-per-token-loss",
    "--check-weight-update-equal",
    "--ci-disable-kl-checker",
    "--ci-metric-checker-key",
    "--ci-metric-checker-threshold",
    "--ci-test",
    "--ci-train-rollout-logprob-abs-diff-threshold",
    "--clip-grad",
    "--colocate",
    "--custom-generate-function-path",
    "--custom-loss-function-path",
    "--custom-rm-path",
    "--disable-grpo-std-normalization",
    "--disable-rewards-normalization",
    "--dynamic-sampling-filter-path",
    "--entropy-coef",
    "--eps-clip",
    "--eps-clip-c",
    "--eps-clip-high",
    "--eval-interval",
    "--eval-max-response-len",
    "--eval-prompt-data",
    "--eval-temperature",
    "--eval-top-k",
    "--eval-top-p",
    "--gamma",
    "--global-batch-size",
    "--gradient-checkpointing",
    "--help",
    "--hf-checkpoint",
    "--input-key",
    "--kl-coef",
    "--kl-loss-coef",
    "--kl-loss-type",
    "--label-key",
    "--lambd",
    "--load",
    "--loss-type",
    "--lr",
    "--lr-decay-style",
    "--lr-warmup-iters",
    "--max-tokens-per-gpu",
    "--metadata-key",
    "--micro-batch-size",
    "--min-lr",
    "--model-impl",
    "--n-samples-per-eval-prompt",
    "--n-samples-per-prompt",
    "--no-offload-rollout",
    "--no-offload-train",
    "--normalize-advantages",
    "--num-epoch",
    "--num-rollout",
    "--num-steps-per-rollout",
    "--offload",
    "--offload-rollout",
    "--offload-train",
    "--output-dir",
    "--over-sampling-batch-size",
    "--prompt-data",
    "--ray-address",
    "--ref-load",
    "--reward-key",
    "--rm-type",
    "--rm-url",
    "--rollout-batch-size",
    "--rollout-function-path",
    "--rollout-max-prompt-len",
    "--rollout-max-response-len",
    "--rollout-num-gpus",
    "--rollout-num-gpus-per-engine",
    "--rollout-seed",
    "--rollout-shuffle",
    "--rollout-stop",
    "--rollout-stop-token-ids",
    "--rollout-temperature",
    "--rollout-top-k",
    "--rollout-top-p",
    "--run-name",
    "--save",
    "--save-interval",
    "--seed",
    "--tis-clip",
    "--tis-clip-low",
    "--tool-key",
    "--update-weight-buffer-size",
    "--use-dynamic-batch-size",
    "--use-kl-loss",
    "--use-tensorboard",
    "--use-tis",
    "--use-wandb",
    "--wandb-group",
    "--wandb-key",
    "--wandb-mode",
    "--wandb-project",
    "--weight-decay",
    "-h",
]


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(option for action in parser._actions for option in action.option_strings)


def test_frozen_list_is_sorted_and_unique():
    assert sorted(set(FROZEN_FLAGS)) == FROZEN_FLAGS


def test_job_parser_accepts_exactly_the_frozen_flags():
    assert _option_strings(build_job_parser()) == FROZEN_FLAGS


def test_train_and_train_async_accept_exactly_the_frozen_flags():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("train", "train-async"):
        assert _option_strings(subparsers.choices[command]) == FROZEN_FLAGS, command
