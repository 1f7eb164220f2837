"""`clawrl train-async --update-weights-interval 2` end to end on CPU (Ray, one engine, one trainer rank):
the engines get new weights after every second rollout, and the staleness the manager logs follows.

Four rollouts, no eval. Rollout k is trained by the weights after k updates. The engines serve version 0
for rollouts 0-2 and version 2 for rollout 3: the first sync comes after rollout 1 trained, once the
in-flight rollout 2 had finished on version 0. So staleness is 0, 1, 2, 1 and weights are pushed after
rollouts 1 and 3 only. With interval 1 it would be versions 0, 0, 1, 2 and staleness 0, 1, 1, 1.

    .venv/bin/pytest tests/integration/test_partial_rollout_async.py -x -q -p no:cacheprovider
"""

import json
import subprocess
import sys

import pytest
from loop_assets import REWARD, build_loop_assets

pytestmark = pytest.mark.slow


def test_update_weights_interval_pushes_every_second_rollout(tmp_path):
    assets = build_loop_assets(tmp_path / "assets", num_train=32, num_eval=4)
    out = tmp_path / "run"
    flags = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--global-batch-size", "4", "--lr", "1e-3", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--check-weight-update-equal", "--num-rollout", "4",
        "--update-weights-interval", "2", "--output-dir", str(out), "--run-name", "interval",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train-async", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 0.0, 0.0, 2.0]
    assert [r["rollout/weight_staleness/max"] for r in rows] == [0.0, 1.0, 2.0, 1.0]
    assert [r["rollout/weight_staleness/mean"] for r in rows] == [0.0, 1.0, 2.0, 1.0]
    assert ["perf/update_weights_time" in r for r in rows] == [False, True, False, True]
    # --check-weight-update-equal compared engine and trainer checksums after each of the two syncs
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5
