"""A real engine server on 127.0.0.1 for the server tests: a tiny fp32 model on CPU behind uvicorn, in this
process or (frontend_process=True) behind the HTTP front-end process that GPU engines use by default."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.http.app import ServerThread, create_app
from clawrl.engine.http.frontend import FrontendServer


@contextlib.contextmanager
def cpu_server(
    model_path: str, *, step_timeout_s: float = 120, frontend_process: bool = False
) -> Iterator[ServerThread | FrontendServer]:
    """Serve `model_path` (fp32, CPU) until the block ends; yields the running server (`.url`, `.app`)."""
    engine = Engine(EngineConfig(model_path=str(model_path), device="cpu", dtype="float32"))
    async_engine = AsyncEngine(engine, step_timeout_s=step_timeout_s)
    app = create_app(async_engine)
    server = FrontendServer(ServerThread(app), async_engine) if frontend_process else ServerThread(app)
    with server as running:
        yield running
