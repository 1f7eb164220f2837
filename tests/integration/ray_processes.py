"""Helpers for tests that start their own Ray nodes with `ray start --block` (each in its own session, so the
node and everything it started form one process group)."""

import contextlib
import os
import signal
import subprocess


def stop_group(process: subprocess.Popen) -> None:
    """End one `ray start --block` and everything it started: SIGTERM to its group, SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    with contextlib.suppress(ProcessLookupError):  # children may outlive `ray start` for a moment
        os.killpg(process.pid, signal.SIGKILL)
