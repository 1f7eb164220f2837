"""Launch one trainer worker script per rank (real processes meeting over gloo on 127.0.0.1) and read back
the result rank 0 saved: the harness of the multi-rank trainer tests."""

import subprocess
import sys
from pathlib import Path

import torch

from clawrl.trainer.distributed import free_port


def run_ranks(worker: Path, model_dir: str, out: Path, *, world_size: int = 1, extra=()) -> dict:
    """`worker --rank r --model M --world-size N --port P --out OUT [extra]` for every rank; each must exit 0
    (its output is the assertion message otherwise); returns torch.load(OUT)."""
    port = free_port()
    common = ["--model", model_dir, "--world-size", str(world_size), "--port", str(port), "--out", str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), "--rank", str(r), *common, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world_size)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output
    return torch.load(out, weights_only=True)
