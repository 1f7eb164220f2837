"""Run a command while holding exclusive locks on some of this machine's GPUs.

Jobs that share one machine's GPUs (self-hosted CI runners, several experiments) each hold one
`fcntl.flock` lock file per GPU they use; the kernel drops a lock when the last process holding its file
exits, so a crashed job never leaves a stale lock. Requests are all-or-nothing: every attempt takes the
wanted locks non-blocking in ascending GPU order and, if any is busy, releases them all and retries after
a random backoff, so jobs asking for overlapping sets never deadlock and none sits on a partial set.

    python3 clawrl/ci/gpu_lock_exec.py --count 2 -- python tests/e2e/test_x.py
    python -m clawrl.ci.gpu_lock_exec --devices 0,1 -- CMD ARGS...
    clawrl gpu-lock-exec --print-only          # free GPUs, and who holds the busy ones

The command never outlives a supervising gpu-lock-exec, even a kill -9'ed one (so no orphan holds GPUs):
the kernel SIGKILLs it when its parent dies (Linux parent-death signal), and a watchdog process kills the
rest of the command's session when its pipe from the supervisor closes without a "done".
GPUs: --total-gpus N, else the machine's (nvidia-smi -L, else CUDA_/NVIDIA_VISIBLE_DEVICES), else an error.

Exit codes: EXIT_CODES_HELP below (also in `--help`).

Standard library only (Python >= 3.10), no clawrl imports: CI hosts run this file with a bare `python3`
before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_LOCK_PATH_PATTERN = "/dev/shm/custom_gpu_lock_{gpu_id}.lock"
# First argument of the watchdog process (this file run again); not an option users see.
WATCHDOG_ARG = "__gpu_lock_exec_watchdog__"
WATCHDOG_DONE = "done"
SESSION_KILL_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WAIT_REPORT_INTERVAL_S = 60.0
SUPERVISE_POLL_S = 0.2
LOG_PREFIX = "[gpu_lock_exec]"

TOTAL_GPUS_HELP = (
    "GPU ids scanned: 0..N-1 (default: the machine's GPUs, from nvidia-smi -L, else CUDA_VISIBLE_DEVICES "
    "or NVIDIA_VISIBLE_DEVICES; an error when none is found)"
)
EXEC_HELP = "replace this process with CMD (inherited descriptors keep the locks) instead of supervising it"
EXIT_CODES_HELP = """exit codes:
  N        the command's own exit code
  128+N    the command died of signal N, or gpu-lock-exec got signal N (forwarded to the command)
  124      the GPUs were not acquired within --timeout (the message names the holders)
  126/127  the command cannot be executed / was not found
  2        usage error, or no GPU found without --total-gpus
"""


class UsageError(Exception):
    """A bad option value; main() reports it in one line and exits with EXIT_USAGE."""


class AcquireTimeout(Exception):
    """The requested GPUs stayed busy until --timeout; the message says which and who holds them."""


@dataclass(kw_only=True)
class LockRequest:
    """What to acquire and how to wait for it (validated command-line options)."""

    count: int | None
    """Number of GPUs to take, any of them (--count); None when --devices is given."""
    devices: list[int] | None
    """Exact GPU ids in the user's order (--devices); None when --count is given."""
    total_gpus: int
    """GPU ids 0..total_gpus-1 exist and have a lock file."""
    lock_path_pattern: str
    """Lock file path with a `{gpu_id}` placeholder."""
    timeout_s: float
    """Give up (exit 124) after waiting this long from the first attempt."""
    max_backoff_s: float
    """Upper bound of the random sleep between two attempts."""

    def lock_path(self, gpu_id: int) -> str:
        return self.lock_path_pattern.format(gpu_id=gpu_id)

    def describe(self) -> str:
        if self.devices is not None:
            return "--devices " + ",".join(map(str, self.devices))
        return f"--count {self.count} of {self.total_gpus} GPUs"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run CMD while holding exclusive file locks on GPUs (one lock file per GPU).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    one_of = "(exactly one of --count/--devices)"
    add("--count", type=int, help=f"acquire any N free GPUs {one_of}")
    add("--devices", help=f"acquire exactly these GPU ids, e.g. 0,1 {one_of}")
    add("--total-gpus", type=int, help=TOTAL_GPUS_HELP)
    add("--timeout", type=float, default=86400.0, help="seconds to wait for the GPUs, then exit 124 (24 h)")
    add("--target-env-name", default="CUDA_VISIBLE_DEVICES", help="variable set to the acquired ids for CMD")
    add("--lock-path-pattern", default=DEFAULT_LOCK_PATH_PATTERN, help="lock file path with {gpu_id}")
    add("--print-only", action="store_true", help="print free GPUs and the holders of busy ones, then exit")
    add("--exec", dest="exec_mode", action="store_true", help=EXEC_HELP)
    add("--grace-period", type=float, default=10.0, help="seconds from a forwarded signal to SIGKILL of CMD")
    add("--max-backoff", type=float, default=5.0, help="longest random sleep between attempts, seconds")
    add("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    return parser


def nvidia_smi_gpu_count() -> tuple[int, str]:
    """(GPUs that `nvidia-smi -L` lists, what it said when that is 0): MIG lines are not GPUs."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return 0, "nvidia-smi not found"
    except (OSError, subprocess.SubprocessError) as error:
        return 0, f"nvidia-smi -L failed ({error})"
    if listing.returncode != 0:
        return 0, f"nvidia-smi -L exited {listing.returncode}"
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines()), "nvidia-smi -L lists none"


def visible_device_count(name: str) -> int:
    """Entries of a visible-devices variable; CUDA stops at the first negative id, 'none'/'void' mean none."""
    count = 0
    for item in os.environ.get(name, "").split(","):
        item = item.strip()
        if not item or item.startswith("-") or item in ("none", "void", "all"):
            break  # 'all' names no count: only nvidia-smi can say how many that is
        count += 1
    return count


def detect_total_gpus() -> int:
    """GPUs present: `nvidia-smi -L` lines, else entries of CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES.

    Raises UsageError naming --total-gpus when none is found, rather than guessing a count of GPUs that
    would then be "acquired" and handed to a command that has none.
    """
    num_listed, said = nvidia_smi_gpu_count()
    if num_listed > 0:
        return num_listed
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if visible_device_count(name) > 0:
            return visible_device_count(name)
    raise UsageError(
        f"no GPU found on this machine ({said}; CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES name none): "
        "pass --total-gpus N to lock GPU ids 0..N-1 anyway"
    )


def parse_devices(text: str, total_gpus: int) -> list[int]:
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise UsageError(f"--devices must be comma-separated GPU ids like 0,1, got {text!r}")
    devices = [int(item) for item in items]
    if len(set(devices)) != len(devices):
        raise UsageError(f"--devices lists a GPU twice: {text!r}")
    out_of_range = [d for d in devices if d >= total_gpus]
    if out_of_range:
        raise UsageError(
            f"--devices {text} names GPU {out_of_range[0]}, but --total-gpus is {total_gpus} "
            f"(ids 0..{total_gpus - 1}); pass --total-gpus if the detected count is wrong"
        )
    return devices


def check_lock_path_pattern(pattern: str) -> None:
    try:
        is_per_gpu = "{gpu_id}" in pattern and pattern.format(gpu_id=0) != pattern.format(gpu_id=1)
    except (KeyError, IndexError, ValueError) as error:
        raise UsageError(
            f"--lock-path-pattern {pattern!r} is not a valid pattern ({error!r}); use {{gpu_id}}"
        ) from None
    if not is_per_gpu:
        raise UsageError(f"--lock-path-pattern must contain '{{gpu_id}}', got {pattern!r}")


def check_numbers(args: argparse.Namespace) -> None:
    durations = {
        "--timeout": args.timeout,
        "--grace-period": args.grace_period,
        "--max-backoff": args.max_backoff,
    }
    for flag, value in durations.items():
        if value < 0:
            raise UsageError(f"{flag} must be >= 0, got {value}")
    if args.total_gpus is not None and args.total_gpus < 1:
        raise UsageError(f"--total-gpus must be >= 1, got {args.total_gpus}")


def validate(args: argparse.Namespace) -> LockRequest:
    """Check the options (raising UsageError naming the flag and value) and build the request."""
    check_numbers(args)
    check_lock_path_pattern(args.lock_path_pattern)
    if not args.print_only:
        if (args.count is None) == (args.devices is None):
            both = f"both --count {args.count} and --devices {args.devices}"
            given = "neither" if args.count is None else both
            raise UsageError(f"exactly one of --count or --devices is required, got {given}")
        if not args.cmd:
            raise UsageError("no command given: put it after --, e.g. --count 1 -- python train.py")
    total_gpus = args.total_gpus if args.total_gpus is not None else detect_total_gpus()
    devices = (
        parse_devices(args.devices, total_gpus) if args.devices is not None and not args.print_only else None
    )
    if args.count is not None and not args.print_only and not 0 <= args.count <= total_gpus:
        raise UsageError(f"--count must be between 0 and --total-gpus ({total_gpus}), got {args.count}")
    return LockRequest(
        count=None if devices is not None else args.count,
        devices=devices,
        total_gpus=total_gpus,
        lock_path_pattern=args.lock_path_pattern,
        timeout_s=args.timeout,
        max_backoff_s=args.max_backoff,
    )


def open_lock_file(path: str) -> int:
    """Open (creating it and its folder) a GPU's lock file; read-only if another user owns it (flock still works)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:
            return os.open(path, os.O_RDONLY)
    except OSError as error:
        raise UsageError(f"cannot open lock file {path} (from --lock-path-pattern): {error}") from None


def try_lock(path: str) -> int | None:
    """Take the lock without waiting: the locked fd, or None when someone else holds it."""
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release(held: dict[int, int]) -> None:
    for fd in held.values():
        os.close(fd)  # closing our descriptor drops the lock once no other process shares it
    held.clear()


def try_acquire(request: LockRequest) -> dict[int, int] | None:
    """One all-or-nothing attempt in ascending GPU order: {gpu_id: locked fd}, or None holding nothing."""
    wanted = sorted(request.devices) if request.devices is not None else range(request.total_gpus)
    num_needed = len(request.devices) if request.devices is not None else request.count
    held: dict[int, int] = {}
    for gpu_id in wanted:
        if len(held) == num_needed:
            break
        fd = try_lock(request.lock_path(gpu_id))
        if fd is not None:
            held[gpu_id] = fd
            if _is_writable(fd):
                os.ftruncate(fd, 0)  # drop the previous holder's record: it is stale from now on
        elif request.devices is not None:
            break  # an exact set with one busy GPU cannot succeed in this attempt
    if len(held) == num_needed:
        return held
    release(held)
    return None


def _is_writable(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY


def probe(request: LockRequest, gpu_ids: list[int]) -> tuple[list[int], list[int]]:
    """(free, busy) among gpu_ids, taking and dropping each lock at once; holds nothing afterwards."""
    free, busy = [], []
    for gpu_id in gpu_ids:
        fd = try_lock(request.lock_path(gpu_id))
        if fd is None:
            busy.append(gpu_id)
        else:
            os.close(fd)
            free.append(gpu_id)
    return free, busy


def holder_record(command: list[str], mode: str, gpu_ids: list[int]) -> dict:
    """Who holds the locks: written into every lock file of the set after it is acquired."""
    return {
        "pid": os.getpid(),
        "command": command,
        "host": socket.gethostname(),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": gpu_ids,
        "mode": mode,
    }


def write_holder(held: dict[int, int], record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    for fd in held.values():
        if _is_writable(fd):  # a lock file owned by another user is locked read-only: no record
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)


def read_holder(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as lock_file:
            record = json.loads(lock_file.read(65536) or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe_holder(request: LockRequest, gpu_id: int) -> str:
    record = read_holder(request.lock_path(gpu_id))
    if record is None:
        return f"GPU {gpu_id}: busy, holder unknown (no record in {request.lock_path(gpu_id)} yet)"
    command = record.get("command") or []
    command_text = shlex.join(map(str, command)) if isinstance(command, list) else str(command)
    child = f", command pid {record['command_pid']}" if "command_pid" in record else ""
    return (
        f"GPU {gpu_id}: busy, held by pid {record.get('pid')}{child} on host {record.get('host')} "
        f"since {record.get('start_time')}: {command_text[:200]}"
    )


def print_only(request: LockRequest) -> int:
    free, busy = probe(request, list(range(request.total_gpus)))
    print("Free GPUs: " + ",".join(map(str, free)), flush=True)
    for gpu_id in busy:
        print(describe_holder(request, gpu_id), flush=True)
    return 0


def busy_report(request: LockRequest) -> str:
    wanted = sorted(request.devices) if request.devices is not None else list(range(request.total_gpus))
    free, busy = probe(request, wanted)
    holders = [describe_holder(request, gpu_id) for gpu_id in busy]
    return "\n  ".join([f"free: {','.join(map(str, free)) or 'none'}", *holders])


def acquire(request: LockRequest) -> dict[int, int]:
    """Retry all-or-nothing attempts with random backoff until they succeed or --timeout passes."""
    deadline = time.monotonic() + request.timeout_s
    next_report = time.monotonic()
    while True:
        held = try_acquire(request)
        if held is not None:
            return held
        now = time.monotonic()
        if now >= deadline:
            raise AcquireTimeout(
                f"{LOG_PREFIX} timed out after {request.timeout_s:g} s waiting for {request.describe()}; "
                f"{busy_report(request)}"
            )
        if now >= next_report:  # say why we wait, but not on every attempt of a 24 h wait
            log(f"waiting for {request.describe()}; {busy_report(request)}")
            next_report = now + WAIT_REPORT_INTERVAL_S
        time.sleep(min(request.max_backoff_s * random.uniform(0.1, 1.0), max(0.0, deadline - now)))


def log(message: str) -> None:
    print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def signal_pgid(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group may be gone already
        os.killpg(pgid, signum)


class Supervisor:
    """Forwards termination signals to the command's process group; SIGKILLs the group after the grace period."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.pgid: int | None = None
        self.signum: int | None = None  # the first signal received
        self.kill_at: float | None = None

    def on_signal(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.kill_at = time.monotonic() + self.grace_s
        if self.pgid is not None:
            signal_pgid(self.pgid, signum)

    def wait(self, proc: subprocess.Popen) -> int:
        # Poll instead of a blocking wait: a signal handler cannot interrupt waitpid (PEP 475 retries it),
        # and the grace-period deadline must be enforced.
        while True:
            try:
                return proc.wait(timeout=SUPERVISE_POLL_S)
            except subprocess.TimeoutExpired:
                if self.kill_at is not None and time.monotonic() >= self.kill_at:
                    log("grace period over: SIGKILL to the command's process group")
                    signal_pgid(proc.pid, signal.SIGKILL)
                    self.kill_at = None


def session_members(session_id: int) -> list[int]:
    """Live processes of a session, from /proc (empty where /proc does not exist)."""
    members = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                    fields = (
                        stat.read().rsplit(")", 1)[1].split()
                    )  # after "pid (comm)": state ppid pgrp session
                if int(fields[3]) == session_id and fields[0] != "Z":
                    members.append(int(entry))
    return members


def kill_session(session_id: int, timeout_s: float = SESSION_KILL_TIMEOUT_S) -> None:
    """SIGKILL the command's session (its group and members in groups of their own) until none is left:
    a member may fork while the others are being killed."""
    signal_pgid(session_id, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while (members := session_members(session_id)) and time.monotonic() < deadline:
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def watchdog_main() -> int:
    """The watchdog process: EOF on the supervisor's pipe without "done" means the supervisor died (kill -9)
    without cleaning up: kill the command's session, whose id came through the pipe."""
    session_id, done = None, False
    for line in sys.stdin:
        word = line.strip()
        done = done or word == WATCHDOG_DONE
        if word.isdigit():
            session_id = int(word)
    if session_id is not None and not done:
        kill_session(session_id)
    return 0


def start_watchdog() -> subprocess.Popen | None:
    """This file again, as the watchdog: in a session of its own, so that signals to our process group spare
    it, and with no lock descriptor (close_fds), so that it never holds a GPU itself."""
    command = [sys.executable, "-I", "-S", os.path.abspath(__file__), WATCHDOG_ARG]
    try:
        return subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True
        )
    except OSError as error:
        warning = f"cannot start the watchdog ({error}): the command may outlive a kill -9 of gpu-lock-exec"
        log(f"warning: {warning}")
        return None


def tell_watchdog(watchdog: subprocess.Popen | None, word: str, close: bool = False) -> None:
    if watchdog is None:
        return
    with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):  # a dead watchdog hears nothing
        watchdog.stdin.write(word + "\n")
        watchdog.stdin.flush()
        if close:
            watchdog.stdin.close()
            watchdog.wait(timeout=SESSION_KILL_TIMEOUT_S)


def die_with_parent_hook():
    """A preexec_fn that makes the kernel SIGKILL the child when this process dies (Linux); None elsewhere."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not between fork and exec
    except (ImportError, OSError, AttributeError):
        return None
    parent_pid = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def spawn(cmd: list[str], env: dict[str, str], held: dict[int, int]) -> subprocess.Popen | int:
    """Start CMD in its own session, sharing the lock descriptors: the GPUs stay locked while it lives."""
    try:
        fds = list(held.values())
        hook = die_with_parent_hook()
        return subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=fds, preexec_fn=hook)
    except (FileNotFoundError, PermissionError) as error:
        return launch_failed(cmd, error)


def launch_failed(cmd: list[str], error: OSError) -> int:
    """Report a command that cannot be started; its exit code (127 not found, 126 not executable)."""
    if isinstance(error, FileNotFoundError):
        log(f"command not found: {cmd[0]}")
        return EXIT_NOT_FOUND
    log(f"cannot execute {cmd[0]}: {error}")
    return EXIT_CANNOT_EXECUTE


def supervise(cmd: list[str], env: dict[str, str], held: dict[int, int], record: dict, grace_s: float) -> int:
    """Run CMD as a child in its own session; return its exit code, or 128+signal."""
    supervisor = Supervisor(grace_s)
    # Handlers go in before the child exists, so a signal in between is remembered and forwarded.
    previous = {signum: signal.signal(signum, supervisor.on_signal) for signum in FORWARDED_SIGNALS}
    watchdog = start_watchdog()
    try:
        proc = spawn(cmd, env, held)
        if isinstance(proc, int):
            return proc
        tell_watchdog(watchdog, str(proc.pid))  # the session id: the command leads its session
        supervisor.pgid = proc.pid
        write_holder(held, {**record, "command_pid": proc.pid})
        if supervisor.signum is not None:
            signal_pgid(proc.pid, supervisor.signum)
        returncode = supervisor.wait(proc)
        if supervisor.signum is not None:
            kill_session(proc.pid)  # interrupted: leave no process of the command behind
    finally:
        tell_watchdog(watchdog, WATCHDOG_DONE, close=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if supervisor.signum is not None:
        return 128 + supervisor.signum
    return returncode if returncode >= 0 else 128 - returncode


def exec_command(cmd: list[str], env: dict[str, str], held: dict[int, int]) -> int:
    """Replace this process with CMD; the lock descriptors survive the exec, so the locks stay held."""
    for fd in held.values():
        os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except (FileNotFoundError, PermissionError) as error:
        return launch_failed(cmd, error)
    raise AssertionError("os.execvpe returned")


def run_holding(args: argparse.Namespace, request: LockRequest, held: dict[int, int]) -> int:
    gpu_ids = request.devices if request.devices is not None else sorted(held)
    print(f"{LOG_PREFIX} Acquired GPUs: {','.join(map(str, gpu_ids))}", flush=True)
    env = dict(os.environ)
    env[args.target_env_name] = ",".join(map(str, gpu_ids))
    record = holder_record(args.cmd, "exec" if args.exec_mode else "supervise", gpu_ids)
    write_holder(held, record)
    if args.exec_mode:
        return exec_command(args.cmd, env, held)
    return supervise(args.cmd, env, held, record, args.grace_period)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    try:
        request = validate(args)
        if args.print_only:
            return print_only(request)
        held = acquire(request)
    except UsageError as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")  # one line, nothing locked or run
    except AcquireTimeout as error:
        print(error, file=sys.stderr, flush=True)
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    try:
        return run_holding(args, request, held)
    finally:
        release(held)


if __name__ == "__main__":
    sys.exit(watchdog_main() if sys.argv[1:] == [WATCHDOG_ARG] else main())
