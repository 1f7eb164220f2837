"""Train/rollout numerics on one GPU: bf16 engine vs bf16 FSDP2 trainer on Qwen2.5-0.5B-Instruct.

    clawrl gpu-lock-exec --count 1 -- python tests/e2e/test_logprob_precision.py

Two rollouts with a tight --ci-train-rollout-logprob-abs-diff-threshold (0.02; the random-weight smoke
run on the H200 measured 0.0089) plus the step-1 KL checks, as slime's precision job does.
"""

import pytest
from e2e_common import gsm8k_flags, output_dir, prepare_gsm8k, run_clawrl, wandb_flags

NUM_GPUS = 1
CI_LABELS = ["run-ci-precision"]


@pytest.mark.gpu
def test_logprob_precision():
    model, data = prepare_gsm8k()
    flags = gsm8k_flags(model, data) + [
        "--num-rollout", "2", "--colocate", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--ci-train-rollout-logprob-abs-diff-threshold", "0.02",
    ]  # fmt: skip
    rows = run_clawrl("train", flags + wandb_flags(__file__), output_dir(__file__))
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 0.02


if __name__ == "__main__":
    test_logprob_precision()
