"""`clawrl train` end to end (CPU: Ray, one engine over HTTP, one FSDP2 trainer process) on a tiny Qwen3-MoE
(native model in trainer and engine, load-balancing loss logged) and on a tiny Mistral (no native
implementation: `--model-impl hf` in the trainer, the transformers runner in the engine).

Run: .venv/bin/pytest tests/integration/test_train_more_archs.py -x -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from loop_assets import REWARD

pytestmark = pytest.mark.slow


def _assets(root: Path, arch: str) -> dict[str, str]:
    from clawrl.demo.task import TaskSpec, write_task_files
    from clawrl.models.tiny import build_tiny_model

    model = build_tiny_model(root / "model", arch=arch, vocab_size=2048, hidden_size=64, num_layers=2)
    paths = write_task_files(root / "data", TaskSpec(), seed=0, num_train=16, num_eval=4)
    return {"model": str(model), "train": str(paths["train"])}


def _train(assets: dict[str, str], out: Path, *extra: str) -> list[dict]:
    flags = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--rollout-temperature", "0.9", "--global-batch-size", "4", "--lr", "1e-3",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--entropy-coef", "0.01",  # a gradient even when every sample earns the same reward
        "--check-weight-update-equal", "--num-rollout", "2", "--output-dir", str(out), *extra,
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_qwen3_moe_trains_two_rollouts_and_logs_the_aux_loss(tmp_path):
    rows = _train(_assets(tmp_path, "qwen3_moe"), tmp_path / "out")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        # top-2 of 4 experts: E * sum_e f_e P_e is 2 when balanced, at most 4 (every token on the same 2)
        assert 1.0 < row["train/moe_aux_loss"] < 4.0
        assert row["train/grad_norm"] > 0
        # engine and trainer run the same native MoE code in fp32: the same log-probs
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0]


def test_mistral_trains_two_rollouts_through_transformers(tmp_path):
    rows = _train(_assets(tmp_path, "mistral"), tmp_path / "out", "--model-impl", "hf")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert "train/moe_aux_loss" not in row
        assert row["train/grad_norm"] > 0
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0]
