"""EngineRouter: a client-side router that spreads `/generate` requests over engine servers.

No extra process: the rollout manager holds the router and talks to every engine itself. Each request goes
to the engine with the fewest outstanding requests (ties broken round-robin), or, given a `session_id`, to
the engine that served that session before (prefix-cache reuse for multi-turn rollouts) while it is up.

Deadlines everywhere: every HTTP call carries a timeout (`request_timeout_s` for generation,
`health_timeout_s` for health checks and control calls) and is also bounded by `asyncio.wait_for`, so a
hung engine becomes an error rather than a silent wait.

Failover: a request that cannot reach its engine (connection refused / connect timeout) or that the engine
refuses as unavailable (HTTP 503) is sent to another engine, at most `max_failovers` times, then fails with
one EngineRouterError naming every engine tried and why. Other failures (a 400 for a bad request, a read
timeout of a request that may still be running) are raised at once: retrying them would repeat a mistake
or duplicate work. An engine that failed to connect is skipped for `down_cooldown_s` unless no other is up.

    router = EngineRouter(["http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    out = await router.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}})
    await router.check_health()      # {url: {"ok": True, ...}}; EngineHealthError naming dead engines
    await router.abort_all()         # {url: number of requests aborted}
    await router.aclose()

The router is bound to the event loop that first uses it (its HTTP clients are).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from clawrl.engine.http.client import KEEPALIVE_EXPIRY_S, AsyncEngineClient, EngineClientError

# Sessions remembered for affinity; the oldest are forgotten first (a session only matters while it runs).
_MAX_SESSIONS = 100_000


class EngineRouterError(RuntimeError):
    """A request could not be served by any engine; the message names each engine tried and its error."""


class EngineHealthError(EngineRouterError):
    """One or more engines failed their health check; `statuses` holds the per-URL results."""

    def __init__(self, message: str, statuses: dict[str, dict[str, Any]]) -> None:
        super().__init__(message)
        self.statuses = statuses


class EngineRouter:
    """Least-outstanding-requests routing with session affinity, failover and health checks."""

    def __init__(
        self,
        urls: list[str],
        *,
        request_timeout_s: float = 1800.0,
        health_timeout_s: float = 30.0,
        max_failovers: int | None = None,
        down_cooldown_s: float = 5.0,
        max_concurrent_requests: int | None = None,
        fault_tolerant: bool = False,
        keepalive_s: float = KEEPALIVE_EXPIRY_S,
        compact_answers: bool = False,
    ) -> None:
        urls = [url.rstrip("/") for url in urls]
        if not urls:
            raise ValueError("EngineRouter needs at least one engine URL, got none")
        if len(set(urls)) != len(urls):
            raise ValueError(f"EngineRouter got duplicate engine URLs: {urls}")
        if request_timeout_s <= 0 or health_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got request_timeout_s={request_timeout_s}, "
                f"health_timeout_s={health_timeout_s}"
            )
        self._urls = urls
        self.request_timeout_s = float(request_timeout_s)
        self.health_timeout_s = float(health_timeout_s)
        # Default: every other engine may be tried once.
        self.max_failovers = len(urls) - 1 if max_failovers is None else max_failovers
        self.down_cooldown_s = down_cooldown_s
        self.keepalive_s = keepalive_s
        """The clients' idle connection expiry (AsyncEngineClient's keepalive_s)."""
        self.compact_answers = compact_answers
        """Every engine is clawrl's own server: the default generate functions ask it for packed logprobs
        (`compact_logprobs`, clawrl/fast_json.py); an SGLang server would refuse the field."""
        self._clients = {url: self._client(url) for url in urls}
        self._outstanding = dict.fromkeys(urls, 0)
        self._served = dict.fromkeys(urls, 0)
        self._down_until = dict.fromkeys(urls, 0.0)
        self._next = 0  # round-robin cursor for ties
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._max_concurrent = max_concurrent_requests
        self._slots: asyncio.Semaphore | None = None  # created on the loop that uses the router
        self.fault_tolerant = fault_tolerant
        self._stale_clients: list[AsyncEngineClient] = []  # of replaced engines, closed by aclose
        self._dead: set[str] = set()  # fault tolerance: engines whose process failed, until replaced
        self.num_retried = 0
        self._fault: tuple[str, Any] | None = None  # (url, fire) armed by arm_fault
        """Fault tolerance: requests re-sent because their engine failed while serving them."""

    @property
    def urls(self) -> list[str]:
        """The engine URLs, in the order given."""
        return list(self._urls)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per engine: requests outstanding now and requests served so far."""
        return {
            url: {"outstanding": self._outstanding[url], "served": self._served[url]} for url in self._urls
        }

    # ------------------------------------------------------------------------------------------------
    # generation

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> Any:
        """POST /generate with `payload` (SGLang's body) on the chosen engine; the parsed response. A batch
        payload counts as one request per prompt, for the concurrency bound and the load balance."""
        if payload.get("stream"):
            raise ValueError("EngineRouter.generate does not stream; send the payload without stream=True")
        weight = _num_prompts(payload)
        if self._max_concurrent is not None and self._slots is None:
            self._slots = asyncio.Semaphore(self._max_concurrent)
            self._slots_lock = asyncio.Lock()
        if self._slots is None:
            return await self._generate_with_failover(payload, session_id, weight)
        # A batch takes its slots under a lock: two batches taking theirs one by one could each hold part of
        # the bound and wait for the other forever. A batch larger than the bound takes all of it.
        held = min(weight, self._max_concurrent)
        async with self._slots_lock:
            for _ in range(held):
                await self._slots.acquire()
        try:
            return await self._generate_with_failover(payload, session_id, weight)
        finally:
            for _ in range(held):
                self._slots.release()

    async def _generate_with_failover(
        self, payload: dict[str, Any], session_id: str | None, weight: int
    ) -> Any:
        if self.fault_tolerant:
            return await self._generate_until_served(payload, session_id, weight)
        tried: list[str] = []
        errors: list[str] = []
        while True:
            url = self._pick(session_id, exclude=tried)
            tried.append(url)
            try:
                return await self._generate_on(url, payload, weight)
            except EngineClientError as error:
                if not error.unreachable:
                    raise
                self._mark_down(url)
                errors.append(f"{url}: {error}")
                if len(tried) > self.max_failovers or len(tried) == len(self._urls):
                    raise EngineRouterError(
                        f"POST /generate failed on {len(tried)} engine(s) (max_failovers={self.max_failovers}): "
                        + "; ".join(errors)
                    ) from error

    async def _generate_until_served(
        self, payload: dict[str, Any], session_id: str | None, weight: int
    ) -> Any:
        """Fault tolerance: a request whose engine fails at the transport level (refused, reset, 502/503) is
        re-sent to a live engine, or waits for a replacement, until `request_timeout_s` has passed. Nothing of
        a failed attempt is kept (the caller appends only a complete response), and the request carries its
        own seed, so the answer is what a healthy engine would have given with the same weights."""
        deadline = time.monotonic() + self.request_timeout_s
        errors: list[str] = []
        while True:
            live = [url for url in self._urls if url not in self._dead]
            if not live:
                if time.monotonic() > deadline:
                    raise EngineRouterError(
                        f"POST /generate: no live engine for {self.request_timeout_s} s: "
                        + "; ".join(errors[-4:])
                    )
                await asyncio.sleep(0.2)  # a replacement is being started
                continue
            url = self._pick(session_id, exclude=[u for u in self._urls if u in self._dead])
            try:
                return await self._generate_on(url, payload, weight)
            except EngineClientError as error:
                if not error.engine_failed or time.monotonic() > deadline:
                    raise
                self._dead.add(url)
                self.num_retried += 1
                errors.append(f"{url}: {error}")

    def arm_fault(self, url: str, fire) -> None:
        """Fault injection (tests): call `fire()` once, shortly after the next request is sent to `url`."""
        self._fault = (url.rstrip("/"), fire)

    def _client(self, url: str) -> AsyncEngineClient:
        return AsyncEngineClient(url, timeout=self.request_timeout_s, keepalive_s=self.keepalive_s)

    def replace(self, old_url: str, new_url: str) -> None:
        """Fault tolerance: engine `old_url` was replaced by `new_url` (which serves the current weights)."""
        new_url = new_url.rstrip("/")
        index = self._urls.index(old_url.rstrip("/"))
        old = self._urls[index]
        self._urls[index] = new_url
        self._clients[new_url] = self._client(new_url)
        self._outstanding[new_url], self._served[new_url], self._down_until[new_url] = 0, 0, 0.0
        self._dead.discard(old)
        stale = self._clients.pop(old)
        for table in (self._outstanding, self._served, self._down_until):
            table.pop(old, None)
        for session, url in list(self._sessions.items()):
            if url == old:
                del self._sessions[session]
        self._stale_clients.append(stale)

    async def _generate_on(self, url: str, payload: dict[str, Any], weight: int = 1) -> Any:
        client = self._clients[url]
        self._outstanding[url] += weight
        if self._fault is not None and self._fault[0] == url:
            fire, self._fault = self._fault[1], None
            asyncio.get_running_loop().call_later(0.05, fire)  # once the request has reached the engine
        try:
            # The client's timeout bounds each network wait; wait_for bounds the whole call.
            result = await asyncio.wait_for(
                client.generate(**payload, timeout=self.request_timeout_s),
                self.request_timeout_s + 5.0,
            )
        except asyncio.TimeoutError:
            raise EngineClientError(
                f"POST {url}/generate did not finish within {self.request_timeout_s} s", route=url
            ) from None
        finally:
            if url in self._outstanding:  # the engine may have been replaced meanwhile
                self._outstanding[url] -= weight
        if url in self._served:
            self._served[url] += 1
        return result

    def _pick(self, session_id: str | None, exclude: list[str]) -> str:
        """The session's engine if it is up, else the least-loaded up engine (ties: round-robin)."""
        now = time.monotonic()
        candidates = [url for url in self._urls if url not in exclude]
        up = [url for url in candidates if self._down_until[url] <= now] or candidates
        if session_id is not None:
            bound = self._sessions.get(session_id)
            if bound in up:
                self._sessions.move_to_end(session_id)
                return bound
        count = len(self._urls)
        order = [self._urls[(self._next + i) % count] for i in range(count)]
        chosen = min((url for url in order if url in up), key=lambda url: self._outstanding[url])
        self._next = (self._urls.index(chosen) + 1) % count
        if session_id is not None:
            self._sessions[session_id] = chosen
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > _MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return chosen

    def _mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.down_cooldown_s

    # ------------------------------------------------------------------------------------------------
    # control and health

    async def abort_all(self) -> dict[str, int]:
        """POST /abort_request {"abort_all": true} to every engine; {url: requests aborted}.

        Every engine is tried; EngineRouterError names the ones that could not be reached.
        """
        calls = [
            self._bounded(
                self._clients[url].abort_request(abort_all=True, timeout=self.health_timeout_s),
                url,
                "/abort_request",
            )
            for url in self._urls
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = {url: r for url, r in zip(self._urls, results, strict=True) if isinstance(r, Exception)}
        if failed:
            raise EngineRouterError(
                "abort_all failed on " + "; ".join(f"{url}: {error}" for url, error in failed.items())
            )
        return {url: int(r.get("num_aborted", 0)) for url, r in zip(self._urls, results, strict=True)}

    async def check_health(self) -> dict[str, dict[str, Any]]:
        """GET /health_generate on every engine, each within `health_timeout_s`.

        Returns {url: {"ok": True, "status", "weight_version", "latency_s"}} when all are healthy; otherwise
        raises EngineHealthError naming the dead engines (its `statuses` has every engine's result).
        """
        results = await asyncio.gather(*(self._health_of(url) for url in self._urls))
        statuses = dict(zip(self._urls, results, strict=True))
        dead = {url: s["error"] for url, s in statuses.items() if not s["ok"]}
        if dead:
            raise EngineHealthError(
                f"{len(dead)} of {len(self._urls)} engine(s) failed the health check "
                f"(deadline {self.health_timeout_s} s): " + "; ".join(f"{u}: {e}" for u, e in dead.items()),
                statuses,
            )
        return statuses

    async def engine_stats(self) -> dict[str, dict[str, float]] | None:
        """Each live engine's cumulative step counters (/get_server_info's "engine_stats"), or None when an
        engine does not report them (an SGLang server) or does not answer within the health deadline."""
        urls = [url for url in self._urls if url not in self._dead]

        async def one(url: str) -> dict[str, float] | None:
            try:
                info = await self._bounded(self._clients[url].get_server_info(), url, "/get_server_info")
            except EngineClientError:
                return None
            stats = info.get("engine_stats") if isinstance(info, dict) else None
            return stats if isinstance(stats, dict) else None

        results = await asyncio.gather(*(one(url) for url in urls))
        if not urls or any(r is None for r in results):
            return None
        return dict(zip(urls, results, strict=True))

    async def _health_of(self, url: str) -> dict[str, Any]:
        started = time.monotonic()
        call = self._clients[url].health_generate(timeout=self.health_timeout_s)
        try:
            body = await self._bounded(call, url, "/health_generate")
        except EngineClientError as error:
            self._mark_down(url)
            return {"ok": False, "error": str(error), "latency_s": round(time.monotonic() - started, 3)}
        self._down_until[url] = 0.0
        return {
            "ok": True,
            "status": body.get("status", "ok"),
            "weight_version": body.get("weight_version"),
            "latency_s": round(time.monotonic() - started, 3),
        }

    async def _bounded(self, call: Any, url: str, route: str) -> Any:
        """Await `call` within health_timeout_s (a hard deadline on top of the HTTP client's timeouts)."""
        try:
            return await asyncio.wait_for(call, self.health_timeout_s)
        except asyncio.TimeoutError:
            raise EngineClientError(
                f"{url}{route} did not answer within {self.health_timeout_s} s", route=url
            ) from None

    async def aclose(self) -> None:
        """Close the HTTP clients (call from the loop that used the router)."""
        clients = [*self._clients.values(), *self._stale_clients]
        await asyncio.gather(*(client.aclose() for client in clients), return_exceptions=True)


def _num_prompts(payload: dict[str, Any]) -> int:
    """Prompts of a /generate body times samples per prompt (a batch gives lists of prompts)."""
    prompts = payload.get("input_ids") if payload.get("input_ids") is not None else payload.get("text")
    batch = (
        len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (list, str)) else 1
    )
    params = payload.get("sampling_params") or {}
    first = params[0] if isinstance(params, list) and params else params
    n = first.get("n", 1) if isinstance(first, dict) else 1
    return max(1, batch) * max(1, int(n) if isinstance(n, int) else 1)
