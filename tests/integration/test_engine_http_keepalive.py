"""Idle keep-alive connections: the engine client drops them before any server closes them.

A client and a server with the same idle timeout (httpx's and uvicorn's default are both 5 s) race: a request
sent on a connection the server is closing at that moment fails with ReadError. A rollout that starts after a
train step of about that length hit it now and then. The clients now drop idle connections after
KEEPALIVE_EXPIRY_S (2 s, below uvicorn's and SGLang's 5 s), and the engine's own server keeps them 30 s, so a
rollout's clients of the run's own engines keep theirs OWN_ENGINE_KEEPALIVE_EXPIRY_S (20 s): the next rollout,
after a train step of a few seconds, finds them open instead of opening one per request.

    .venv/bin/pytest tests/integration/test_engine_http_keepalive.py -q
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request

from clawrl.engine.http.app import ServerThread
from clawrl.engine.http.client import (
    ENGINE_SERVER_KEEPALIVE_S,
    KEEPALIVE_EXPIRY_S,
    OWN_ENGINE_KEEPALIVE_EXPIRY_S,
    AsyncEngineClient,
    EngineClient,
)


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/peer")
    async def peer(request: Request) -> dict:
        return {"port": request.client.port}  # the client's side of the TCP connection

    return app


def test_idle_connections_are_dropped_before_a_5s_server_closes_them():
    assert KEEPALIVE_EXPIRY_S < 5.0
    with ServerThread(_app()) as server:
        assert server._server.config.timeout_keep_alive == 30
        client = EngineClient(server.url, timeout=10)
        first = client._call("GET", "/peer")["port"]
        assert client._call("GET", "/peer")["port"] == first  # back to back: the connection is reused
        time.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle past the client's expiry, before a 5 s server's
        assert client._call("GET", "/peer")["port"] != first  # a fresh connection, never a closing one

        async def pooled() -> tuple[int, int, int]:
            pool = AsyncEngineClient(server.url, timeout=10)
            try:
                a = (await pool._call("GET", "/peer"))["port"]
                b = (await pool._call("GET", "/peer"))["port"]
                await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
                return a, b, (await pool._call("GET", "/peer"))["port"]
            finally:
                await pool.aclose()

        a, b, c = asyncio.run(pooled())
        assert a == b and c != a


def test_clients_of_the_runs_own_engines_keep_their_connections_across_a_train_step():
    assert KEEPALIVE_EXPIRY_S + 1 < OWN_ENGINE_KEEPALIVE_EXPIRY_S <= ENGINE_SERVER_KEEPALIVE_S - 5
    with ServerThread(_app()) as server:

        async def pooled() -> tuple[int, int]:
            pool = AsyncEngineClient(server.url, timeout=10, keepalive_s=OWN_ENGINE_KEEPALIVE_EXPIRY_S)
            try:
                first = (await pool._call("GET", "/peer"))["port"]
                await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # a step longer than the 2 s expiry
                return first, (await pool._call("GET", "/peer"))["port"]
            finally:
                await pool.aclose()

        first, later = asyncio.run(pooled())
        assert later == first  # the same connection, still open on both sides
