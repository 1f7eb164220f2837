"""The AsyncEngine's control API: abort, pause / continue, cache flush, weight loads, memory release / resume.

Each public coroutine here puts one command on the engine thread's queue and waits for its result; the
engine thread applies it between two steps with the handler of the same kind, found in `control_handlers()`
(AsyncEngine merges that table into its own dispatch table). So a weight update never lands in the middle
of a forward pass, and the core is never touched by two threads.

`ControlAPI` is a mixin of `AsyncEngine` (async_engine.py), which provides the engine thread: `_call`
(submit a command and wait for it, with a deadline), `_post` (hand events to the requests' coroutines),
`_add_to_core` and the state declared below. Handlers run on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clawrl.config.engine import CORE_MEMORY_TAGS, MEMORY_TAGS
from clawrl.engine.core.request import Aborted, Collected, OutputCollector, RequestError

# SGLang's tags. "cuda_graph" is accepted (slime resumes ["kv_cache", "cuda_graph"] after a weight update) and
# does not reach the core: an engine whose memory keeps its addresses (clawrl/cuda_memory.py) keeps its graphs
# and their memory pool (not measured; the largest piece is one decode batch's logits, 78 MB at 0.5B x 256) across releases; any other engine frees its graphs whenever it
# releases anything and recaptures them after resume.
PAUSE_MODES = ("abort", "in_place", "retract")


class ControlAPI:
    """Control of a running engine (module docstring); mixed into AsyncEngine."""

    engine: Any
    """The engine core (core/engine.py's Engine)."""
    _live: dict[str, Any]
    """Requests in the core: request id -> its unfinished samples and collected outputs."""
    _pending: dict[str, Any]
    """Requests accepted while paused or released, added to the core at continue / resume."""
    _paused: bool
    _released: set[str]

    # -- the API (any coroutine) ----------------------------------------------------------------------

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
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of abort, in_place, retract, got {mode!r}")
        return await self._call("pause", mode=mode)

    async def continue_generation(self) -> None:
        """Resume scheduling; requests that arrived while paused start now."""
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
        """Load HF-named tensors between steps; returns the new weight version."""
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
        """Re-allocate what release_memory_occupation freed; waiting requests start once nothing is released."""
        await self._call("resume", tags=_check_tags(tags))

    # -- handlers (engine thread) ---------------------------------------------------------------------

    def control_handlers(self) -> dict[str, Callable[..., Any]]:
        """Command kind -> the handler that applies it (AsyncEngine's dispatch table takes these)."""
        return {
            "abort": self._apply_abort,
            "abort_all": self._apply_abort_all,
            "pause": self._apply_pause,
            "continue": self._apply_continue,
            "flush_cache": self._apply_flush_cache,
            "update_weights_from_disk": self._apply_update_weights_from_disk,
            "update_weights_from_tensors": self._apply_update_weights_from_tensors,
            "call": self._apply_call,
            "release": self._apply_release,
            "resume": self._apply_resume,
        }

    def _apply_abort(self, rid: str) -> bool:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            indices = list(range(pending.params.n))
            collected = Collected(OutputCollector(pending.params.n), indices) if pending.collect else None
            self._post([(rid, collected or Aborted(indices))])
            return True
        live = self._live.pop(rid, None)
        if live is None:
            return False
        aborted = self.engine.abort_request(rid)
        # Delivered here rather than waiting for the core's abort outputs: those may only come with a
        # later step, and there is none while generation is paused. A collected request's samples are quiet
        # (reported when they finish): their tokens so far come with the abort's outputs, added as not
        # finished so that the samples read as aborted (collect_results).
        if live.outputs is not None:
            for output in aborted:
                if output.token_ids:
                    live.outputs.add(output._replace(finished=False, finish_reason=None))
        indices = sorted(live.remaining)
        self._post([(rid, Aborted(indices) if live.outputs is None else Collected(live.outputs, indices))])
        return True

    def _apply_abort_all(self) -> int:
        rids = list(self._pending) + list(self._live)
        for rid in rids:
            self._apply_abort(rid)
        return len(rids)

    def _apply_pause(self, mode: str) -> int:
        num_aborted = self._apply_abort_all() if mode == "abort" else 0
        self._paused = True
        return num_aborted

    def _apply_continue(self) -> None:
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
                self._post([(rid, as_request_error(error))])

    def _apply_flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def _apply_update_weights_from_disk(self, model_path: str, weight_version: str | None,
                                        abort_all_requests: bool) -> str:  # fmt: skip
        if abort_all_requests:
            self._apply_abort_all()
        return str(self.engine.update_weights_from_disk(model_path, weight_version=weight_version))

    def _apply_update_weights_from_tensors(self, named_tensors: Any, weight_version: str | None) -> str:
        return str(self.engine.update_weights_from_tensors(named_tensors, weight_version=weight_version))

    def _apply_call(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def _apply_release(self, tags: list[str] | None) -> None:
        if self._live:
            raise RequestError(
                f"cannot release memory while {len(self._live)} requests are running; "
                "pause_generation (mode abort) first"
            )
        tags = list(tags or MEMORY_TAGS)
        core_tags = [tag for tag in tags if tag in CORE_MEMORY_TAGS]
        if core_tags:
            self.engine.release_memory_occupation(core_tags)
        self._released |= set(tags)

    def _apply_resume(self, tags: list[str] | None) -> None:
        tags = list(tags or MEMORY_TAGS)
        core_tags = [tag for tag in tags if tag in CORE_MEMORY_TAGS]
        if core_tags:
            self.engine.resume_memory_occupation(core_tags)
        self._released -= set(tags)
        self._admit_pending()

    # -- provided by AsyncEngine ----------------------------------------------------------------------

    async def _call(self, kind: str, **args: Any) -> Any:
        raise NotImplementedError

    def _post(self, events: list[tuple[str, Any]]) -> None:
        raise NotImplementedError

    def _add_to_core(self, rid: str, prompt_ids: list[int], params: Any, collect: bool) -> None:
        raise NotImplementedError


def _check_tags(tags: list[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise RequestError(f"tags must be a subset of {list(MEMORY_TAGS)}, got {unknown!r}")
    return list(tags)


def as_request_error(error: Exception) -> Exception:
    """Core ValueErrors are the caller's mistake (bad path, bad params): make them 400s with the message."""
    if isinstance(error, (ValueError, FileNotFoundError, KeyError)):
        return RequestError(str(error))
    return error
