"""Python clients of the engine's HTTP API: `EngineClient` (sync) and `AsyncEngineClient` (asyncio).

One method per route, named like the route (`generate` -> POST /generate, `chat_completions` -> POST
/v1/chat/completions, `get_weight_version` -> GET /get_weight_version, ...). Every call has a timeout
(the client's, or `timeout=` per call; for streams it bounds the wait for each chunk). Any HTTP error
raises EngineClientError carrying the server's message; so do connection failures and timeouts.
Methods return the parsed JSON; with `stream=True`, `generate`, `chat_completions` and `completions`
return an iterator (async iterator) of the parsed `data:` chunks, ending before `[DONE]`.

    client = EngineClient("http://127.0.0.1:30000", timeout=60)
    out = client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8}, return_logprob=True)
    for chunk in client.chat_completions([{"role": "user", "content": "hi"}], stream=True):
        ...

    async with AsyncEngineClient(url) as client:
        out = await client.generate(text="hi")
        async for chunk in await client.generate(text="hi", stream=True):
            ...
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from clawrl import fast_json

DEFAULT_TIMEOUT_S = 600.0
KEEPALIVE_EXPIRY_S = 2.0
"""Idle pooled connections are dropped after this, well before a server closes them (uvicorn's default, and
SGLang's, is 5 s; clawrl's engine keeps them 30 s): with equal timeouts a request sent on a connection the server
is closing fails with ReadError — what a rollout after a long train step hit now and then."""


class EngineClientError(RuntimeError):
    """A failed call: HTTP status (None for connection errors and timeouts) and the server's message."""

    def __init__(self, message: str, *, status_code: int | None = None, route: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.route = route
        self.message = message


@functools.cache
def shared_ssl_context() -> Any:
    """One SSL context for every client of this process. httpx builds one per client otherwise, loading the
    CA bundle each time (~20 ms): a weight sync opens a client per engine, and did so at every sync."""
    return httpx.create_ssl_context()


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if value is not None}


def _server_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return json.dumps(data)


def _http_error(route: str, response: httpx.Response) -> EngineClientError:
    message = _server_message(response)
    return EngineClientError(f"{route} -> HTTP {response.status_code}: {message}",
                             status_code=response.status_code, route=route)  # fmt: skip


def _transport_error(route: str, error: httpx.HTTPError, timeout: float) -> EngineClientError:
    if isinstance(error, httpx.TimeoutException):
        return EngineClientError(f"{route} timed out after {timeout} s ({type(error).__name__})", route=route)
    return EngineClientError(f"{route} failed: {type(error).__name__}: {error}", route=route)


def _sse_payload(route: str, line: str) -> Any:
    """Parsed JSON of one `data:` line; None for other lines; StopIteration sentinel for [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return _DONE
    payload = fast_json.loads(data)
    if isinstance(payload, dict) and set(payload) == {"error"}:
        error = payload["error"]
        raise EngineClientError(f"{route} -> stream error: {error.get('message')}",
                                status_code=error.get("code"), route=route)  # fmt: skip
    return payload


_DONE = object()


class _Routes:
    """The routes, shared by both clients; `_call` is sync in one and async in the other."""

    def _call(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
              timeout: float | None = None) -> Any:  # fmt: skip
        raise NotImplementedError

    # --- generation ---

    def generate(self, text: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | None = None, *, return_logprob: bool = False, stream: bool = False,
                 rid: str | list[str] | None = None, timeout: float | None = None, **extra: Any) -> Any:  # fmt: skip
        """POST /generate (SGLang): one item, or a list for a batch or n > 1."""
        body = _drop_none({"text": text, "input_ids": input_ids, "sampling_params": sampling_params,
                           "return_logprob": return_logprob or None, "stream": stream or None, "rid": rid})  # fmt: skip
        return self._call("POST", "/generate", {**body, **extra}, stream=stream, timeout=timeout)

    def chat_completions(self, messages: list[dict], *, model: str = "default", stream: bool = False,
                         timeout: float | None = None, **fields: Any) -> Any:  # fmt: skip
        """POST /v1/chat/completions; `fields` are OpenAI's (max_tokens, temperature, tools, logprobs, n...)."""
        body = {"model": model, "messages": messages, "stream": stream, **fields}
        return self._call("POST", "/v1/chat/completions", body, stream=stream, timeout=timeout)

    def completions(self, prompt: Any, *, model: str = "default", stream: bool = False,
                    timeout: float | None = None, **fields: Any) -> Any:  # fmt: skip
        """POST /v1/completions."""
        body = {"model": model, "prompt": prompt, "stream": stream, **fields}
        return self._call("POST", "/v1/completions", body, stream=stream, timeout=timeout)

    def models(self, *, timeout: float | None = None) -> Any:
        """GET /v1/models."""
        return self._call("GET", "/v1/models", timeout=timeout)

    # --- health and info ---

    def health(self, *, timeout: float | None = None) -> Any:
        """GET /health: raises EngineClientError (503) when the engine cannot serve."""
        return self._call("GET", "/health", timeout=timeout)

    def health_generate(self, *, timeout: float | None = None) -> Any:
        """GET /health_generate: generates one token."""
        return self._call("GET", "/health_generate", timeout=timeout)

    def get_model_info(self, *, timeout: float | None = None) -> Any:
        return self._call("GET", "/get_model_info", timeout=timeout)

    def get_server_info(self, *, timeout: float | None = None) -> Any:
        """GET /get_server_info: SGLang's server info (model_path, dtype, context_length, version, ...)."""
        return self._call("GET", "/get_server_info", timeout=timeout)

    def get_weight_version(self, *, timeout: float | None = None) -> Any:
        """GET /get_weight_version -> {"weight_version": str}."""
        return self._call("GET", "/get_weight_version", timeout=timeout)

    # --- control ---

    def flush_cache(self, *, timeout: float | None = None) -> Any:
        return self._call("POST", "/flush_cache", {}, timeout=timeout)

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                 abort_all_requests: bool = False, timeout: float | None = None) -> Any:  # fmt: skip
        """POST /update_weights_from_disk -> {"success", "message", "weight_version"}."""
        body = _drop_none({"model_path": model_path, "weight_version": weight_version,
                           "abort_all_requests": abort_all_requests})  # fmt: skip
        return self._call("POST", "/update_weights_from_disk", body, timeout=timeout)

    def release_memory_occupation(
        self, tags: list[str] | None = None, *, timeout: float | None = None
    ) -> Any:
        return self._call("POST", "/release_memory_occupation", _drop_none({"tags": tags}), timeout=timeout)

    def resume_memory_occupation(self, tags: list[str] | None = None, *, timeout: float | None = None) -> Any:
        return self._call("POST", "/resume_memory_occupation", _drop_none({"tags": tags}), timeout=timeout)

    def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> Any:
        """POST /pause_generation: mode "abort" (SGLang's default), "in_place" or "retract"."""
        return self._call("POST", "/pause_generation", {"mode": mode}, timeout=timeout)

    def continue_generation(self, *, timeout: float | None = None) -> Any:
        return self._call("POST", "/continue_generation", {}, timeout=timeout)

    def abort_request(
        self, rid: str | None = None, *, abort_all: bool = False, timeout: float | None = None
    ) -> Any:
        """POST /abort_request: one request by rid, or every request with abort_all=True."""
        return self._call(
            "POST", "/abort_request", _drop_none({"rid": rid, "abort_all": abort_all}), timeout=timeout
        )

    # --- weight sync (clawrl/weight_sync/; wire formats in colocated.py and broadcast.py) ---

    def update_weights_from_tensor(self, *, transport: str, names: list[str], dtypes: list[str],
                                   shapes: list[list[int]], handles: list[dict], finish: bool = False,
                                   weight_version: str | None = None, timeout: float | None = None) -> Any:  # fmt: skip
        """POST /update_weights_from_tensor: load a bucket passed by shared-memory / CUDA IPC handles;
        finish=True ends the sync (version flip, prefix-cache flush, generation continues)."""
        body = {"transport": transport, "names": names, "dtypes": dtypes, "shapes": shapes, "handles": handles,
                "finish": finish, "weight_version": weight_version}  # fmt: skip
        return self._call("POST", "/update_weights_from_tensor", body, timeout=timeout)

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str = "gloo",
                                  timeout_s: float = 120.0, timeout: float | None = None) -> Any:  # fmt: skip
        """POST /init_weights_update_group: join the trainer's broadcast group (returns once formed)."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s}  # fmt: skip
        return self._call("POST", "/init_weights_update_group", body, timeout=timeout)

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, finish: bool = False, weight_version: str | None = None,
                                        load_format: str | None = "flattened_bucket",
                                        timeout: float | None = None) -> Any:  # fmt: skip
        """POST /update_weights_from_distributed: receive a bucket broadcast by rank 0 and load it. The
        default layout is clawrl's (one flat tensor per dtype group); load_format None is SGLang's (one
        broadcast per tensor)."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "finish": finish,
                "weight_version": weight_version, "load_format": load_format}  # fmt: skip
        return self._call("POST", "/update_weights_from_distributed", body, timeout=timeout)

    def destroy_weights_update_group(self, *, group_name: str, timeout: float | None = None) -> Any:
        """POST /destroy_weights_update_group: leave a broadcast group."""
        return self._call(
            "POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout
        )

    def weights_checksum(self, *, timeout: float | None = None) -> Any:
        """GET /weights_checksum -> {"weight_version": str, "checksums": {HF name: sha256}}."""
        return self._call("GET", "/weights_checksum", timeout=timeout)


class EngineClient(_Routes):
    """Synchronous client (httpx); usable as a context manager."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, verify=shared_ssl_context(),
                                    limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))  # fmt: skip

    def _call(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
              timeout: float | None = None) -> Any:  # fmt: skip
        timeout = self.timeout if timeout is None else timeout
        route = f"{method} {self.base_url}{path}"
        try:
            if stream:
                request = self._client.build_request(method, path, json=body, timeout=timeout)
                response = self._client.send(request, stream=True)
                if response.is_error:
                    response.read()
                    response.close()
                    raise _http_error(route, response)
                return self._events(route, response, timeout)
            response = self._client.request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as error:
            raise _transport_error(route, error, timeout) from error
        if response.is_error:
            raise _http_error(route, response)
        return fast_json.loads(response.content)

    @staticmethod
    def _events(route: str, response: httpx.Response, timeout: float) -> Iterator[Any]:
        try:
            for line in response.iter_lines():
                payload = _sse_payload(route, line)
                if payload is _DONE:
                    return
                if payload is not None:
                    yield payload
        except httpx.HTTPError as error:
            raise _transport_error(route, error, timeout) from error
        finally:
            response.close()

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncEngineClient(_Routes):
    """asyncio client (httpx.AsyncClient): every method is awaited; streams are then async-iterated.

    Concurrent calls are spread over several connection pools (httpx.AsyncClient), each carrying at most
    `connections_per_pool` calls at a time; more pools open as needed, so any number of calls run at once
    (the caller bounds the concurrency: EngineRouter's max_concurrent_requests). One pool would not do:
    httpx's default limit of 100 connections would hold a rollout's 256 requests back in the client (the
    engine would batch only 100 of them), and without the limit httpcore's pool does work quadratic in its
    connections at every request start and end (~10 ms of CPU per engine step at 256 requests:
    bench/rollout_http_overhead.py).
    """

    def __init__(
        self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, *, connections_per_pool: int = 16
    ) -> None:
        if connections_per_pool < 1:
            raise ValueError(f"connections_per_pool must be >= 1, got {connections_per_pool}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connections_per_pool = connections_per_pool
        self._pools: list[httpx.AsyncClient] = []
        self._in_use: list[int] = []  # calls in flight per pool

    @property
    def num_pools(self) -> int:
        """Connection pools opened so far (the most calls ever in flight at once / connections_per_pool)."""
        return len(self._pools)

    def _acquire(self) -> int:
        """The pool for a new call: the least busy one, or a new one when all are full."""
        in_use = self._in_use
        index = min(range(len(in_use)), key=in_use.__getitem__, default=-1)
        if index < 0 or in_use[index] >= self.connections_per_pool:
            # No connection limit of its own: the accounting here only spreads the load.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.connections_per_pool,
                                  keepalive_expiry=KEEPALIVE_EXPIRY_S)  # fmt: skip
            pool = httpx.AsyncClient(
                base_url=self.base_url, timeout=self.timeout, limits=limits, verify=shared_ssl_context()
            )
            self._pools.append(pool)
            in_use.append(0)
            index = len(in_use) - 1
        in_use[index] += 1
        return index

    def _release(self, index: int) -> None:
        self._in_use[index] -= 1

    async def _call(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
                    timeout: float | None = None) -> Any:  # fmt: skip
        timeout = self.timeout if timeout is None else timeout
        route = f"{method} {self.base_url}{path}"
        index = self._acquire()
        client, streaming = self._pools[index], False
        try:
            if stream:
                request = client.build_request(method, path, json=body, timeout=timeout)
                response = await client.send(request, stream=True)
                if response.is_error:
                    await response.aread()
                    await response.aclose()
                    raise _http_error(route, response)
                streaming = True  # the stream releases the pool when it ends
                return self._events(route, response, timeout, index)
            response = await client.request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as error:
            raise _transport_error(route, error, timeout) from error
        finally:
            if not streaming:
                self._release(index)
        if response.is_error:
            raise _http_error(route, response)
        return fast_json.loads(response.content)

    async def _events(
        self, route: str, response: httpx.Response, timeout: float, index: int
    ) -> AsyncIterator[Any]:
        try:
            async for line in response.aiter_lines():
                payload = _sse_payload(route, line)
                if payload is _DONE:
                    return
                if payload is not None:
                    yield payload
        except httpx.HTTPError as error:
            raise _transport_error(route, error, timeout) from error
        finally:
            self._release(index)
            await response.aclose()

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
