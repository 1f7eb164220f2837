"""The README's `clawrl train` example, run exactly as README.md writes it, on a machine without GPU.

The command is read out of README.md (so editing the README changes what runs); only the paths the README
names as placeholders (MODEL_DIR, TRAIN_JSONL) are replaced, by a tiny random model and the demo task's
jsonl. No resource flag is given, so this also checks the CPU defaults: one trainer process, one engine,
and the one line that says so.

    .venv/bin/pytest tests/integration/test_readme_train.py -q
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from loop_assets import build_loop_assets

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
PLACEHOLDERS = ("MODEL_DIR", "TRAIN_JSONL")
CPU_NOTE = (
    "clawrl: no GPU found: 1 trainer process and 1 engine on CPU "
    "(set --actor-num-gpus-per-node / --rollout-num-gpus to change)"
)


def readme_train_command() -> list[str]:
    """The README's `clawrl train --hf-checkpoint ...` line with its continuation lines, comments dropped."""
    text = README.read_text()
    for name in PLACEHOLDERS:  # the README must say these are placeholders, or substituting them is cheating
        assert f"`{name}`" in text, f"README.md no longer names {name} as a placeholder"
    assert "are placeholders" in text
    match = re.search(r"^clawrl train --hf-checkpoint .*?(?<!\\)$", text, flags=re.MULTILINE | re.DOTALL)
    assert match, "README.md has no `clawrl train --hf-checkpoint` example"
    lines = [line.split("  #")[0].rstrip().removesuffix("\\") for line in match.group(0).splitlines()]
    return shlex.split(" ".join(lines))


def test_readme_command_is_read_from_the_readme():
    argv = readme_train_command()
    assert argv[:2] == ["clawrl", "train"]
    assert set(PLACEHOLDERS) <= set(argv)
    assert not any(a.startswith(("--actor-num", "--rollout-num-gpus", "--colocate")) for a in argv)


def test_readme_train_example_runs_as_written_on_cpu(tmp_path):
    assets = build_loop_assets(tmp_path / "assets", num_train=64, num_eval=8)
    values = {"MODEL_DIR": assets["model"], "TRAIN_JSONL": assets["train"]}
    argv = [values.get(arg, arg) for arg in readme_train_command()]
    num_rollout = int(argv[argv.index("--num-rollout") + 1])
    assert num_rollout <= 2, "the README example must stay a short first run (this test runs it on CPU)"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a machine without GPU, whatever this one has
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", *argv[1:]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count(CPU_NOTE) == 1, result.stderr[-4000:]
    assert "--rollout-max-response-len is unset" not in result.stderr  # the example bounds generation
    progress = [line for line in result.stdout.splitlines() if line.startswith("[rollout ")]
    assert [line.split("]")[0] for line in progress] == [f"[rollout {k}/{num_rollout}" for k in (1, 2)]
    assert all(line.endswith("tok/s/engine") for line in progress), progress
    metrics = next(tmp_path.glob("outputs/*/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row["step"] for row in rows if "rollout/raw_reward" in row]
    assert steps == list(range(num_rollout))
    # start-up phases, each printed with its seconds and when it was ready (the trainer loads while the engines
    # do), then the block saying where things are
    phases = re.findall(r"^clawrl: (.*) \(\d+\.\d s, at \d+\.\d s\)$", result.stderr, flags=re.MULTILINE)
    assert phases == [
        "Ray ready",
        "1 engine(s) ready",
        "rollout manager ready",
        "trainer ready: 1 rank(s), model and optimizer built",
        "weights synced to the engines",
    ], result.stderr[-4000:]
    assert re.search(r"^clawrl: start-up done in \d+\.\d s$", result.stderr, flags=re.MULTILINE)
    out = metrics.parent.relative_to(tmp_path)
    tail = result.stdout.split("clawrl: run finished; outputs:\n")[1]
    assert tail.splitlines()[:2] == [
        f"  metrics      {out}/metrics.jsonl (config.json beside it)",
        f"  report       clawrl report {out}   -> {out}/report/index.html",
    ]
