"""A short real run of `clawrl train --ci-test --use-fault-tolerance` on a tiny model, on CPU: 2 engines,
3 rollouts, engine 0 killed once during rollout 2 (slime's CI injection), the run must finish with the
engine replaced and every --ci-test check passed. The hosted CPU job of .github/workflows/cpu-test.yml runs it.

    python tests/e2e/cpu_fault_tolerance.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))

from loop_assets import REWARD, build_loop_assets  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    out = Path(parser.parse_args().out or tempfile.mkdtemp(prefix="clawrl-ft-"))
    assets = build_loop_assets(out / "assets", num_train=32, num_eval=4)
    flags = [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "32",
        "--use-kl-loss", "--kl-loss-coef", "0.0", "--lr", "1e-3", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "2", "--num-rollout", "3", "--ci-test", "--ci-log-probs-margin", "100",
        "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "5",
        "--output-dir", str(out / "run"),
    ]  # fmt: skip
    code = subprocess.call([sys.executable, "-m", "clawrl.cli.main", "train", *flags])
    if code != 0:
        return code
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    restarts = sum(row.get("rollout/engine_restarts", 0) for row in rows)
    print(f"engine restarts: {restarts:g} (expected 1)")
    return 0 if restarts == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
