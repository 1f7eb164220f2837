"""GSM8K GRPO, 3 rollouts, trainer and engine colocated on one GPU (slime's run-ci-short test).

    clawrl gpu-lock-exec --count 1 -- python tests/e2e/test_gsm8k_colocated_short.py

Asserted in-run (a violation exits non-zero): --ci-test (step-1 log_probs == ref_log_probs, ppo_kl == 0,
kl_loss == 0, engine/trainer log-prob gap <= 0.1, no NaN) and --check-weight-update-equal (engine weights ==
trainer weights after every sync); over-sampling with the zero-std dynamic filter is exercised; with
--use-fault-tolerance, --ci-test kills the engine once at rollout 2 and the run must replace it and finish.
Asserted here: three steps logged, one engine restart, the engine's weight version followed the rollouts.
"""

import pytest
from e2e_common import (
    FAULT_TOLERANCE_FLAGS,
    engine_restarts,
    eval_flags,
    gsm8k_flags,
    output_dir,
    prepare_gsm8k,
    run_clawrl,
    wandb_flags,
)

NUM_GPUS = 1
CI_LABELS = ["run-ci-short"]


@pytest.mark.gpu
def test_gsm8k_colocated_short():
    model, data = prepare_gsm8k()
    flags = gsm8k_flags(model, data) + eval_flags(data, interval=20) + [
        "--num-rollout", "3", "--colocate", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--save-interval", "3", "--save", str(output_dir(__file__) / "ckpt"),
    ]  # fmt: skip
    rows = run_clawrl("train", flags + FAULT_TOLERANCE_FLAGS + wandb_flags(__file__), output_dir(__file__))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert engine_restarts(rows) == 1  # --ci-test killed engine 0 at rollout 2; it was replaced
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0, 2.0]


if __name__ == "__main__":
    test_gsm8k_colocated_short()
