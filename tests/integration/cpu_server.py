"""A real engine server on 127.0.0.1 for the server tests: a tiny fp32 model on CPU behind uvicorn."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.http.app import ServerThread, create_app


@contextlib.contextmanager
def cpu_server(model_path: str, *, step_timeout_s: float = 120) -> Iterator[ServerThread]:
    """Serve `model_path` (fp32, CPU) until the block ends; yields the running server (`.url`, `.app`)."""
    engine = Engine(EngineConfig(model_path=str(model_path), device="cpu", dtype="float32"))
    with ServerThread(create_app(AsyncEngine(engine, step_timeout_s=step_timeout_s))) as running:
        yield running
