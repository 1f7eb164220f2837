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

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx

from clawrl import fast_json

DEFAULT_TIMEOUT_S = 600.0
KEEPALIVE_EXPIRY_S = 2.0
"""Idle pooled connections are dropped after this, well before a server closes them (uvicorn's default, and
SGLang's, is 5 s; clawrl's engine keeps them 30 s): with equal timeouts a request sent on a connection the server
is closing fails with ReadError — what a rollout after a long train step hit now and then."""
ENGINE_SERVER_KEEPALIVE_S = 30
"""How long clawrl's engine server keeps an idle connection open (uvicorn's timeout_keep_alive)."""
OWN_ENGINE_KEEPALIVE_EXPIRY_S = 20.0
"""The idle expiry of a rollout's connections to the engines its run started (clawrl's server, 30 s): the
connections of one rollout are still open at the next after a train step of up to 20 s. With 2 s, a run whose
step is longer (the 1.5B loop's is ~3 s on one GPU) opened a connection per group request at the start of every
rollout: 32 at once cost ~28 ms before the first request reached the engine (bench/rollout_http_overhead.py
--connections cold vs warm, CPU)."""


class EngineClientError(RuntimeError):
    """A failed call: HTTP status (None for connection errors and timeouts) and the server's message.

    `failure` says how a call without an HTTP answer failed, the same for both clients (httpx, aiohttp):
    "connect" (refused: nothing was sent), "connect_timeout" (no connection within the timeout: nothing was
    sent), "dropped" (the connection broke while the call was in flight), "timeout" (no answer in time),
    "protocol" (a malformed answer); None when the server answered with an HTTP error."""

    def __init__(self, message: str, *, status_code: int | None = None, route: str = "",
                 failure: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status_code = status_code
        self.route = route
        self.message = message
        self.failure = failure

    @property
    def unreachable(self) -> bool:
        """The call certainly did not run on that engine (another may take it)."""
        return self.failure in ("connect", "connect_timeout") or self.status_code == 503

    @property
    def engine_failed(self) -> bool:
        """The engine, not the request, failed: it refused or dropped the connection, or answered 502/503.
        A timeout is not one: the engine may be slow, and the health monitor judges that."""
        return self.failure in ("connect", "dropped") or self.status_code in (502, 503)


@functools.cache
def shared_ssl_context() -> Any:
    """One SSL context for every client of this process. httpx builds one per client otherwise, loading the
    CA bundle each time (~20 ms): a weight sync opens a client per engine, and did so at every sync."""
    return httpx.create_ssl_context()


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if value is not None}


def _server_message(content: bytes, reason: str) -> str:
    try:
        data = json.loads(content)
    except ValueError:
        return content.decode(errors="replace").strip() or reason
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return json.dumps(data)


def _status_error(route: str, status: int, reason: str, content: bytes) -> EngineClientError:
    message = _server_message(content, reason)
    return EngineClientError(f"{route} -> HTTP {status}: {message}", status_code=status, route=route)


def _http_error(route: str, response: httpx.Response) -> EngineClientError:
    return _status_error(route, response.status_code, response.reason_phrase, response.content)


def _failure_error(route: str, error: BaseException, failure: str, timeout: float) -> EngineClientError:
    if failure in ("timeout", "connect_timeout"):
        message = f"{route} timed out after {timeout} s ({type(error).__name__})"
    else:
        message = f"{route} failed: {type(error).__name__}: {error}"
    return EngineClientError(message, route=route, failure=failure)


def _transport_error(route: str, error: httpx.HTTPError, timeout: float) -> EngineClientError:
    """httpx's exceptions, by EngineClientError.failure."""
    if isinstance(error, httpx.ConnectTimeout):
        failure = "connect_timeout"
    elif isinstance(error, httpx.TimeoutException):
        failure = "timeout"
    elif isinstance(error, httpx.ConnectError):
        failure = "connect"
    elif isinstance(error, httpx.TransportError):
        failure = "dropped"
    else:
        failure = "protocol"
    return _failure_error(route, error, failure, timeout)


def _aiohttp_error(route: str, error: BaseException, timeout: float) -> EngineClientError:
    """aiohttp's exceptions (and asyncio's timeout), by EngineClientError.failure."""
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        failure = "connect_timeout"
    elif isinstance(error, aiohttp.ClientConnectorError):
        failure = "connect"
    elif isinstance(error, TimeoutError):  # asyncio's total timeout, aiohttp's socket read timeout
        failure = "timeout"
    elif isinstance(error, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
        failure = "dropped"
    else:
        failure = "protocol"
    return _failure_error(route, error, failure, timeout)


_JSON_HEADERS = {"Content-Type": "application/json"}


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
    """asyncio client (aiohttp): every method is awaited; streams are then async-iterated.

    One aiohttp session per event loop, opened at the first call, with no limit on connections: any number
    of calls run at once (the caller bounds the concurrency: EngineRouter's max_concurrent_requests), so a
    rollout's 256 requests all reach the engine together. aiohttp rather than httpx because a rollout's
    client is on its critical path twice, sending every request at the start and parsing every answer at the
    end: for 256 /generate calls at once of 128 prompt and 256 answer tokens, httpx's AsyncClient (in
    pools of 16 connections) spent 2.07 ms of CPU a call, this client 0.36 ms (bench/http_client_overhead.py
    on the 2-core workstation; docs/benchmarks.md).
    """

    def __init__(
        self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, *, keepalive_s: float = KEEPALIVE_EXPIRY_S
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.keepalive_s = keepalive_s
        """Idle pooled connections are closed after this (below the server's own idle timeout)."""
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _session_for_loop(self) -> aiohttp.ClientSession:
        """The session of the running loop; a new one if the loop changed (the old one is then dropped:
        it cannot be closed from another loop, and its loop's end closed its sockets)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s,
                                             ssl=shared_ssl_context())  # fmt: skip
            self._session = aiohttp.ClientSession(connector=connector)
            self._session_loop = loop
        return self._session

    async def _call(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
                    timeout: float | None = None) -> Any:  # fmt: skip
        timeout = self.timeout if timeout is None else timeout
        route = f"{method} {self.base_url}{path}"
        session = self._session_for_loop()
        # A stream's timeout bounds each chunk's wait; a plain call's, the whole call.
        limits = (aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout) if stream
                  else aiohttp.ClientTimeout(total=timeout))  # fmt: skip
        data, headers = (None, None) if body is None else (fast_json.dumps(body), _JSON_HEADERS)
        response = None
        try:
            response = await session.request(method, self.base_url + path, data=data, headers=headers,
                                             timeout=limits)  # fmt: skip
            if response.status >= 400:
                content = await response.read()
                raise _status_error(route, response.status, response.reason or "", content)
            if stream:
                events, response = self._events(route, response, timeout), None  # the stream releases it
                return events
            return fast_json.loads(await response.read())
        except (aiohttp.ClientError, TimeoutError) as error:
            raise _aiohttp_error(route, error, timeout) from error
        finally:
            if response is not None:
                response.release()

    async def _events(
        self, route: str, response: aiohttp.ClientResponse, timeout: float
    ) -> AsyncIterator[Any]:
        pending = b""
        try:
            async for chunk in response.content.iter_any():  # lines of any length (readline caps them)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    payload = _sse_payload(route, line.decode().rstrip("\r"))
                    if payload is _DONE:
                        return
                    if payload is not None:
                        yield payload
        except (aiohttp.ClientError, TimeoutError) as error:
            raise _aiohttp_error(route, error, timeout) from error
        finally:
            response.release()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            loop = self._session_loop
            if loop is asyncio.get_running_loop():
                await session.close()
            elif loop is not None and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(session.close(), loop)
            else:  # its loop has ended, and with it the connections' sockets
                session.detach()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
