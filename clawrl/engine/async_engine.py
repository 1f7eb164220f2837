"""AsyncEngine: the synchronous engine core driven by one background thread, used from asyncio.

The core (clawrl/engine/engine.py) is single-threaded: `step()` runs one scheduler step. Here one thread
owns it. Everything else (new requests, aborts, pause/continue, weight updates, release/resume, cache
flush) is a command put on a thread-safe queue and applied by that thread *between* steps, so the core is
never touched concurrently and a weight update never lands in the middle of a forward pass.

Outputs reach the event loop in at most one hand-off per step (a deque drained by one call_soon_threadsafe
callback, which also takes what later steps post before it runs); the engine thread never waits for the loop.
`generate` (streaming) requests get every StepOutput on their asyncio queue; their coroutine turns token ids
into text (text_stream.IncrementalText) and yields deltas. `generate_full` requests (non-streaming: /generate,
OpenAI routes, health checks) cost the loop nothing per step: the engine thread adds their StepOutputs to flat
per-sample lists (request_output.OutputCollector), handed over once when the last sample is done, and the
text is decoded once. (A rollout's 256 requests would otherwise wake 256 coroutines and decode 256 texts
every step, holding the GIL that the engine thread needs between GPU steps.)

Deadlines (ARCHITECTURE decision 10): a watchdog thread watches every call into the core; one that runs
longer than `step_timeout_s` dumps every thread's stack (faulthandler) and fails all waiting requests and
commands with EngineUnavailableError instead of letting them hang. Commands also wait with a deadline.

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
from typing import Any

from clawrl.engine.protocol import EngineUnavailableError, RequestError, check_prompt
from clawrl.engine.request_output import (
    Aborted,
    Collected,
    GenerationDelta,
    GenerationResult,
    OutputCollector,
    RequestStream,
    collect_results,
)
from clawrl.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# SGLang's tags. "cuda_graph" is accepted (slime resumes ["kv_cache", "cuda_graph"] after a weight update)
# but the core has no graphs to free yet, so only the other tags reach it.
ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
_CORE_MEMORY_TAGS = ("weights", "kv_cache")


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


class AsyncEngine:
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
        # Shared, written by one thread, read by others (single attribute stores are atomic in CPython).
        self._fatal: EngineUnavailableError | None = None
        self._stopping = False
        self._busy_since: float | None = None
        self._busy_what = ""
        self._current: _Command | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()

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
        self._watchdog = threading.Thread(target=self._watch, name="clawrl-engine-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its current step; waiting requests fail with EngineUnavailableError."""
        self._stopping = True
        self._watchdog_stop.set()
        self._commands.put(_Command("noop", {}, concurrent.futures.Future()))
        if self._thread is not None:
            self._thread.join(timeout_s)
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
    # generation

    def _check_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> str:
        """Validate a new request; returns its id (a fresh one when none is given)."""
        self.check_alive()
        rid = request_id or uuid.uuid4().hex
        try:
            params.validate()
        except ValueError as error:
            raise RequestError(str(error)) from None
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
    # control (each applied by the engine thread between steps)

    async def abort_request(self, request_id: str) -> bool:
        """Abort one request (all its samples); False when no such request is in flight."""
        return await self._call("abort", rid=request_id)

    async def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        return await self._call("abort_all")

    async def pause_generation(self, mode: str = "abort") -> int:
        """Stop scheduling between steps. mode "abort" (SGLang's default) aborts in-flight requests and
        returns how many; "in_place" keeps them, K/V included, until continue_generation. "retract" is
        treated as "in_place" (the core keeps the K/V, so flush_cache refuses, unlike SGLang's retract).
        Requests that arrive while paused wait."""
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"mode must be one of abort, in_place, retract, got {mode!r}")
        return await self._call("pause", mode=mode)

    async def continue_generation(self) -> None:
        await self._call("continue")

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False when requests are running (the core refuses then)."""
        return bool(await self._call("flush_cache"))

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> str:  # fmt: skip
        """Load weights from a HF directory between steps; returns the new weight version.

        Requests in flight keep going afterwards with the new weights (their tokens carry the new
        version); with abort_all_requests they are aborted first.
        """
        return await self._call("update_weights_from_disk", model_path=model_path, weight_version=weight_version,
                                abort_all_requests=abort_all_requests)  # fmt: skip

    async def update_weights_from_tensors(self, named_tensors: Any, weight_version: str | None = None) -> str:
        return await self._call("update_weights_from_tensors", named_tensors=named_tensors,
                                weight_version=weight_version)  # fmt: skip

    async def run_in_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between steps and return its result (weight sync loads buckets
        this way: the core must never be touched while it steps). ValueErrors become RequestErrors."""
        return await self._call("call", fn=fn)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free KV cache and/or weights (tags None: all). Refused while requests are in flight."""
        await self._call("release", tags=_check_tags(tags))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("resume", tags=_check_tags(tags))

    # ------------------------------------------------------------------------------------------------
    # commands: submitted from any thread, applied by the engine thread

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
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        handler = getattr(self, f"_cmd_{command.kind}")
        self._current = command
        try:
            with self._busy(command.kind):
                result = handler(**command.args)
        except Exception as error:  # a failed command fails its caller, not the engine
            _fail(command.future, error if isinstance(error, RequestError) else _as_request_error(error))
        else:
            _resolve(command.future, result)
        finally:
            self._current = None

    def _step(self) -> None:
        with self._busy("step"):
            outputs = self.engine.step()
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
                        events.append((rid, Collected(live.outputs, [])))
        self._post(events)

    # --- command handlers (engine thread) ---

    def _cmd_noop(self) -> None:
        return None

    def _cmd_add(self, rid: str, prompt_ids: list[int], params: SamplingParams, collect: bool) -> None:
        if rid in self._live or rid in self._pending:
            raise RequestError(f"rid {rid!r} is already used by a request in flight")
        if self._paused or self._released:
            self._pending[rid] = _Pending(prompt_ids=prompt_ids, params=params, collect=collect)
            return
        self._add_to_core(rid, prompt_ids, params, collect)

    def _add_to_core(self, rid: str, prompt_ids: list[int], params: SamplingParams, collect: bool) -> None:
        self.engine.add_request(rid, prompt_ids, params)
        outputs = OutputCollector(params.n) if collect else None
        self._live[rid] = _Live(remaining=set(range(params.n)), outputs=outputs)

    def _cmd_abort(self, rid: str) -> bool:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            indices = list(range(pending.params.n))
            collected = Collected(OutputCollector(pending.params.n), indices) if pending.collect else None
            self._post([(rid, collected or Aborted(indices))])
            return True
        live = self._live.pop(rid, None)
        if live is None:
            return False
        self.engine.abort_request(rid)
        # Delivered here rather than waiting for the core's abort outputs: those may only come with a
        # later step, and there is none while generation is paused.
        indices = sorted(live.remaining)
        self._post([(rid, Aborted(indices) if live.outputs is None else Collected(live.outputs, indices))])
        return True

    def _cmd_abort_all(self) -> int:
        rids = list(self._pending) + list(self._live)
        for rid in rids:
            self._cmd_abort(rid)
        return len(rids)

    def _cmd_pause(self, mode: str) -> int:
        num_aborted = self._cmd_abort_all() if mode == "abort" else 0
        self._paused = True
        return num_aborted

    def _cmd_continue(self) -> None:
        self._paused = False
        self._admit_pending()

    def _admit_pending(self) -> None:
        if self._paused or self._released:
            return
        pending, self._pending = self._pending, {}
        for rid, request in pending.items():
            try:
                self._add_to_core(rid, request.prompt_ids, request.params, request.collect)
            except Exception as error:
                self._post([(rid, _as_request_error(error))])

    def _cmd_flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def _cmd_update_weights_from_disk(self, model_path: str, weight_version: str | None,
                                      abort_all_requests: bool) -> str:  # fmt: skip
        if abort_all_requests:
            self._cmd_abort_all()
        return str(self.engine.update_weights_from_disk(model_path, weight_version=weight_version))

    def _cmd_update_weights_from_tensors(self, named_tensors: Any, weight_version: str | None) -> str:
        return str(self.engine.update_weights_from_tensors(named_tensors, weight_version=weight_version))

    def _cmd_call(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def _cmd_release(self, tags: list[str] | None) -> None:
        if self._live:
            raise RequestError(
                f"cannot release memory while {len(self._live)} requests are running; "
                "pause_generation (mode abort) first"
            )
        tags = list(tags or ALL_MEMORY_TAGS)
        core_tags = [tag for tag in tags if tag in _CORE_MEMORY_TAGS]
        if core_tags:
            self.engine.release_memory_occupation(core_tags)
        self._released |= set(tags)

    def _cmd_resume(self, tags: list[str] | None) -> None:
        tags = list(tags or ALL_MEMORY_TAGS)
        core_tags = [tag for tag in tags if tag in _CORE_MEMORY_TAGS]
        if core_tags:
            self.engine.resume_memory_occupation(core_tags)
        self._released -= set(tags)
        self._admit_pending()

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
    # deadlines

    @contextlib.contextmanager
    def _busy(self, what: str):
        self._busy_what, self._busy_since = what, time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def _watch(self) -> None:
        while not self._watchdog_stop.wait(self.watchdog_poll_s):
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.step_timeout_s:
                self._on_stuck(self._busy_what, time.monotonic() - since)
                return

    def _on_stuck(self, what: str, elapsed_s: float) -> None:
        message = (
            f"engine {what!r} has run for {elapsed_s:.1f} s, more than step_timeout_s={self.step_timeout_s} s; "
            "the stacks of all threads were dumped to stderr"
        )
        logger.error(message)
        stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
        with contextlib.suppress(Exception):  # a dump failure must not hide the timeout itself
            faulthandler.dump_traceback(file=stream, all_threads=True)
        self._die(EngineUnavailableError(message))

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


def _check_tags(tags: list[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = [tag for tag in tags if tag not in ALL_MEMORY_TAGS]
    if unknown:
        raise RequestError(f"tags must be a subset of {list(ALL_MEMORY_TAGS)}, got {unknown!r}")
    return list(tags)


def _as_request_error(error: Exception) -> Exception:
    """Core ValueErrors are the caller's mistake (bad path, bad params): make them 400s with the message."""
    if isinstance(error, (ValueError, FileNotFoundError, KeyError)):
        return RequestError(str(error))
    return error


def _resolve(future: concurrent.futures.Future, result: Any) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(result)


def _fail(future: concurrent.futures.Future, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(error)
