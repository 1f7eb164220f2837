"""Timing, in one place: `timed` for one call, `Timers` for named phases popped as perf/<name>_time metrics.

    out, seconds = timed(fn, *args)          # one call's wall time (the loops' perf/rollout_time, ...)

    timers = Timers(cuda_sync=True)
    with timers("rollout"):
        batch = generate()
    @timers("update_weights")
    def sync(): ...
    metrics.update(timers.pop())   # {"perf/rollout_time": s, "perf/update_weights_time": s, "perf/step_time": s}

    with GcPauses() as pauses:               # the garbage collector's pauses in this process meanwhile
        batch = generate()
    pauses.seconds, pauses.collections       # wall seconds in collections; collections per generation

A name timed several times within a step accumulates; `totals()` reads the sums without the step time
(the trainer's per-phase times). `perf/step_time` is the wall time from the first
timer started since the last pop() to this pop(), so it includes untimed work between phases (the sum of
the phase times can be smaller). With cuda_sync, every start, stop and pop first waits for queued CUDA work
(torch.cuda.synchronize) so asynchronous kernels are charged to the phase that launched them; without a
GPU the option does nothing.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import ContextDecorator
from typing import Any, TypeVar

T = TypeVar("T")


class Timers:
    """Named, non-reentrant wall-clock timers; `timers(name)` is a context manager and a decorator."""

    def __init__(self, *, cuda_sync: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._synchronize = _cuda_synchronize_fn() if cuda_sync else None
        self._totals: dict[str, float] = {}
        self._running: dict[str, float] = {}
        self._step_start: float | None = None

    def __call__(self, name: str) -> _Span:
        """A context manager / decorator timing `name`."""
        return _Span(self, name)

    def start(self, name: str) -> None:
        if not name or name == "step" or "/" in name:
            raise ValueError(f"timer name must be non-empty, not 'step', without '/', got {name!r}")
        if name in self._running:
            raise RuntimeError(f"timer {name!r} is already running")
        now = self._now()
        if self._step_start is None:
            self._step_start = now
        self._running[name] = now

    def stop(self, name: str) -> float:
        """Stop `name`; returns the seconds of this interval (the step total accumulates)."""
        if name not in self._running:
            raise RuntimeError(f"timer {name!r} is not running")
        elapsed = self._now() - self._running.pop(name)
        self._totals[name] = self._totals.get(name, 0.0) + elapsed
        return elapsed

    def totals(self) -> dict[str, float]:
        """{name: seconds} accumulated since the last pop (running timers not included)."""
        return dict(self._totals)

    def pop(self) -> dict[str, float]:
        """{"perf/<name>_time": s for each timer, "perf/step_time": s} since the last pop; then reset."""
        if self._running:
            raise RuntimeError(f"timers still running at pop(): {sorted(self._running)}")
        out = {f"perf/{name}_time": total for name, total in self._totals.items()}
        if self._step_start is not None:
            out["perf/step_time"] = self._now() - self._step_start
        self._totals, self._step_start = {}, None
        return out

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()


class _Span(ContextDecorator):
    def __init__(self, timers: Timers, name: str) -> None:
        self.timers, self.name = timers, name

    def __enter__(self) -> _Span:
        self.timers.start(self.name)
        return self

    def __exit__(self, *exc) -> bool:
        self.timers.stop(self.name)
        return False


def _cuda_synchronize_fn() -> Callable[[], None] | None:
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else None


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """(fn(*args), wall seconds it took). No CUDA sync: the callers time calls that wait for their results."""
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


class GcPauses:
    """Wall time this process spends in the garbage collector while the context is open, all threads' collections
    included (a collection stops every thread of the process), and the number of collections per generation.
    A full collection scans every tracked object that is not frozen (gc.freeze): in a process that imported
    torch, transformers and Ray and was not frozen that is ~0.1 s, at an allocation that happens to trigger it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.collections[info["generation"]] += 1
