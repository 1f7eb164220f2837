"""Engine clients share one SSL context per process: httpx (and aiohttp) would build one per client, loading
the CA bundle each time (~20 ms), and the trainer opens a client per engine at every weight sync."""

from __future__ import annotations

import asyncio

import httpx

from clawrl.engine.http import client as client_module
from clawrl.engine.http.client import AsyncEngineClient, EngineClient


def test_every_client_and_session_uses_one_ssl_context(monkeypatch):
    built = []
    real = httpx.create_ssl_context

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "create_ssl_context", counting)
    client_module.shared_ssl_context.cache_clear()
    try:
        sync_clients = [EngineClient(f"http://127.0.0.1:{port}") for port in (1, 2, 3)]

        async def open_sessions():
            clients = [AsyncEngineClient(f"http://127.0.0.1:{port}") for port in (4, 5)]
            sessions = [c._session_for_loop() for c in clients]
            assert sessions[0] is not sessions[1]
            assert all(s.connector._ssl is client_module.shared_ssl_context() for s in sessions)
            for c in clients:
                await c.aclose()

        asyncio.run(open_sessions())
        assert len(built) == 1
        for c in sync_clients:
            c.close()
    finally:
        client_module.shared_ssl_context.cache_clear()
