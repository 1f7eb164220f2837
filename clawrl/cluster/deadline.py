"""Deadlines on every wait of the driver, with the stacks of whatever is stuck when one fires.

Each actor process calls `enable_stack_dumps(label)` when it starts: Python's faulthandler then writes the
stacks of all its threads to a file when the process gets SIGUSR1 (and on a fatal signal). The driver keeps
an `ActorInfo` per actor; `wait_all(refs, what, timeout_s, actors)` returns the results, or on a deadline
asks the actors for their stacks, prints them to stderr, and raises one DeadlineError naming what was waited
for and which actors did not answer. An actor that died raises ActorFailure naming it.

    actors = [ActorInfo("trainer rank 0", pid, node_ip), ...]
    results = wait_all([a.train.remote(b) for a in ...], "train(rollout 3)", 3600, actors)
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

STACK_DIR = Path(tempfile.gettempdir()) / "clawrl-stacks"
_dump_file = None  # kept open for the life of the process: faulthandler writes to its descriptor


class DeadlineError(TimeoutError):
    """A wait ran past its deadline; the message names what was waited for (stacks were printed before)."""


class ActorFailure(RuntimeError):
    """An actor died while the driver waited on it; the message names the actor and the cause."""


@dataclass(frozen=True)
class ActorInfo:
    """What the driver needs to ask an actor for its stacks."""

    label: str
    """Human name, e.g. "engine 0" or "trainer rank 1"."""
    pid: int
    """The actor's process id."""
    node_ip: str
    """The address of its node (actors on other hosts are asked through a Ray task placed on that node)."""


def enable_stack_dumps(label: str) -> tuple[int, str]:
    """In an actor process: dump all thread stacks to STACK_DIR/<pid>.txt on SIGUSR1 and on fatal signals.
    Returns (pid, node ip) for the driver's ActorInfo."""
    global _dump_file
    STACK_DIR.mkdir(parents=True, exist_ok=True)
    if _dump_file is None:
        _dump_file = open(STACK_DIR / f"{os.getpid()}.txt", "w")  # noqa: SIM115 (must stay open)
        _dump_file.write(f"# {label}, pid {os.getpid()}\n")
        _dump_file.flush()
        faulthandler.enable(file=_dump_file, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True, chain=False)
    return os.getpid(), ray.util.get_node_ip_address()


REMOTE_STACKS_TIMEOUT_S = 30.0
"""How long the driver waits for the stack-collecting task on another host (it may have to start a worker)."""


def collect_stacks(actors: list[ActorInfo], *, wait_s: float = 1.0) -> dict[str, str]:
    """Ask each actor for its stacks (SIGUSR1) and read them back: {label: text}. Actors on the driver's
    host are signalled from here; those on other hosts by a small Ray task scheduled on their node."""
    here = ray.util.get_node_ip_address()
    out = _stacks_here([a for a in actors if a.node_ip == here], wait_s)
    elsewhere: dict[str, list[ActorInfo]] = {}
    for actor in actors:
        if actor.node_ip != here:
            elsewhere.setdefault(actor.node_ip, []).append(actor)
    refs = {
        ip: _stacks_on_node.options(num_cpus=0, resources={f"node:{ip}": 0.001}).remote(group, wait_s)
        for ip, group in elsewhere.items()
    }
    ready = []
    if refs:
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=REMOTE_STACKS_TIMEOUT_S)
    for ip, ref in refs.items():
        try:
            if ref in ready:
                out.update(ray.get(ref))
        except Exception as error:  # a dead node must not hide the DeadlineError that asked for stacks
            for actor in elsewhere[ip]:
                out[actor.label] = f"(runs on node {ip}: collecting its stacks failed: {_first_line(error)})"
    for actor in actors:
        out.setdefault(
            actor.label,
            f"(runs on node {actor.node_ip}: no stacks came back within {REMOTE_STACKS_TIMEOUT_S:g} s)",
        )
    return out


def _stacks_here(actors: list[ActorInfo], wait_s: float) -> dict[str, str]:
    """SIGUSR1 to each actor of this host, then what each wrote to its dump file since."""
    sizes = {}
    for actor in actors:
        path = STACK_DIR / f"{actor.pid}.txt"
        if not path.exists():
            continue
        sizes[actor.label] = (actor, path, path.stat().st_size)
        try:
            os.kill(actor.pid, signal.SIGUSR1)
        except ProcessLookupError:
            sizes[actor.label] = (actor, path, -1)
    time.sleep(wait_s if sizes else 0.0)
    out = {}
    for label, (actor, path, size) in sizes.items():
        if size < 0:
            out[label] = f"(process {actor.pid} is gone)\n" + _tail(path.read_text(errors="replace"))
        else:
            out[label] = path.read_text(errors="replace")[size:] or "(no answer to SIGUSR1)"
    for actor in actors:
        out.setdefault(actor.label, f"(no stack dump file for pid {actor.pid} on {actor.node_ip})")
    return out


_stacks_on_node = ray.remote(max_retries=0)(_stacks_here)


def print_stacks(stacks: dict[str, str]) -> None:
    for label, text in stacks.items():
        print(f"---- stacks of {label} ----\n{text.rstrip()}", file=sys.stderr, flush=True)


def wait_all(refs: list, what: str, timeout_s: float, actors: list[ActorInfo] | None = None,
             owners: list[str] | None = None, poll: Callable[[], None] | None = None,
             started: float | None = None) -> list[Any]:  # fmt: skip
    """ray.get(refs) within `timeout_s`. On the deadline: stacks of `actors` printed, DeadlineError.
    `owners[i]` names who computes refs[i] (for the error message). `poll`, if given, is called about once
    a second while waiting; it raises to end the wait early (e.g. a failure the results depend on).
    `started` (time.monotonic()) is when the calls began, if before this wait: the deadline counts from it."""
    owners = owners or [f"call {i}" for i in range(len(refs))]
    deadline = (time.monotonic() if started is None else started) + timeout_s
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(
            refs, num_returns=len(refs), timeout=left if poll is None else min(left, 1.0)
        )
        if not pending or left <= 1.0 or poll is None:
            break
        poll()
    if pending:
        stuck = [owners[refs.index(r)] for r in pending]
        print_stacks(collect_stacks(actors or []))
        raise DeadlineError(
            f"{what}: {', '.join(stuck)} did not finish within the {timeout_s:g} s deadline "
            "(stacks printed above)"
        )
    return [get_result(ref, what, owner) for ref, owner in zip(refs, owners, strict=True)]


def get_result(ref, what: str, owner: str) -> Any:
    """ray.get of a finished call; an actor that died raises ActorFailure naming `owner` and `what`, any
    other error of the call is raised as the call raised it."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as error:
        raise ActorFailure(f"{what}: {owner} died ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])
