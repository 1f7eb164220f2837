"""FSDP2 trainer, real processes (gloo): 2 ranks == 1 rank, resume is bit-exact, HF export loads in transformers."""

from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

WORKER = Path(__file__).with_name("trainer_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from clawrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", vocab_size=512))


def _run(model_dir, out, *, world_size=1, extra=()):
    return run_ranks(WORKER, model_dir, out, world_size=world_size, extra=extra)


def _train_metrics(result):
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in result["metrics"]]


def test_two_ranks_match_one_rank(model_dir, tmp_path):
    # 3 rollouts x 1 optimizer step, packed by a 30-token budget (several micro-batches per rank)
    args = ("--max-tokens", "30", "--global-batch-size", "6", "--lr", "1e-4")
    one = _run(model_dir, tmp_path / "one.pt", world_size=1, extra=args)
    two = _run(model_dir, tmp_path / "two.pt", world_size=2, extra=args)
    for m1, m2 in zip(_train_metrics(one), _train_metrics(two), strict=True):
        for s1, s2 in zip(m1["train"], m2["train"], strict=True):
            for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm", "train/lr"):
                assert s2[key] == pytest.approx(s1[key], rel=1e-6, abs=1e-9), key
            # kl_loss is ~1e-6 here: a difference of nearly equal log-probs, compared absolutely
            assert s2["train/kl_loss"] == pytest.approx(s1["train/kl_loss"], abs=1e-9)
    _assert_weights_close(one["weights"], two["weights"])
    # the weights did move
    first = one["weights"]["model.layers.0.mlp.up_proj.weight"]
    assert first.ne(_initial(model_dir)["model.layers.0.mlp.up_proj.weight"]).any()


def _assert_weights_close(ws1, ws2):
    assert ws1.keys() == ws2.keys()
    flat1 = torch.cat([w.flatten() for w in ws1.values()])
    flat2 = torch.cat([ws2[n].flatten() for n in ws1])
    assert ((flat1 - flat2).norm() / flat1.norm()).item() <= 1e-6
    for name, w1 in ws1.items():
        # Every matrix agrees to 1e-6. Zero-initialised biases are left out of the per-tensor check: Adam
        # moves each entry by ~lr per step whatever the gradient's size, so for k_proj.bias (whose gradient
        # nearly cancels under RoPE) last-bit gradient differences flip whole updates of a ~1e-4-norm tensor.
        if w1.dim() == 2:
            rel = ((w1 - ws2[name]).norm() / w1.norm()).item()
            assert rel <= 1e-6, (name, rel)


def _initial(model_dir):
    from clawrl.models.loader import iter_safetensors

    return dict(iter_safetensors(model_dir))


def test_first_step_is_exactly_on_policy(model_dir, tmp_path):
    result = _run(model_dir, tmp_path / "r.pt", extra=("--steps", "1"))
    metrics = result["metrics"][0]
    assert metrics["rollout/log_probs"] == metrics["rollout/ref_log_probs"]
    step = metrics["train"][0]
    assert step["train/ppo_kl"] == 0.0
    assert step["train/kl_loss"] == 0.0
    assert step["train/pg_clipfrac"] == 0.0
    assert step["train/train_rollout_logprob_abs_diff"] > 0  # the fake rollout log-probs differ on purpose


def test_resume_is_bit_identical(model_dir, tmp_path):
    straight = _run(model_dir, tmp_path / "a.pt", extra=("--steps", "4"))
    save = tmp_path / "ckpt"
    _run(model_dir, tmp_path / "b.pt", extra=("--steps", "2", "--save", str(save)))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = _run(
        model_dir, tmp_path / "c.pt", extra=("--steps", "2", "--load", str(save), "--first-rollout", "2")
    )
    assert _train_metrics(resumed) == _train_metrics(straight)[2:]
    for name, w in straight["weights"].items():
        assert torch.equal(w, resumed["weights"][name]), name


def test_resume_at_another_world_size(model_dir, tmp_path):
    args = ("--global-batch-size", "6", "--lr", "1e-4")
    save = tmp_path / "ckpt"
    _run(model_dir, tmp_path / "b.pt", world_size=2, extra=("--steps", "1", "--save", str(save), *args))
    resumed = _run(
        model_dir,
        tmp_path / "c.pt",
        extra=("--steps", "1", "--load", str(save), "--first-rollout", "1", *args),
    )
    straight = _run(model_dir, tmp_path / "a.pt", extra=("--steps", "2", *args))
    _assert_weights_close(straight["weights"], resumed["weights"])
