"""docs/guide.md cannot drift from the CLI: every `clawrl train` / `clawrl train-async` command in it is parsed
and validated (not run) as `clawrl train` would, and the guide's two example commands (custom reward +
generate + filter; custom rollout function) run for real on a tiny model, as the guide writes them, with
only the placeholders replaced. The first run also checks the per-rollout progress bar of a real run.

    .venv/bin/pytest tests/integration/test_guide_examples.py -q
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

from clawrl.cli.main import build_parser
from clawrl.config import job_from_namespace, validate
from clawrl.config.loop_rules import check_loop_flags
from clawrl.config.resources import resolve_resource_defaults

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
PLACEHOLDERS = ("MODEL_DIR", "TRAIN_JSONL", "EVAL_JSONL", "CKPT_DIR", "HF_DIR", "HEAD_IP")
BAR_LINE = re.compile(
    r"^rollout (\d)/2 \|[#-]{20}\| (\d+)/16 samples \d+% \| "
    r"(?:[\d.]+ samples/s [\d.]+k? tok/s \| \d+s, ETA \d+s|\d+s)$"
)


def guide_commands() -> list[str]:
    """Each `clawrl train(-async) ...` command of the guide's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    commands, current = [], None
    for line in (line for block in blocks for line in block.splitlines()):
        text = line.split("  #")[0].rstrip()
        start = re.search(r"(?:^|\s)(clawrl train(-async)? )", text)
        if current is None and start:  # also inside `docker run ... clawrl train ...`
            current, text = "", text[start.start(1) :]
        if current is not None:
            current += " " + text.removesuffix("\\")
            if not text.endswith("\\"):
                commands.append(current.strip())
                current = None
    return commands


def _argv(command: str, values: dict[str, str]) -> list[str]:
    words = shlex.split(command)
    for name, value in values.items():
        words = [word.replace(name, value) for word in words]
    return words


def _validated(argv: list[str]):
    """What `clawrl train` does with the flags before it starts anything (clawrl/cli/train.py)."""
    asynchronous = argv[1] == "train-async"
    args = build_parser(only=argv[1]).parse_args(argv[1:])
    job = job_from_namespace(args)
    if job.resources.needs_defaults:  # as on a machine with 8 GPUs
        resolve_resource_defaults(job.resources, 8, can_colocate=not asynchronous)
    job = validate(job)
    check_loop_flags(job, asynchronous=asynchronous)
    return job


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("guide"), num_train=64, num_eval=8)


def _values(assets, tmp_path) -> dict[str, str]:
    return {
        "MODEL_DIR": assets["model"], "TRAIN_JSONL": assets["train"], "EVAL_JSONL": assets["eval"],
        "CKPT_DIR": str(tmp_path / "ckpt"), "HF_DIR": str(tmp_path / "hf"), "HEAD_IP": "10.0.0.1",
    }  # fmt: skip


def test_every_guide_command_parses_and_validates(assets, tmp_path):
    commands = guide_commands()
    assert len(commands) == 10, commands  # docker, first run, datasets, 2 examples, colocated, split, ...
    for command in commands:
        job = _validated(_argv(command, _values(assets, tmp_path)))
        assert job.rollout.num_rollout or job.data.num_epoch, command
    # the parser really rejects what the CLI rejects: a misspelt flag fails here too
    with pytest.raises(SystemExit):
        _validated(
            _argv(
                commands[0].replace("--rollout-batch-size", "--rollout-batchsize"), _values(assets, tmp_path)
            )
        )


def test_guide_names_only_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", GUIDE.read_text()):
        if not target.startswith("http"):
            assert (GUIDE.parent / target).exists(), target
    for path in re.findall(r"(examples/guide/\w+\.py):\w+", GUIDE.read_text()):
        assert (ROOT / path).is_file(), path


def _run(command: str, values: dict[str, str], cwd: Path, **env) -> subprocess.CompletedProcess:
    argv = _argv(command, values)
    return subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", *argv[1:]],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **env},
    )  # fmt: skip


def _metrics(out_dir: Path) -> list[dict]:
    path = next(out_dir.glob("outputs/*/metrics.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def _only(commands: list[str], marker: str) -> str:
    found = [c for c in commands if marker in c]
    assert len(found) == 1, (marker, found)
    return found[0]


@pytest.mark.slow
def test_reward_generate_and_filter_examples_train_with_a_progress_bar(assets, tmp_path):
    command = _only(guide_commands(), "examples/guide/generate.py")
    # the examples are named relative to the repository root; the run happens in a fresh directory
    values = {**_values(assets, tmp_path), "examples/guide/": f"{ROOT}/examples/guide/"}
    result = _run(command + " --progress-interval 0", values, tmp_path)  # 0: a plain line at every poll
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [row for row in _metrics(tmp_path) if "rollout/raw_reward" in row]
    assert [row["step"] for row in rows] == [0, 1]
    # reward.py: correctness (0 or 1) + 0.1 x share of distinct tokens (> 0 for any response); a random model
    # is rarely right, but a lucky last number does happen
    assert all(0.0 < row["rollout/raw_reward"] <= 1.1 for row in rows), rows
    assert all("train/loss" in row for row in rows)
    bars = [line for line in result.stdout.splitlines() if line.startswith("rollout ")]
    assert bars and all(BAR_LINE.match(line) for line in bars), bars
    assert {BAR_LINE.match(line).group(1) for line in bars} <= {"1", "2"}
    summaries = [line for line in result.stdout.splitlines() if line.startswith("[rollout ")]
    assert [line.split("]")[0] for line in summaries] == ["[rollout 1/2", "[rollout 2/2"]


@pytest.mark.slow
def test_rollout_function_example_trains(assets, tmp_path):
    command = _only(guide_commands(), "examples/guide/rollout.py")
    values = {**_values(assets, tmp_path), "examples/guide/": f"{ROOT}/examples/guide/"}
    result = _run(command, values, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (row,) = [row for row in _metrics(tmp_path) if "rollout/raw_reward" in row]
    assert row["step"] == 0 and "train/loss" in row
    assert row["rollout/guide_response_chars"] > 0  # the rollout function's own metric
    assert 0.0 < row["rollout/raw_reward"] <= 1.1
