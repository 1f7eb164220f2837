"""bench/rollout_http_overhead.py end to end on a small batch: the real engine host side, its HTTP server and a
client subprocess doing the rollout's side. Checks what the script reports (every token came back, the answer
path's stamps in order, the GC pauses, the medians in --json-out), not how fast it was."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("connections", ["warm", "cold"])
def test_script_reports_the_answer_path_and_gc_of_every_http_run(tmp_path, connections):
    out = tmp_path / "runs.json"
    command = [sys.executable, "bench/rollout_http_overhead.py", "--batch", "16", "--prompt-len", "16",
               "--new-tokens", "12", "--group-size", "4", "--device-ms", "1", "--repeats", "2",
               "--connections", connections, "--json-out", str(out)]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "requests in the engine's handler" in done.stdout and "garbage collector: server" in done.stdout
    report = json.loads(out.read_text())
    http = [r for r in report["runs"] if r["kind"] == "HTTP"]
    assert len(http) == 2 and len(report["runs"]) == 4
    for run in http:
        assert run["tokens"] == 16 * 12  # (the script itself fails when a token is missing)
        stamps = [
            run[f"{k}_ms"] for k in ("first_received", "last_received", "last_finished", "last_answered")
        ]
        assert 0 < stamps[0] <= stamps[1] <= stamps[2] <= stamps[3] <= run["last_back_ms"] + 1.0
        assert run["back_after_finish_ms"] == pytest.approx(run["last_back_ms"] - run["last_finished_ms"])
        assert run["gc_ms"] >= 0 and run["server_gc_ms"] >= 0 and len(run["gc_collections"]) == 3
    medians = report["http_medians"]
    assert medians["tok_per_s"] == pytest.approx(statistics.median(r["tok_per_s"] for r in http))
