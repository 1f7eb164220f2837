"""How the engine clients fail, for real (servers on 127.0.0.1): both clients (EngineClient on httpx,
AsyncEngineClient on aiohttp) report a refused connection, a dropped one, a timeout and an HTTP error with
the same EngineClientError fields, which the router's failover reads (`unreachable`: the request did not run
there, another engine may take it; `engine_failed`: the engine, not the request, failed). Also: an SSE event
longer than aiohttp's line limit, a stream that stalls past its per-chunk timeout, and one async client
used from two event loops one after the other (closed on each).

    .venv/bin/pytest tests/integration/test_engine_client_failures.py -q
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from clawrl.engine.http.app import ServerThread
from clawrl.engine.http.client import AsyncEngineClient, EngineClient, EngineClientError

BIG = "x" * 200_000  # one SSE line of ~200 KB: over aiohttp's readline limit (128 KB)


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(3)
        return {"late": True}

    @app.get("/busy")
    async def busy() -> JSONResponse:
        return JSONResponse({"error": {"message": "engine is restarting"}}, status_code=503)

    @app.get("/gateway")
    async def gateway() -> PlainTextResponse:
        return PlainTextResponse("bad gateway from the proxy", status_code=502)

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"got": body}

    @app.post("/generate")
    async def generate(body: dict) -> StreamingResponse:
        async def events():
            yield f'data: {{"text": "{BIG}"}}\n\n'
            yield 'data: {"text": "second"}\n\n'
            if body.get("stall"):
                await asyncio.sleep(3)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    with ServerThread(_app()) as running:
        yield running


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Dropper:
    """A TCP server that reads a request and closes the connection without answering."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _sync_error(url: str, path: str, timeout: float = 5.0) -> EngineClientError:
    with EngineClient(url, timeout=timeout) as client, pytest.raises(EngineClientError) as info:
        client._call("GET", path)
    return info.value


def _async_error(url: str, path: str, timeout: float = 5.0) -> EngineClientError:
    async def call() -> None:
        async with AsyncEngineClient(url, timeout=timeout) as client:
            await client._call("GET", path)

    with pytest.raises(EngineClientError) as info:
        asyncio.run(call())
    return info.value


@pytest.mark.parametrize("call", [_sync_error, _async_error], ids=["httpx", "aiohttp"])
def test_failures_carry_the_same_fields_in_both_clients(server, call):
    refused_url = f"http://127.0.0.1:{_free_port()}"
    refused = call(refused_url, "/health")
    assert refused.failure == "connect" and refused.status_code is None
    assert refused.unreachable and refused.engine_failed
    assert refused.message.startswith(f"GET {refused_url}/health failed: ")

    dropper = _Dropper()
    try:
        dropped = call(dropper.url, "/health")
    finally:
        dropper.close()
    assert dropped.failure == "dropped" and not dropped.unreachable and dropped.engine_failed

    late = call(server.url, "/slow", timeout=0.5)
    assert late.failure == "timeout" and not late.unreachable and not late.engine_failed
    assert late.message.startswith(f"GET {server.url}/slow timed out after 0.5 s")

    busy = call(server.url, "/busy")
    assert busy.failure is None and busy.status_code == 503 and busy.unreachable and busy.engine_failed
    assert busy.message == f"GET {server.url}/busy -> HTTP 503: engine is restarting"

    gateway = call(server.url, "/gateway")
    assert gateway.status_code == 502 and gateway.engine_failed and not gateway.unreachable
    assert gateway.message.endswith("HTTP 502: bad gateway from the proxy")


def test_async_streams_take_long_events_and_time_out_per_chunk(server):
    async def scenario() -> tuple[list, EngineClientError]:
        async with AsyncEngineClient(server.url, timeout=1.0) as client:
            events = [event async for event in await client.generate(input_ids=[1], stream=True)]
            stalled = await client.generate(input_ids=[1], stream=True, stall=True)
            seen = []
            with pytest.raises(EngineClientError) as info:
                async for event in stalled:
                    seen.append(event["text"])
            assert seen == [BIG, "second"]  # everything before the stall arrived
            return events, info.value

    events, stalled = asyncio.run(scenario())
    assert [e["text"] for e in events] == [BIG, "second"]
    assert stalled.failure == "timeout"


def test_one_async_client_serves_two_event_loops_in_turn(server):
    client = AsyncEngineClient(server.url, timeout=10)

    async def echo(value: int) -> tuple[dict, object]:
        try:
            return await client._call("POST", "/echo", {"value": value}), client._session
        finally:
            await client.aclose()  # on the loop that used it: its connections close cleanly

    first, first_session = asyncio.run(echo(1))
    second, second_session = asyncio.run(echo(2))
    assert first == {"got": {"value": 1}} and second == {"got": {"value": 2}}
    assert first_session is not second_session and first_session.closed and second_session.closed
