"""AsyncEngine: the synchronous engine core driven by one background thread, used from asyncio.

The core (clawrl/engine/core/engine.py) is single-threaded: `step()` runs one scheduler step. Here one thread
owns it. Everything else (new requests, aborts, pause/continue, weight updates, release/resume, cache
flush) is a command put on a thread-safe queue and applied by that thread *between* steps, so the core is
never touched concurrently and a weight update never lands in the middle of a forward pass.

Outputs reach the event loop in at most one hand-off per step (a deque drained by one call_soon_threadsafe
callback, which also takes what later steps post before it runs); the engine thread never waits for the loop.
`generate` (streaming) requests get every StepOutput on their asyncio queue; their coroutine turns token ids
into text (core/sequence.py's IncrementalDetokenizer) and yields deltas. `generate_full` requests (non-streaming: /generate,
OpenAI routes, health checks) cost the loop nothing per step: the engine thread adds their StepOutputs to flat
per-sample lists (core/request.py's OutputCollector), handed over once when the last sample is done, and the
text is decoded once. (A rollout's 256 requests would otherwise wake 256 coroutines and decode 256 texts
every step, holding the GIL that the engine thread needs between GPU steps.)

Three parts: the request API (`generate`, `generate_full`: this module), the control API (abort, pause /
continue, cache flush, weight loads, memory release / resume: control.py's ControlAPI, mixed in) and the
`Watchdog`. Commands reach the engine thread as (kind, arguments) and are applied by the handler that the
dispatch table `_handlers` (built in __init__) names for their kind.

Deadlines: every wait has one. The Watchdog times every call into the core; one that runs longer than
`step_timeout_s` dumps every thread's stack (faulthandler) and fails all waiting requests and commands with
EngineUnavailableError instead of letting them hang. Commands also wait with a deadline.

Usage (inside a running event loop):

    aengine = AsyncEngine(Engine(EngineConfig(model_path=...)))
    async for delta in aengine.generate(prompt_ids, SamplingParams(max_new_tokens=8)):
        print(delta.text, end="")
    results = await aengine.generate_full(prompt_ids, SamplingParams(n=4))
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import faulthandler
import gc
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clawrl.engine.control import ControlAPI, as_request_error
from clawrl.engine.core.request import (
    Collected,
    GenerationDelta,
    GenerationResult,
    OutputCollector,
    RequestError,
    RequestStream,
    SamplingParams,
    check_prompt,
    collect_results,
)

if TYPE_CHECKING:
    from clawrl.engine.runner.base import DeviceTiming

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve (stuck step, crashed thread, shut down); the server answers HTTP 503."""

    status_code = 503


@dataclass(kw_only=True)
class EngineStats:
    """Counters of the engine thread's core steps since start (cumulative; readers take differences)."""

    steps: int = 0
    """Core steps run (prefill, decode or mixed)."""
    busy_s: float = 0.0
    """Wall seconds inside Engine.step(), the GPU wait included."""
    cpu_s: float = 0.0
    """The engine thread's CPU seconds inside Engine.step() (a spinning wait for the GPU counts). Wall time
    that is neither this nor `wait_s` is time the thread was off the CPU: the GIL, or the OS scheduler."""
    idle_s: float = 0.0
    """Wall seconds the engine thread waited for a command with nothing to step (no request, or paused or
    released). A rollout's time that is neither this, `busy_s` nor `command_s` is the thread's own loop."""
    command_s: float = 0.0
    """Wall seconds applying commands: adding and aborting requests, weight updates, memory release..."""
    outputs: int = 0
    """Step outputs produced (a streamed request's sample: one per step; a collected one's: one when it
    finishes, plus one before each weight-version change)."""
    device: DeviceTiming | None = None
    """The CUDA runner's: seconds blocked on the GPU (`wait_s`) and the steps' span on it (`gpu_s`)."""

    def as_dict(self) -> dict[str, float]:
        stats = {"steps": self.steps, "busy_s": round(self.busy_s, 6), "cpu_s": round(self.cpu_s, 6),
                 "idle_s": round(self.idle_s, 6), "command_s": round(self.command_s, 6),
                 "outputs": self.outputs, "process_cpu_s": round(time.process_time(), 6)}  # fmt: skip
        if self.device is not None:
            stats["wait_s"], stats["gpu_s"] = round(self.device.wait_s, 6), round(self.device.gpu_s, 6)
        return stats


@dataclass
class _Command:
    kind: str
    args: dict[str, Any]
    future: concurrent.futures.Future


@dataclass
class _Pending:
    """A request accepted while generation is paused or memory released; added to the core later."""

    prompt_ids: list[int]
    params: SamplingParams
    collect: bool


@dataclass
class _Live:
    """A request in the core (engine thread only)."""

    remaining: set[int]
    """Its unfinished sample indices."""
    outputs: OutputCollector | None
    """generate_full: its outputs so far, handed over at the end; None: streamed every step."""


class Watchdog:
    """A thread that times the engine thread's calls into the core (`busy`). One that runs longer than
    `timeout_s` gets every thread's stack dumped to stderr (faulthandler) and is reported, once, to
    `on_stuck` with a message naming it; the watchdog then stops."""

    def __init__(self, *, timeout_s: float, poll_s: float, on_stuck: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._on_stuck = on_stuck
        self._since: float | None = None
        self._what = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="clawrl-engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def busy(self, what: str):
        """Time one call into the core (engine thread)."""
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._report(self._what, time.monotonic() - since)
                return

    def _report(self, what: str, elapsed_s: float) -> None:
        message = (
            f"engine {what!r} has run for {elapsed_s:.1f} s, more than step_timeout_s={self.timeout_s} s; "
            "the stacks of all threads were dumped to stderr"
        )
        logger.error(message)
        stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
        with contextlib.suppress(Exception):  # a dump failure must not hide the timeout itself
            faulthandler.dump_traceback(file=stream, all_threads=True)
        self._on_stuck(message)


class AsyncEngine(ControlAPI):
    """Serves one engine core to asyncio code; see the module docstring."""

    def __init__(self, engine: Any, *, step_timeout_s: float = 300.0, command_timeout_s: float | None = None,
                 served_model_name: str | None = None, watchdog_poll_s: float = 0.5,
                 freeze_gc: bool = True) -> None:  # fmt: skip
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_path = str(engine.config.model_path)
        self.served_model_name = served_model_name or self.model_path
        self.step_timeout_s = step_timeout_s
        # A command may wait behind one full step before it runs, so its deadline covers two.
        self.command_timeout_s = command_timeout_s or 2 * step_timeout_s + 30.0
        self.watchdog_poll_s = watchdog_poll_s
        self.freeze_gc = freeze_gc
        self._froze_gc = False
        self.context_len = int(engine.context_length)
        self.vocab_size = int(engine.model_args.vocab_size)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Request id -> where its events go: a queue (generate) or a future (generate_full). Loop thread only.
        self._streams: dict[str, asyncio.Queue | asyncio.Future] = {}
        # Engine thread -> loop: lists of (request id, event); a drain callback is queued and not started.
        self._outbox: collections.deque[list[tuple[str, Any]]] = collections.deque()
        self._drain_scheduled = False
        # Below: touched only by the engine thread.
        self._live: dict[str, _Live] = {}
        self._pending: dict[str, _Pending] = {}
        self._paused = False
        self._released: set[str] = set()
        self.stats = EngineStats(device=getattr(getattr(engine, "runner", None), "timing", None))
        """Read by /get_server_info (the rollout logs where its time went: perf/engine_busy_time)."""
        # Shared, written by one thread, read by others (single attribute stores are atomic in CPython).
        self._fatal: EngineUnavailableError | None = None
        self._stopping = False
        self._current: _Command | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.watchdog = Watchdog(timeout_s=step_timeout_s, poll_s=watchdog_poll_s,
                                 on_stuck=lambda message: self._die(EngineUnavailableError(message)))  # fmt: skip
        # The dispatch table: command kind -> the handler the engine thread applies it with.
        self._handlers: dict[str, Callable[..., Any]] = {
            "noop": self._apply_noop,
            "add": self._apply_add,
            **self.control_handlers(),
        }

    # ------------------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.freeze_gc:
            # Millions of objects are loaded (torch, transformers, model): a full GC pass scans them all,
            # ~0.2 s with every thread stopped, every few hundred steps; frozen, passes skip them.
            gc.collect()
            gc.freeze()
            self._froze_gc = True
        self._thread = threading.Thread(target=self._run, name="clawrl-engine", daemon=True)
        self._thread.start()
        self.watchdog.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its current step; waiting requests fail with EngineUnavailableError."""
        self._stopping = True
        self.watchdog.stop()
        self._commands.put(_Command("noop", {}, concurrent.futures.Future()))
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.engine.close()  # tensor-parallel workers, if any
        self._fail_everything(EngineUnavailableError("the engine was shut down"))
        if self._froze_gc:  # the engine's objects may be garbage from now on (tests start many engines)
            gc.unfreeze()
            self._froze_gc = False

    @property
    def is_alive(self) -> bool:
        return (
            self._fatal is None
            and self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
        )

    @property
    def weight_version(self) -> str:
        return str(self.engine.weight_version)

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def released_tags(self) -> list[str]:
        return sorted(self._released)

    @property
    def num_requests(self) -> int:
        """Requests this server is working on (running, queued or paused)."""
        return len(self._streams)

    def check_alive(self) -> None:
        """Raise EngineUnavailableError when requests cannot be served."""
        if self._fatal is not None:
            raise EngineUnavailableError(str(self._fatal))
        if self._stopping:
            raise EngineUnavailableError("the engine is shutting down")
        if self._thread is None:
            self.start()

    # ------------------------------------------------------------------------------------------------
    # the request API (the control API is ControlAPI's, control.py)

    def _check_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> str:
        """Validate a new request; returns its id (a fresh one when none is given)."""
        self.check_alive()
        rid = request_id or uuid.uuid4().hex
        params.validate()
        check_prompt(prompt_ids, field="prompt_ids", vocab_size=self.vocab_size, context_len=self.context_len,
                     max_new_tokens=params.max_new_tokens)  # fmt: skip
        if rid in self._streams:
            raise RequestError(f"rid {rid!r} is already used by a request in flight")
        return rid

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of all params.n samples (interleaved; each carries its `index`)."""
        rid = self._check_request(prompt_ids, params, request_id)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream  # before the add: the first outputs may arrive before the add returns
        state = RequestStream(rid, prompt_ids, params, self.tokenizer, self.weight_version)
        try:
            await self._call("add", rid=rid, prompt_ids=list(prompt_ids), params=params, collect=False)
            while state.unfinished:
                event = await stream.get()
                if isinstance(event, BaseException):
                    raise event
                for delta in state.deltas(event):
                    yield delta
        finally:
            self._streams.pop(rid, None)
            if state.unfinished and self._fatal is None and not self._stopping:
                # The consumer went away (client disconnect, cancellation): free the engine's work.
                self._submit("abort", rid=rid)

    async def generate_full(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationResult]:
        """Run a request to the end; one result per sample, ordered by index: what `generate`'s deltas add up
        to, handed over once, at the end (see the module docstring)."""
        rid = self._check_request(prompt_ids, params, request_id)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._streams[rid] = done  # before the add: the request may finish before the add returns
        version = self.weight_version
        collected: Collected | None = None
        try:
            await self._call("add", rid=rid, prompt_ids=list(prompt_ids), params=params, collect=True)
            collected = await done
        finally:
            self._streams.pop(rid, None)
            if collected is None and self._fatal is None and not self._stopping:
                # The consumer went away (client disconnect, cancellation): free the engine's work.
                self._submit("abort", rid=rid)
        return collect_results(rid, prompt_ids, params, self.tokenizer, version, collected)

    # ------------------------------------------------------------------------------------------------
    # the engine thread: commands submitted from any thread, applied between steps by `_handlers`

    def _submit(self, kind: str, **args: Any) -> concurrent.futures.Future:
        command = _Command(kind, args, concurrent.futures.Future())
        self._commands.put(command)
        if self._fatal is not None:  # the thread may already be gone; nobody else would answer
            _fail(command.future, EngineUnavailableError(str(self._fatal)))
        return command.future

    async def _call(self, kind: str, **args: Any) -> Any:
        self.check_alive()
        future = asyncio.wrap_future(self._submit(kind, **args))
        try:
            return await asyncio.wait_for(future, self.command_timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(
                f"the engine did not apply {kind!r} within {self.command_timeout_s:.0f} s (command_timeout_s)"
            ) from None

    def _run(self) -> None:
        try:
            while not self._stopping and self._fatal is None:
                self._apply_commands(block=not self._can_step())
                if self._can_step() and not self._stopping and self._fatal is None:
                    self._step()
        except BaseException as error:  # the core failed inside a step: it is in an unknown state
            logger.exception("engine thread failed")
            self._die(EngineUnavailableError(f"the engine failed: {error!r}"))

    def _can_step(self) -> bool:
        return not self._paused and not self._released and self.engine.has_unfinished_requests()

    def _apply_commands(self, *, block: bool) -> None:
        waited = time.perf_counter()
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            command = None
        applying = time.perf_counter()
        if block:
            self.stats.idle_s += applying - waited
        try:
            while command is not None:
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
        finally:
            self.stats.command_s += time.perf_counter() - applying

    def _apply(self, command: _Command) -> None:
        handler = self._handlers[command.kind]
        self._current = command
        try:
            with self.watchdog.busy(command.kind):
                result = handler(**command.args)
        except Exception as error:  # a failed command fails its caller, not the engine
            _fail(command.future, error if isinstance(error, RequestError) else as_request_error(error))
        else:
            _resolve(command.future, result)
        finally:
            self._current = None

    def _step(self) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        with self.watchdog.busy("step"):
            outputs = self.engine.step()
        stats = self.stats
        stats.steps, stats.busy_s = stats.steps + 1, stats.busy_s + (time.perf_counter() - started)
        stats.cpu_s += time.thread_time() - cpu_started
        stats.outputs += len(outputs)
        # Runs over the whole batch every step on the engine thread: a dict lookup and an append or an add.
        events: list[tuple[str, Any]] = []
        live_requests = self._live
        for output in outputs:
            rid = output.request_id
            live = live_requests.get(rid)
            if live is None:  # aborted here already; the core's late outputs are dropped
                continue
            if live.outputs is None:
                events.append((rid, output))
            else:
                live.outputs.add(output)
            if output.finished:
                live.remaining.discard(output.index)
                if not live.remaining:
                    del live_requests[rid]
                    if live.outputs is not None:
                        events.append((rid, Collected(live.outputs, [], time.monotonic())))
        self._post(events)

    # --- request handlers (engine thread; the control handlers are in control.py) ---

    def _apply_noop(self) -> None:
        return None

    def _apply_add(self, rid: str, prompt_ids: list[int], params: SamplingParams, collect: bool) -> None:
        if rid in self._live or rid in self._pending:
            raise RequestError(f"rid {rid!r} is already used by a request in flight")
        if self._paused or self._released:
            self._pending[rid] = _Pending(prompt_ids=prompt_ids, params=params, collect=collect)
            return
        self._add_to_core(rid, prompt_ids, params, collect)

    def _add_to_core(self, rid: str, prompt_ids: list[int], params: SamplingParams, collect: bool) -> None:
        self.engine.add_request(rid, prompt_ids, params, quiet=collect)  # collected: reported when finished
        outputs = OutputCollector(params.n) if collect else None
        self._live[rid] = _Live(remaining=set(range(params.n)), outputs=outputs)

    # ------------------------------------------------------------------------------------------------
    # delivery to the event loop

    def _post(self, events: list[tuple[str, Any]]) -> None:
        """Hand events to the loop (engine thread): a drain queued and not started yet takes them too (its
        flag is cleared before it drains the deque, so no event is left behind)."""
        if not events or self._loop is None:
            return
        self._outbox.append(events)
        if self._drain_scheduled:
            return
        self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._drain_outbox)

    def _drain_outbox(self) -> None:
        self._drain_scheduled = False
        while self._outbox:
            self._dispatch(self._outbox.popleft())

    def _dispatch(self, events: list[tuple[str, Any]]) -> None:
        for rid, event in events:
            sink = self._streams.get(rid)
            if sink is not None:
                _deliver(sink, event)

    def _fail_streams(self, error: BaseException) -> None:
        self._drain_outbox()  # events posted before the failure first (a finished request keeps its result)
        for sink in self._streams.values():
            _deliver(sink, error)

    # ------------------------------------------------------------------------------------------------
    # failure

    def _die(self, error: EngineUnavailableError) -> None:
        if self._fatal is None:
            self._fatal = error
        self._fail_everything(self._fatal)

    def _fail_everything(self, error: EngineUnavailableError) -> None:
        current = self._current
        if current is not None:
            _fail(current.future, error)
        while True:
            try:
                _fail(self._commands.get_nowait().future, error)
            except queue.Empty:
                break
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fail_streams, error)


def _deliver(sink: asyncio.Queue | asyncio.Future, event: Any) -> None:
    """To generate's queue: every event. To generate_full's future: its one Collected event, or an error."""
    if isinstance(sink, asyncio.Queue):
        sink.put_nowait(event)
    elif not sink.done():
        (sink.set_exception if isinstance(event, BaseException) else sink.set_result)(event)


def _resolve(future: concurrent.futures.Future, result: Any) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(result)


def _fail(future: concurrent.futures.Future, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(error)
