"""`clawrl train --lora-rank 4` end to end on CPU: Ray, an engine actor over HTTP, 2 FSDP2 (gloo) trainer
ranks with frozen base weights, merged-weight sync checked by --check-weight-update-equal after every
sync, and --save-hf writing the merged model plus the PEFT adapter directory.

    .venv/bin/pytest tests/integration/test_lora_train_loop.py -x -q -p no:cacheprovider
"""

import json
import subprocess
import sys

import pytest
import torch
from loop_assets import REWARD, build_loop_assets

from clawrl.models.loader import iter_safetensors

pytestmark = pytest.mark.slow


def test_two_rollouts_with_lora(tmp_path):
    assets = build_loop_assets(tmp_path / "assets", num_train=16, num_eval=4)
    out = tmp_path / "run"
    flags = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
        "--rollout-temperature", "0.9", "--global-batch-size", "8", "--use-kl-loss", "--kl-loss-coef", "0.01",
        "--lr", "1e-2", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--check-weight-update-equal",
        "--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "q_proj,v_proj,up_proj",
        "--num-rollout", "2", "--save-hf", str(tmp_path / "hf_{rollout_id}"),
        "--output-dir", str(out), "--run-name", "lora",
    ]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "train", *flags], capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # step 0: adapters at B = 0, so the policy is the base model, which is also the reference
    assert rows[0]["rollout/log_probs"] == rows[0]["rollout/ref_log_probs"]
    assert all(r["train/grad_norm"] > 0 for r in rows)
    # the engine generated rollout 1 with the merged weights of step 0, which the trainer recomputes
    assert rows[1]["train/train_rollout_logprob_abs_diff"] <= 1e-5
    assert rows[1]["rollout/log_probs"] != rows[1]["rollout/ref_log_probs"]
    export = tmp_path / "hf_1"
    merged, base = dict(iter_safetensors(export)), dict(iter_safetensors(assets["model"]))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(merged[q], base[q]) and torch.equal(merged[k], base[k])
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"]) == (4, ["q_proj", "up_proj", "v_proj"])
