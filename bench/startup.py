"""Start-up time of a tiny CPU `clawrl train` run, read from the start-up lines the run prints.

Each run is a real `clawrl train` subprocess on CPU (its own Ray instance, one engine actor, the rollout manager,
--trainer-ranks FSDP2 ranks; one rollout of a tiny random qwen2 checkpoint on the demo task's prompts, built
offline once). From its stderr it reads the start-up lines (`clawrl: Ray ready (...)`, `... engine(s) ready`,
`trainer ready ...`, `weights synced ...`, `start-up done in X s`) and prints, per source tree, the median of
each over the runs, plus the whole process's wall time. Nothing is timed from outside the run except that wall
time: the phases are the run's own numbers.

--source compares clawrl trees (A/B): each is a directory holding a `clawrl` package (default: this repository),
for instance an export of an older commit (`git archive HEAD | tar -x -C /tmp/base`). Runs of the sources are
interleaved (A B A B ...), so a machine whose load changes during the bench affects both alike.

Run (from the repository root, 2 CPU cores: ~25-35 s per run):
    .venv/bin/python bench/startup.py --runs 3
    .venv/bin/python bench/startup.py --runs 3 --source /tmp/base --source . --json-out /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# "clawrl: 1 engine(s) ready (8.1 s)" or, with the time since start-up began, "(8.1 s, at 12.9 s)"
PHASE = re.compile(r"^clawrl: (?P<what>.+?) \((?P<secs>\d+\.\d) s(?:, at (?P<at>\d+\.\d) s)?\)$")
TOTAL = re.compile(r"^clawrl: start-up done in (?P<secs>\d+\.\d) s$")


def build_assets(root: Path) -> dict[str, str]:
    """A tiny random qwen2 checkpoint and the demo task's train prompts under `root` (offline)."""
    sys.path.insert(0, str(ROOT))
    from clawrl.demo.task import TaskSpec, write_task_files
    from clawrl.models.tiny import build_tiny_model

    model = build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2)
    paths = write_task_files(root / "data", TaskSpec(), seed=0, num_train=64, num_eval=8)
    return {"model": str(model), "train": str(paths["train"])}


def train_argv(assets: dict[str, str], out: Path, trainer_ranks: int) -> list[str]:
    """`clawrl train` flags of one short CPU run: one rollout of 4 prompts x 2 samples x <= 8 tokens."""
    return [
        "train", "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--rm-type", "gsm8k", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--global-batch-size", "8", "--num-rollout", "1",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(trainer_ranks), "--rollout-num-gpus", "1",
        "--output-dir", str(out), "--run-name", out.name,
    ]  # fmt: skip


def parse_startup(stderr: str) -> dict[str, float]:
    """{phase: seconds} of the start-up lines (also "<phase> @" for the time since start-up began, when the
    line gives it) and "start-up total"; raises if the run printed no total."""
    found: dict[str, float] = {}
    for line in stderr.splitlines():
        if match := TOTAL.match(line):
            found["start-up total"] = float(match["secs"])
        elif match := PHASE.match(line):
            what = re.sub(r": \d+ rank\(s\).*", "", match["what"])  # "trainer ready: 1 rank(s), ..." -> short
            found[what] = float(match["secs"])
            if match["at"] is not None:
                found[f"{what} @"] = float(match["at"])
    if "start-up total" not in found:
        raise RuntimeError("the run printed no 'start-up done in' line:\n" + stderr[-3000:])
    return found


def run_once(source: Path, assets: dict[str, str], out: Path, trainer_ranks: int) -> dict[str, float]:
    """One `clawrl train` run of the clawrl tree at `source`: its start-up numbers and process wall time."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(source)}  # CPU, this tree first
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", *train_argv(assets, out, trainer_ranks)],
        cwd=source, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wall = time.monotonic() - began
    if result.returncode != 0:
        raise RuntimeError(f"clawrl train failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return {**parse_startup(result.stderr), "process wall": wall}


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per start-up number, one column per source (median over its runs)."""
    meds = {src: medians(runs) for src, runs in results.items()}
    keys = list(next(iter(meds.values())))
    lines = ["| number (s) | " + " | ".join(meds) + " |", "|---|" + "---|" * len(meds)]
    for key in keys:
        cells = [f"{m[key]:.1f}" if key in m else "n/a" for m in meds.values()]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per source (medians are printed)")
    parser.add_argument("--source", action="append", default=None,
                        help="a directory holding a clawrl package (repeat to compare; default: this repository)")  # fmt: skip
    parser.add_argument("--trainer-ranks", type=int, default=1, help="trainer processes (FSDP2 ranks on CPU)")
    parser.add_argument("--json-out", default=None, help="every run's numbers as JSON")
    args = parser.parse_args()
    sources = [Path(s).resolve() for s in (args.source or [str(ROOT)])]
    for source in sources:
        if not (source / "clawrl" / "__init__.py").is_file():
            raise SystemExit(f"--source {source}: no clawrl package there")
    with tempfile.TemporaryDirectory(prefix="clawrl-startup-") as tmp:
        assets = build_assets(Path(tmp) / "assets")
        results: dict[str, list[dict[str, float]]] = {str(s): [] for s in sources}
        for k in range(args.runs):
            for j, source in enumerate(sources):
                numbers = run_once(source, assets, Path(tmp) / f"run{k}-source{j}", args.trainer_ranks)
                results[str(source)].append(numbers)
                print(f"[{source}] run {k + 1}: start-up {numbers['start-up total']:.1f} s, "
                      f"process {numbers['process wall']:.1f} s", flush=True)  # fmt: skip
    print(table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
