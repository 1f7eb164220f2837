"""gpu_lock_exec with real processes: concurrent jobs on 4 "GPUs" (lock files under tmp_path), overlapping
requests, timeouts, holder reports, kill -9, signal forwarding, exit codes, --exec, and the three ways to
launch it (standalone file under an isolated bare interpreter, `python -m clawrl.ci.gpu_lock_exec`,
`clawrl gpu-lock-exec`). Each job's command records the GPUs it got and when it held them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest

from clawrl.ci import gpu_lock_exec as gle

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "clawrl" / "ci" / "gpu_lock_exec.py"
# Interpreter flags for every process here: isolated (-I) and without site-packages (-S), so the standalone
# file is shown to need nothing but the standard library, and each process starts quickly.
BARE = [sys.executable, "-I", "-S"]

# The job command: record the devices, hold them for HOLD_S, record again.
JOB = """
import json, os, sys, time
out, hold_s = sys.argv[1], float(sys.argv[2])
start = time.monotonic()
time.sleep(hold_s)
record = {"gpus": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": time.monotonic(), "pid": os.getpid()}
with open(out, "w") as f:
    json.dump(record, f)
"""

# A command that reports signals: writes its pid when ready, then the number of each signal it gets,
# and dies of the first one (default action), as an unprepared program would.
SIGNAL_AWARE = """
import os, signal, sys, time
log = sys.argv[1]
def on_signal(signum, frame):
    with open(log, "a") as f:
        f.write(f"signal {signum}\\n")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, on_signal)
with open(log, "a") as f:
    f.write(f"ready {os.getpid()}\\n")
time.sleep(60)
"""


@pytest.fixture
def started(request):
    """Processes started by a test; any still alive at its end are killed (by pid)."""
    procs: list[subprocess.Popen] = []
    extra_pids: list[int] = []
    yield procs, extra_pids
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in extra_pids:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def lock_args(tmp_path: Path) -> list[str]:
    pattern = str(tmp_path / "locks" / "gpu_{gpu_id}.lock")
    return ["--total-gpus", "4", "--lock-path-pattern", pattern, "--max-backoff", "0.05"]


def launch(tmp_path, args: list[str], procs=None, launcher: str = "standalone") -> subprocess.Popen:
    prefix = {
        "standalone": [*BARE, str(SCRIPT)],
        "module": [sys.executable, "-m", "clawrl.ci.gpu_lock_exec"],
        "cli": [sys.executable, "-m", "clawrl.cli.main", "gpu-lock-exec"],
    }[launcher]
    proc = subprocess.Popen(
        [*prefix, *lock_args(tmp_path), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if procs is not None:
        procs.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def job(out: Path, hold_s: float) -> list[str]:
    return ["--", *BARE, "-c", JOB, str(out), str(hold_s)]


def sleeper(pid_file: Path) -> list[str]:
    code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    return ["--", *BARE, "-c", code, str(pid_file)]


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def holder_of(tmp_path: Path, gpu_id: int, key: str = "pid") -> int | None:
    record = gle.read_holder(str(tmp_path / "locks" / f"gpu_{gpu_id}.lock"))
    return record.get(key) if record else None


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # an unreaped zombie has exited


def print_only(tmp_path: Path) -> list[str]:
    result = subprocess.run(
        [*BARE, str(SCRIPT), *lock_args(tmp_path), "--print-only"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def assert_no_gpu_shared_in_time(records: list[dict]) -> None:
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        for gpu in record["gpus"].split(","):
            by_gpu.setdefault(gpu, []).append((record["start"], record["end"]))
    for gpu, intervals in by_gpu.items():
        intervals.sort()
        for (_, end), (next_start, _) in pairwise(intervals):
            assert end <= next_start, f"GPU {gpu} held by two jobs at once: {intervals}"


def test_concurrent_jobs_never_share_a_gpu_and_all_finish(tmp_path, started):
    procs, _ = started
    outs = [tmp_path / f"job{i}.json" for i in range(8)]
    jobs = [launch(tmp_path, ["--count", "2", "--timeout", "60", *job(out, 0.4)], procs) for out in outs]
    results = [finish(proc, timeout=60) for proc in jobs]
    assert [rc for rc, _, _ in results] == [0] * 8, [err for _, _, err in results]
    records = [json.loads(out.read_text()) for out in outs]
    for (_, stdout, _), record in zip(results, records, strict=True):
        gpus = record["gpus"].split(",")
        assert len(set(gpus)) == 2 and set(gpus) <= {"0", "1", "2", "3"}
        assert f"[gpu_lock_exec] Acquired GPUs: {record['gpus']}" in stdout
    assert_no_gpu_shared_in_time(records)
    # Two disjoint pairs exist, so jobs must have run two at a time, not one after another.
    spans = sorted((r["start"], r["end"]) for r in records)
    assert any(b_start < a_end for (_, a_end), (b_start, _) in pairwise(spans))


def test_overlapping_device_requests_do_not_deadlock(tmp_path, started):
    procs, _ = started
    requests = ["0,1", "1,2", "2,3", "3,0"]
    outs = [tmp_path / f"ring{i}.json" for i in range(len(requests))]
    jobs = [
        launch(tmp_path, ["--devices", devices, "--timeout", "30", *job(out, 0.3)], procs)
        for devices, out in zip(requests, outs, strict=True)
    ]
    assert [finish(proc)[0] for proc in jobs] == [0, 0, 0, 0]
    records = [json.loads(out.read_text()) for out in outs]
    assert [r["gpus"] for r in records] == requests  # the variable keeps the order the user asked for
    assert_no_gpu_shared_in_time(records)


def test_timeout_exits_124_naming_busy_gpu_and_holder(tmp_path, started):
    procs, extra_pids = started
    holder = launch(tmp_path, ["--devices", "1", *sleeper(tmp_path / "holder.pid")], procs)
    wait_for(lambda: holder_of(tmp_path, 1, "command_pid"), what="holder record")
    extra_pids.append(holder_of(tmp_path, 1, "command_pid"))
    start = time.monotonic()
    rc, out, err = finish(launch(tmp_path, ["--devices", "1,2", "--timeout", "0.5", "--", "true"], procs))
    assert rc == gle.EXIT_TIMEOUT == 124
    assert 0.5 <= time.monotonic() - start < 10
    assert "Acquired" not in out
    assert "timed out after 0.5 s waiting for --devices 1,2; free: 2" in err
    assert f"GPU 1: busy, held by pid {holder.pid}, command pid {extra_pids[0]}" in err
    rc, _, err = finish(launch(tmp_path, ["--count", "4", "--timeout", "0.2", "--", "true"], procs))
    assert rc == 124 and "free: 0,2,3" in err and f"held by pid {holder.pid}" in err


def test_print_only_reports_holder_pids(tmp_path, started):
    procs, extra_pids = started
    first = launch(tmp_path, ["--devices", "0,2", *sleeper(tmp_path / "a.pid")], procs)
    second = launch(tmp_path, ["--exec", "--devices", "3", *sleeper(tmp_path / "b.pid")], procs)
    wait_for(lambda: holder_of(tmp_path, 0, "command_pid") and holder_of(tmp_path, 3), what="both holders")
    extra_pids.append(holder_of(tmp_path, 0, "command_pid"))
    lines = print_only(tmp_path)
    assert lines[0] == "Free GPUs: 1"
    assert lines[1].startswith(f"GPU 0: busy, held by pid {first.pid}, command pid {extra_pids[0]} on host ")
    assert lines[2].startswith(f"GPU 2: busy, held by pid {first.pid}, command pid {extra_pids[0]} on host ")
    assert lines[3].startswith(f"GPU 3: busy, held by pid {second.pid} on host ")
    assert len(lines) == 4


def test_kill_9_of_a_holder_frees_its_gpus(tmp_path, started):
    procs, extra_pids = started
    holder = launch(tmp_path, ["--devices", "0,1", *sleeper(tmp_path / "holder.pid")], procs)
    command_pid = wait_for(lambda: holder_of(tmp_path, 1, "command_pid"), what="holder record")
    extra_pids.append(command_pid)
    waiter = launch(
        tmp_path, ["--devices", "1", "--timeout", "30", *job(tmp_path / "waiter.json", 0.0)], procs
    )
    # The supervisor shares the lock files with its command: killing the supervisor alone leaves the
    # still-running command holding the GPUs, so nobody else is put on them.
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    time.sleep(0.5)
    assert waiter.poll() is None and is_alive(command_pid)
    assert print_only(tmp_path)[0] == "Free GPUs: 2,3"
    os.kill(command_pid, signal.SIGKILL)
    rc, out, _ = finish(waiter)
    assert rc == 0 and "Acquired GPUs: 1" in out
    assert json.loads((tmp_path / "waiter.json").read_text())["gpus"] == "1"
    assert print_only(tmp_path)[0] == "Free GPUs: 0,1,2,3"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_is_forwarded_and_exit_code_is_128_plus_signal(tmp_path, started, signum):
    procs, _ = started
    log = tmp_path / "signals.log"
    proc = launch(tmp_path, ["--devices", "2", "--", *BARE, "-c", SIGNAL_AWARE, str(log)], procs)
    wait_for(lambda: log.exists() and "ready" in log.read_text(), what="command ready")
    proc.send_signal(signum)
    rc, _, _ = finish(proc)
    assert rc == 128 + signum
    assert log.read_text().splitlines()[1] == f"signal {int(signum)}"  # the command saw the same signal
    assert print_only(tmp_path)[0] == "Free GPUs: 0,1,2,3"


def test_group_is_killed_after_grace_period_when_command_ignores_signal(tmp_path, started):
    procs, extra_pids = started
    pids_file = tmp_path / "pids"
    stubborn = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '60'])\n"  # a member of the same process group
        "open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}')\n"
        "time.sleep(60)\n"
    )
    proc = launch(
        tmp_path,
        ["--count", "1", "--grace-period", "0.5", "--", *BARE, "-c", stubborn, str(pids_file)],
        procs,
    )
    pids = [
        int(p) for p in wait_for(lambda: pids_file.exists() and pids_file.read_text().split(), what="pids")
    ]
    extra_pids.extend(pids)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 128 + signal.SIGTERM
    assert 0.5 <= time.monotonic() - start < 10
    assert "grace period over" in err
    wait_for(lambda: not any(is_alive(pid) for pid in pids), timeout=5, what="group killed")


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("raise SystemExit(7)", 7),
        ("pass", 0),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9),
    ],
)
def test_command_exit_code_is_passed_through(tmp_path, started, command, expected):
    procs, _ = started
    assert finish(launch(tmp_path, ["--count", "1", "--", *BARE, "-c", command], procs))[0] == expected


def test_missing_command_exits_127(tmp_path, started):
    procs, _ = started
    rc, _, err = finish(launch(tmp_path, ["--count", "1", "--", "no-such-command-xyz"], procs))
    assert rc == 127 and "command not found: no-such-command-xyz" in err


def test_exec_mode_keeps_locks_held_by_the_execd_process(tmp_path, started):
    procs, _ = started
    pid_file = tmp_path / "exec.pid"
    proc = launch(tmp_path, ["--exec", "--devices", "2", *sleeper(pid_file)], procs)
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="exec'd command")
    assert int(pid_file.read_text()) == proc.pid  # the same process, now running the command
    assert holder_of(tmp_path, 2) == proc.pid and holder_of(tmp_path, 2, "mode") == "exec"
    lines = print_only(tmp_path)
    assert lines[0] == "Free GPUs: 0,1,3" and f"held by pid {proc.pid} on host" in lines[1]
    rc, _, _ = finish(launch(tmp_path, ["--devices", "2", "--timeout", "0.2", "--", "true"], procs))
    assert rc == 124
    proc.kill()
    proc.wait()
    assert print_only(tmp_path)[0] == "Free GPUs: 0,1,2,3"


@pytest.mark.parametrize("launcher", ["standalone", "module", "cli"])
def test_launchers_set_target_env_and_pass_command_flags_untouched(tmp_path, started, launcher):
    procs, _ = started
    show = "import os, sys; print(os.environ['MY_GPUS'], sys.argv[1:])"
    args = ["--devices", "3,1", "--target-env-name", "MY_GPUS", "--", *BARE, "-c", show, "--count", "--", "x"]
    rc, out, err = finish(launch(tmp_path, args, procs, launcher=launcher))
    assert rc == 0, err
    assert out.splitlines() == ["[gpu_lock_exec] Acquired GPUs: 3,1", "3,1 ['--count', '--', 'x']"]


def test_standalone_interpreter_cannot_import_clawrl():
    """The launch mode above really runs without clawrl: -I -S leaves only the standard library."""
    result = subprocess.run([*BARE, "-c", "import clawrl"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "No module named 'clawrl'" in result.stderr
