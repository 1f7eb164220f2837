"""EngineActor: one built-in engine serving its HTTP API from inside a Ray actor.

The rollout side sees only the URL; control (release/resume memory, weight updates) also goes over HTTP,
exactly as it would to an external SGLang-compatible server.
"""

from __future__ import annotations

import os

import ray


@ray.remote
class EngineActor:
    """Builds Engine -> AsyncEngine -> FastAPI app -> uvicorn thread; `start()` returns the base URL."""

    def __init__(self, config: dict, *, num_threads: int | None = None, label: str = "engine",
                 multi_node: bool = False):  # fmt: skip
        import torch

        from clawrl.cluster.deadline import enable_stack_dumps

        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = config
        self.host = listen_host(multi_node=multi_node)
        self.server = None
        self.pid, self.node_ip = enable_stack_dumps(label)

    def where(self) -> tuple[int, str]:
        """(pid, node ip) of this actor's process, for stack dumps."""
        return self.pid, self.node_ip

    def inject_fault(self, mode: str) -> None:
        """Fault injection for tests: "kill" ends the process at once (a crash), "hang" freezes it (SIGSTOP:
        the server keeps its connections but answers nothing, as a deadlocked engine would). Never returns:
        the caller does not wait for it."""
        import signal

        if mode == "kill":
            os._exit(1)  # at once: requests in flight on this engine die with it
        elif mode == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise ValueError(f"inject_fault: mode must be 'kill' or 'hang', got {mode!r}")

    def start(self) -> str:
        from clawrl.engine.async_engine import AsyncEngine
        from clawrl.engine.config import EngineConfig
        from clawrl.engine.core.engine import Engine
        from clawrl.engine.http.app import ServerThread, create_app
        from clawrl.stall_points import stall_point

        stall_point("engine.start")
        config = EngineConfig(**self.config)
        if config.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(0)  # Ray exposes exactly the GPU of this actor's bundle as device 0
        self.server = ServerThread(create_app(AsyncEngine(Engine(config))), host=self.host).start()
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def listen_host(*, multi_node: bool) -> str:
    """Loopback when the whole job is on one machine; with --multi-node the node's IP, so the rollout manager
    and the trainer on other hosts reach the server."""
    return ray.util.get_node_ip_address() if multi_node else "127.0.0.1"
