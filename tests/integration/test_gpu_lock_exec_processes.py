"""gpu_lock_exec with real processes: concurrent jobs on 4 "GPUs" (lock files under tmp_path), overlapping
requests, timeouts, holder reports, kill -9 (no orphan survives it), signal forwarding, exit codes, --exec, and the three ways to
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

# A command with descendants: a grandchild in its process group and one in a process group of its own
# (as job-control shells and some launchers make); writes "command grandchild own-group" pids.
TREE = """
import os, subprocess, sys, time
in_group = subprocess.Popen(["sleep", "60"])
own_group = subprocess.Popen(["sleep", "60"], process_group=0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {in_group.pid} {own_group.pid}")
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


def process_group(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


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


def test_kill_9_of_the_supervisor_kills_the_command_tree_and_frees_its_gpu(tmp_path, started):
    """The brief's case: `clawrl gpu-lock-exec --count 1 -- CMD`, supervisor SIGKILLed. Within 2 s no process
    of the command is left (the command, a grandchild in its group, one that moved to a group of its own),
    and another gpu-lock-exec takes the same GPU without waiting."""
    procs, extra_pids = started
    pids_file = tmp_path / "tree.pids"
    holder = launch(tmp_path, ["--count", "1", "--", *BARE, "-c", TREE, str(pids_file)], procs, "cli")
    pids = [
        int(p) for p in wait_for(lambda: pids_file.exists() and pids_file.read_text().split(), what="tree")
    ]
    extra_pids.extend(pids)
    assert holder_of(tmp_path, 0, "command_pid") == pids[0]
    assert {process_group(pid) for pid in pids} == {pids[0], pids[2]}  # one member left the command's group
    os.kill(holder.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    holder.wait()
    wait_for(
        lambda: not any(is_alive(pid) for pid in pids), timeout=2.0, what="the command's processes to die"
    )
    assert time.monotonic() - killed_at < 2.0
    rc, out, err = finish(launch(tmp_path, ["--count", "1", "--timeout", "0", "--", "true"], procs))
    assert rc == 0, err  # --timeout 0: a single attempt, so GPU 0 was free at once
    assert "Acquired GPUs: 0" in out
    assert print_only(tmp_path)[0] == "Free GPUs: 0,1,2,3"


def test_parent_death_signal_alone_kills_the_command(tmp_path, started):
    """The first of the two guards, without the watchdog: a child started with die_with_parent_hook() gets
    SIGKILL from the kernel when its parent is kill -9'ed."""
    procs, extra_pids = started
    parent_code = (
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "import gpu_lock_exec\n"
        "child = subprocess.Popen(['sleep', '60'], preexec_fn=gpu_lock_exec.die_with_parent_hook())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([*BARE, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    procs.append(parent)
    child_pid = int(parent.stdout.readline())
    extra_pids.append(child_pid)
    assert is_alive(child_pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    wait_for(lambda: not is_alive(child_pid), timeout=2.0, what="the child to die with its parent")


def test_a_finished_command_keeps_its_background_process_and_its_gpu(tmp_path, started):
    """A normal exit is not an orphaning: the watchdog is told "done" and kills nothing, so a process the
    command leaves in the background keeps running and, sharing the lock file, keeps its GPU locked."""
    procs, extra_pids = started
    pid_file = tmp_path / "background.pid"
    # sh's `&` keeps the inherited descriptors, the lock file's among them (Python's Popen would close it).
    background = f"sleep 60 >/dev/null 2>&1 & echo $! > {pid_file}"
    rc, _, err = finish(launch(tmp_path, ["--devices", "2", "--", "sh", "-c", background], procs))
    assert rc == 0, err
    background_pid = int(pid_file.read_text())
    extra_pids.append(background_pid)
    time.sleep(0.5)  # time enough for a watchdog that wrongly fired
    assert is_alive(background_pid)
    assert print_only(tmp_path)[0] == "Free GPUs: 0,1,3"
    os.kill(background_pid, signal.SIGKILL)
    wait_for(lambda: print_only(tmp_path)[0] == "Free GPUs: 0,1,2,3", timeout=5, what="GPU 2 freed")


def test_no_gpu_machine_refuses_in_one_line_unless_total_gpus_is_given(tmp_path):
    """On this CPU machine (no nvidia-smi on PATH, no visible devices) through the real `clawrl` CLI."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")}
    env["PATH"] = str(tmp_path / "empty")
    pattern = str(tmp_path / "locks" / "gpu_{gpu_id}.lock")
    cli = [sys.executable, "-m", "clawrl.cli.main", "gpu-lock-exec", "--lock-path-pattern", pattern]
    command = ["--count", "1", "--", sys.executable, "-c", "print('ran')"]
    result = subprocess.run([*cli, *command], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "clawrl gpu-lock-exec: error: no GPU found on this machine (nvidia-smi not found; CUDA_VISIBLE_DEVICES "
        "and NVIDIA_VISIBLE_DEVICES name none): pass --total-gpus N to lock GPU ids 0..N-1 anyway"
    ]
    result = subprocess.run([*cli, "--total-gpus", "1", *command], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[gpu_lock_exec] Acquired GPUs: 0", "ran"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_is_forwarded_and_exit_code_is_128_plus_signal(tmp_path, started, signum):
    procs, _ = started
    log = tmp_path / "signals.log"
    proc = launch(tmp_path, ["--devices", "2", "--", *BARE, "-c", SIGNAL_AWARE, str(log)], procs)
    wait_for(lambda: log.exists() and "ready" in log.read_text(), what="command ready")
    proc.send_signal(signum)
    rc, _, err = finish(proc)
    assert rc == 128 + signum, err
    lines = log.read_text().splitlines()
    assert lines[1:] == [f"signal {int(signum)}"], (lines, err)  # the command saw the same signal, once
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
