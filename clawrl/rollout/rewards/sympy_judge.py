"""Symbolic equivalence of two normalised math answers, checked by sympy in worker processes with a deadline.

Why a separate process: sympy can take unbounded time (or hold the GIL inside one long C-level integer
operation, e.g. `9^{9^{9}}`), and a thread cannot be stopped. So each comparison is sent to a worker process
(`sympy_worker.py`, one JSON line in, one JSON line out). Inside the worker a SIGALRM at `timeout_s` ends
Python-level work and the worker answers "unknown" (counted as not equal); if it has not answered 0.5 s after
that, the caller kills it and reports "not equal", and the next comparison starts a fresh worker.

Safety: sympy's parser evaluates its input, so answers are first rewritten into a small grammar (numbers,
single-letter symbols, + - * / ** and parentheses, and a fixed list of functions); anything else is
refused before it reaches sympy. Inputs longer than `MAX_CHARS` are refused too, and so are pairs that name
more than `MAX_UNKNOWNS` distinct variables (text answers, which sympy would read as products of letters).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time

import clawrl.rollout.rewards.sympy_worker as sympy_worker
from clawrl.rollout.rewards.latex import find_closing_brace
from clawrl.rollout.rewards.sympy_worker import FUNCTIONS

MAX_CHARS = 200
"""Answers longer than this (after normalisation) are not given to sympy."""
MAX_UNKNOWNS = 2
"""Answers naming more distinct variables than this (both sides together) are not given to sympy: words
such as "listen" and "silent" would otherwise read as equal products of letters."""
DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock limit of one sympy comparison."""
NUM_WORKERS = 2
"""Worker processes; concurrent comparisons beyond this wait for a free worker."""
_STARTUP_TIMEOUT_S = 60.0
_KILL_GRACE_S = 0.5  # time the worker gets to answer "overrun" itself before it is killed

_LATEX_WORDS = {
    "\\pi": " pi ",
    "\\infty": " oo ",
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
    "\\ln": " log",
    "\\log": " log",
    "\\exp": " exp",
    "\\sin": " sin",
    "\\cos": " cos",
    "\\tan": " tan",
    "\\cot": " cot",
    "\\sec": " sec",
    "\\csc": " csc",
}


# ------------------------------------------------------------------------------------------------------------
# LaTeX-ish answer -> sympy source text (runs in the caller; pure string work)
def to_sympy_source(answer: str) -> str | None:
    """Rewrite a normalised answer into the restricted sympy grammar; None if it falls outside it."""
    if len(answer) > MAX_CHARS:
        return None
    text = _replace_frac_sqrt(answer)
    if text is None:
        return None
    for word, replacement in sorted(_LATEX_WORDS.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(re.escape(word) + r"(?![a-zA-Z])", replacement, text)
    text = text.replace("{", "(").replace("}", ")").replace("^", "**")
    if (
        "\\" in text
        or not re.fullmatch(r"[0-9a-zA-Z+\-*/(). ]*", text)
        or re.search(r"(?<!\d)\.|\.(?!\d)", text)
    ):
        return None
    # Split unknown multi-letter words into single-letter symbols ("xy" -> "x*y"): only single letters and the
    # fixed function names ever reach sympy's evaluator.
    return re.sub(r"[a-zA-Z]+", _split_word, text) if text.strip() else None


def _num_unknowns(source: str) -> int:
    """Distinct one-letter variable names in sympy source (e and i are constants, not variables)."""
    return len({name for name in re.findall(r"[a-zA-Z]+", source) if len(name) == 1} - {"e", "i"})


def _split_word(match: re.Match) -> str:
    word = match.group(0)
    return word if word in FUNCTIONS else "*".join(word)


def _replace_frac_sqrt(text: str) -> str | None:
    """`\\frac{a}{b}` -> `((a)/(b))`, `\\sqrt{a}` -> `sqrt(a)`, `\\sqrt[n]{a}` -> `((a)**(1/(n)))`."""
    for _ in range(50):  # each pass rewrites the first command; bounded because MAX_CHARS bounds the count
        match = re.search(r"\\(frac|sqrt)", text)
        if match is None:
            return text
        args, end = _brace_args(text, match.end(), 2 if match.group(1) == "frac" else 1)
        if args is None:
            return None
        if match.group(1) == "frac":
            piece = f"(({args[0]})/({args[1]}))"
        elif args[0].startswith("["):
            index, radicand = args[0][1:].split("]", 1)
            piece = f"(({radicand})**(1/({index})))"
        else:
            piece = f"sqrt({args[0]})"
        text = text[: match.start()] + piece + text[end:]
    return None


def _brace_args(text: str, pos: int, count: int) -> tuple[list[str] | None, int]:
    """Read `count` brace groups from `pos` (a leading `[n]` is glued to the first); (None, pos) if malformed."""
    args = []
    prefix = ""
    bracket = re.match(r"\[([^\]]*)\]", text[pos:])
    if bracket and count == 1:
        prefix = "[" + bracket.group(1) + "]"
        pos += bracket.end()
    for _ in range(count):
        if pos >= len(text) or text[pos] != "{":
            return None, pos
        close = find_closing_brace(text, pos)
        if close is None:
            return None, pos
        args.append(text[pos + 1 : close])
        pos = close + 1
    args[0] = prefix + args[0]
    return args, pos


# ------------------------------------------------------------------------------------------------------------
# Caller side: a small pool of worker processes
class _Worker:
    """One `sympy_worker.py` process, restarted after it is killed for overrunning."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def compare(self, a: str, b: str, timeout_s: float) -> bool | None:
        """True/False from sympy; None on timeout or worker failure."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        try:
            self._proc.stdin.write(json.dumps({"a": a, "b": b, "timeout_s": timeout_s}).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._read_line(time.monotonic() + timeout_s + _KILL_GRACE_S)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:
            self.stop()
            return None
        return json.loads(line).get("equal")

    def _start(self) -> None:
        self._buffer = b""
        # Run as a script by file path: the worker imports only sympy and the standard library, not clawrl.
        self._proc = subprocess.Popen(
            [sys.executable, sympy_worker.__file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        if self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S) != "ready":
            self.stop()
            raise RuntimeError(
                f"sympy judge worker ({sys.executable} {sympy_worker.__file__}) did not report ready "
                f"within {_STARTUP_TIMEOUT_S:.0f} s; its stderr above says why"
            )

    def _read_line(self, deadline: float) -> str | None:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


class _Pool:
    def __init__(self, num_workers: int) -> None:
        # LIFO: the most recently used (warm) worker is reused, others start only under concurrency.
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._all = [_Worker() for _ in range(num_workers)]
        for worker in self._all:
            self._idle.put(worker)

    def compare(self, a: str, b: str, timeout_s: float) -> bool | None:
        worker = self._idle.get()
        try:
            return worker.compare(a, b, timeout_s)
        finally:
            self._idle.put(worker)

    def stop(self) -> None:
        for worker in self._all:
            worker.stop()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def sympy_equal(a: str, b: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether sympy proves the normalised answers equal within `timeout_s` (refused input -> False)."""
    source_a, source_b = to_sympy_source(a), to_sympy_source(b)
    if source_a is None or source_b is None or _num_unknowns(source_a + " " + source_b) > MAX_UNKNOWNS:
        return False
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool(NUM_WORKERS)
            atexit.register(_pool.stop)
    return bool(_pool.compare(source_a, source_b, timeout_s))
