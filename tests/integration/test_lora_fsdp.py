"""LoRA under FSDP2 with real processes (gloo, CPU): frozen base weights and trainable adapters share each
fully_shard unit. 2 ranks train like 1 rank (same losses, same merged weights), the base stays bitwise
unchanged on both, and a 2-rank adapter checkpoint resumes in 1 rank.

    .venv/bin/pytest tests/integration/test_lora_fsdp.py -x -q -p no:cacheprovider
"""

from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

from clawrl.models.loader import iter_safetensors

pytestmark = pytest.mark.slow  # three real trainer launches (one of 2 ranks): ~45-60 s on 2 shared cores

WORKER = Path(__file__).with_name("lora_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from clawrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", vocab_size=512))


def _run(model_dir, out, *, world_size, extra=()):
    return run_ranks(WORKER, model_dir, out, world_size=world_size, extra=extra)


def _steps(result):
    return [step for rollout in result["metrics"] for step in rollout["train"]]


def test_two_ranks_train_like_one_and_resume_across_world_sizes(model_dir, tmp_path):
    one = _run(model_dir, tmp_path / "one.pt", world_size=1, extra=("--rollouts", "3"))
    two = _run(model_dir, tmp_path / "two.pt", world_size=2, extra=("--save", str(tmp_path / "ckpt")))
    assert one["base_unchanged"] and two["base_unchanged"]
    assert len(_steps(one)) == 6 and len(_steps(two)) == 4  # rollouts x 2 optimizer steps
    for s1, s2 in zip(_steps(one)[:4], _steps(two), strict=True):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-8), key
    assert len(one["adapter"]) == 12  # (q, v, down) x 2 blocks x (A, B)
    for name, tensor in one["merged"][1].items():  # after the same 2 rollouts
        assert torch.allclose(two["merged"][1][name], tensor, rtol=1e-5, atol=1e-6), name
    q = "model.layers.0.self_attn.q_proj.weight"
    initial = dict(iter_safetensors(model_dir))
    assert not torch.equal(one["merged"][0][q], initial[q])  # the merged weights moved

    # the 2-rank checkpoint (adapters + optimizer state, sharded over 2) loads into 1 rank and continues
    # as the 1-rank run did in its third rollout
    resumed = _run(model_dir, tmp_path / "resumed.pt", world_size=1,
                   extra=("--load", str(tmp_path / "ckpt"), "--rollouts", "1"))  # fmt: skip
    for s1, s2 in zip(_steps(one)[4:], _steps(resumed), strict=True):
        for key in ("train/loss", "train/lr", "train/grad_norm"):
            assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-7), key
