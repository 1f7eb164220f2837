"""GSM8K GRPO with `clawrl train-async`: trainer on GPU 0, engine on GPU 1, broadcast weight sync (NCCL).

    clawrl gpu-lock-exec --count 2 -- python tests/e2e/test_gsm8k_async_short.py

Rollout k+1 is generated while rollout k trains, so from the second rollout on each batch comes from weights
one update older than the trainer's (checked through the samples' recorded weight versions). With
--use-fault-tolerance, --ci-test kills the engine once at rollout 2: the run must replace it and finish.
"""

import pytest
from e2e_common import (
    FAULT_TOLERANCE_FLAGS,
    engine_restarts,
    gsm8k_flags,
    output_dir,
    prepare_gsm8k,
    run_clawrl,
    wandb_flags,
)

NUM_GPUS = 2
CI_LABELS = ["run-ci-short"]


@pytest.mark.gpu
def test_gsm8k_async_short():
    model, data = prepare_gsm8k()
    flags = gsm8k_flags(model, data) + [
        "--num-rollout", "3", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
    ]  # fmt: skip
    rows = run_clawrl(
        "train-async", flags + FAULT_TOLERANCE_FLAGS + wandb_flags(__file__), output_dir(__file__)
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert engine_restarts(rows) == 1  # --ci-test killed engine 0 at rollout 2; it was replaced
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 0.0, 1.0]


if __name__ == "__main__":
    test_gsm8k_async_short()
