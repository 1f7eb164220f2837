"""`--train-kernels` reaches the trainer's model: triton routes RMSNorm / SiLU-and-mul / RoPE of CUDA tensors
through the fused kernels, torch keeps every module on the eager ops. (It replaced an environment variable
that only the trainer's process read.) On CPU the switch is visible as each module's kernel device set.

    .venv/bin/pytest tests/integration/test_train_kernels_flag.py -x -q -p no:cacheprovider    # ~10 s
"""

from __future__ import annotations

import pytest

from clawrl.config import parse_job_args
from clawrl.models.layers import TrainKernelSwitch
from clawrl.models.tiny import build_tiny_model
from clawrl.trainer.actor import TrainActor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    return str(build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2))


def _kernel_devices(model_dir: str, *flags: str) -> set[frozenset[str]]:
    job = parse_job_args(
        ["--hf-checkpoint", model_dir, "--rollout-batch-size", "2", "--num-rollout", "1", *flags]
    )
    actor = TrainActor(job, device="cpu")
    try:
        actor.init(total_optimizer_steps=1)
        return {m.kernel_devices for m in actor.model.modules() if isinstance(m, TrainKernelSwitch)}
    finally:
        actor.shutdown()  # leave the process group for the next one


def test_triton_by_default_and_eager_with_torch(model_dir):
    assert _kernel_devices(model_dir) == {frozenset({"cuda"})}
    assert _kernel_devices(model_dir, "--train-kernels", "torch") == {frozenset()}
