"""GSM8K GRPO for 100 rollouts (3000 with CLAWRL_TEST_ENABLE_INFINITE_RUN=true): eval/gsm8k must reach 0.45.

    clawrl gpu-lock-exec --count 1 -- python tests/e2e/test_gsm8k_long.py

The accuracy bar is checked in-run by --ci-metric-checker-key/-threshold (the run fails at its end if no
evaluation reached it). The threshold is a first estimate for Qwen2.5-0.5B-Instruct on one GPU and has not
been validated on this stack yet (see the CI issue notes).
"""

import pytest
from e2e_common import env_flag, gsm8k_flags, output_dir, prepare_gsm8k, run_clawrl, wandb_flags

NUM_GPUS = 1
CI_LABELS = ["run-ci-long"]


@pytest.mark.gpu
def test_gsm8k_long():
    model, data = prepare_gsm8k()
    num_rollout = 3000 if env_flag("CLAWRL_TEST_ENABLE_INFINITE_RUN") else 100
    flags = gsm8k_flags(model, data) + [
        "--num-rollout", str(num_rollout), "--colocate", "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--eval-interval", "20", "--eval-prompt-data", "gsm8k", str(data / "test.parquet"),
        "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "1024", "--eval-top-k", "1",
        "--ci-metric-checker-key", "eval/gsm8k", "--ci-metric-checker-threshold", "0.45",
    ]  # fmt: skip
    run_clawrl("train", flags + wandb_flags(__file__), output_dir(__file__), timeout_s=48 * 3600)


if __name__ == "__main__":
    test_gsm8k_long()
