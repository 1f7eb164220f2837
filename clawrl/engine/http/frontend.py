"""The engine's HTTP front-end process: it serves a rollout's `POST /generate` so the engine's process does not.

Why: on a GPU the engine thread's host work per decode step (scheduling, launching, stop rules) must fit in
the GPU's step, and it needs the GIL for all of it. In one process, the HTTP event loop that parses a
rollout's requests, decodes their text and writes their answers holds that same GIL: measured on the H100,
`Engine.step` took 0.6-1.0 ms longer per step with HTTP traffic than without (bench/rollout_http_overhead.py),
and the rollout ran at 1.4x the engine alone. So, as SGLang splits its tokenizer manager from its scheduler,
the public port belongs to a front-end process that serves non-streaming `POST /generate`
itself (parsing, validation, detokenisation, the JSON answer) and passes every other request through to the
engine's own server, which listens on 127.0.0.1 only. Between the two, one socket pair carries pickled
messages; the engine process handles them without its event loop:

    engine -> front end   ("serve", url, vocab size, context length)   once the engine is up (the process
                                                                       may be launched while it loads)
    front end -> engine   ("ready",)                                   once, when it listens
                          ("add", rid, prompt_ids, SamplingParams)     read by the engine's _Bridge thread
                          ("abort", rid)                               (a client that left)
    engine -> front end   ("stop",)                                    it answers its requests 503, exits
                          ("done", rid, weight version at add, Collected)  from the engine thread, per step
                          ("error", rid, status, message)              a refused add (400) or admission
                          ("fatal", message)                           the engine died: every request 503

A front end that loses the engine's process (crash, kill) sees the socket close and exits at once, so
clients see the engine go away exactly as they did with one process.

Two halves, one module:
- engine process: `FrontendServer` (ServerThread's interface: start / stop / url / port / app) starts the
  process and `_Bridge` joins it to the AsyncEngine;
- front-end process (`main`): `RemoteEngine` stands in for the AsyncEngine that generate.py's handler drives
  (same checks, same `generate_full`, same results: the engine sends each request's Collected outputs and
  the text is decoded here, with the same tokenizer); `FrontendApp` is the ASGI app: a non-streaming
  `/generate` through generate.py's own parsing and answer building, anything else (streams, OpenAI
  routes, health, control, weight sync) to the engine's server, request and answer passed through as they
  are. This module does not import torch: the process starts in seconds, the tokenizer most of it.

    server = FrontendServer.launch(model_path, host, port)    # while the engine loads
    server.start(ServerThread(create_app(async_engine)), async_engine)
    ...
    server.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fastapi import Request

from clawrl.engine.async_engine import AsyncEngine, EngineUnavailableError, check_new_request
from clawrl.engine.core.request import (
    Collected,
    GenerationResult,
    RequestError,
    SamplingParams,
    collect_results,
)
from clawrl.engine.http import generate

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# the engine process's side


class FrontendServer:
    """The engine's app, served on 127.0.0.1 by `inner` (app.py's ServerThread, not started), behind a
    front-end process on host:port.

    `FrontendServer(inner, async_engine).start()` does it all; `FrontendServer.launch(model_path)` starts the
    process (imports, tokenizer: seconds) first, while the engine loads, and `.start(inner, async_engine)`
    then only connects the two."""

    def __init__(self, inner: Any = None, async_engine: AsyncEngine | None = None, host: str = "127.0.0.1",
                 port: int = 0, *, start_timeout_s: float = 120.0, log_level: str = "warning") -> None:  # fmt: skip
        self.host, self.port = host, port
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self.process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._bridge: _Bridge | None = None
        self.inner = inner
        self.async_engine = async_engine

    @classmethod
    def launch(cls, model_path: str, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> FrontendServer:
        """Start the front-end process now; it serves once `start(inner, async_engine)` is called."""
        server = cls(None, None, host, port, **kwargs)
        server._spawn(model_path)
        return server

    @property
    def app(self) -> Any:
        """The engine's app (served by the inner server)."""
        return self.inner.app

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self, model_path: str) -> None:
        try:
            listener = socket.create_server((self.host, self.port), backlog=2048)
        except OSError as error:
            raise ValueError(f"cannot listen on {self.host}:{self.port}: {error.strerror}") from None
        self.port = listener.getsockname()[1]
        mine, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                _frontend_command(model_path, theirs.fileno(), listener.fileno(), self.log_level),
                pass_fds=(theirs.fileno(), listener.fileno()), env=_child_env(),
            )  # fmt: skip
        finally:
            theirs.close()
            listener.close()  # the front end holds the listening socket now
        self._conn = Connection(mine.detach())

    def start(self, inner: Any = None, async_engine: AsyncEngine | None = None) -> FrontendServer:
        if inner is not None:
            self.inner, self.async_engine = inner, async_engine
        if self.process is None:
            self._spawn(self.async_engine.model_path)
        try:
            self.inner.start()  # the engine thread starts with the app's lifespan
        except BaseException:
            self.stop()
            raise
        engine = self.async_engine
        with contextlib.suppress(OSError):  # the process died: _wait_ready says so
            self._conn.send(("serve", self.inner.url, engine.vocab_size, engine.context_len))
        self._wait_ready(self._conn)
        self._bridge = _Bridge(self.async_engine, self._conn)
        self._bridge.start()
        return self

    def _wait_ready(self, conn: Connection) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not conn.poll(0.1):
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise RuntimeError(f"the engine's HTTP front-end process exited with code {code} at start-up "
                                   "(its error is in this process's log above)")  # fmt: skip
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"the engine's HTTP front end did not start within {self.start_timeout_s} s"
                )
        message = conn.recv()
        assert message == ("ready",), f"front end's first message: {message!r}"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the front end (it finishes its answers in flight first), then the engine's server."""
        if self._bridge is not None:
            self._bridge.send(("stop",))
        elif self._conn is not None:  # launched, never started: it waits for its "serve"
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
        if self.process is not None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("the HTTP front end did not stop within %.0f s; killed", timeout_s)
                self.process.kill()
                self.process.wait()
        if self._bridge is not None:
            self._bridge.close()
        elif self._conn is not None:
            self._conn.close()
        if self.inner is not None:
            self.inner.stop(timeout_s)

    def __enter__(self) -> FrontendServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _frontend_command(model_path: str, conn_fd: int, listen_fd: int, log_level: str) -> list[str]:
    return [
        sys.executable, "-m", "clawrl.engine.http.frontend", "--conn-fd", str(conn_fd),
        "--listen-fd", str(listen_fd), "--model-path", model_path, "--log-level", log_level,
    ]  # fmt: skip


def _child_env() -> dict[str, str]:
    """This environment, with clawrl's own directory first on PYTHONPATH (a Ray worker may have found the
    package through a path its children do not inherit)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class _Bridge:
    """The engine side of the socket pair: a thread reads the front end's messages and submits them as
    commands; results are sent from the engine thread (AsyncEngine._post) with no event loop in between."""

    def __init__(self, async_engine: AsyncEngine, conn: Connection) -> None:
        self.engine = async_engine
        self.conn = conn
        self._send_lock = threading.Lock()
        self._versions: dict[str, str] = {}  # rid -> weight version when it was added
        self._thread = threading.Thread(target=self._read, name="clawrl-frontend-bridge", daemon=True)
        self._closed = False

    def start(self) -> None:
        self.engine._remote_post = self._post
        self.engine._remote_fail = self._fail
        self._thread.start()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            if self._closed:
                return
            try:
                self.conn.send(message)
            except OSError:  # the front end is gone; its clients saw the connection close
                self._closed = True

    def close(self) -> None:
        """Shut the socket down (the reader thread here and the front end both see it end), then close it."""
        with self._send_lock:
            self._closed = True
            with contextlib.suppress(OSError):
                socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM).shutdown(
                    socket.SHUT_RDWR
                )
            self.conn.close()
        self.engine._remote_post = self.engine._remote_fail = None

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "add":
                self._add(*message[1:])
            elif kind == "abort":
                self.engine._submit("abort", rid=message[1])
        # The front end exited: its requests have no one to answer any more.
        for rid in list(self.engine._remote_rids):
            self.engine._remote_rids.discard(rid)
            self.engine._submit("abort", rid=rid)

    def _add(self, rid: str, prompt_ids: list[int], params: Any) -> None:
        engine = self.engine
        if engine._fatal is not None or engine._stopping:
            self.send(("error", rid, 503, str(engine._fatal or "the engine is shutting down")))
            return
        self._versions[rid] = engine.weight_version
        engine._remote_rids.add(rid)
        future = engine._submit("add", rid=rid, prompt_ids=prompt_ids, params=params, collect=True)
        future.add_done_callback(lambda done: self._added(rid, done))

    def _added(self, rid: str, future: Any) -> None:
        error = future.exception()
        if error is not None:
            self._forget(rid)
            self.send(("error", rid, getattr(error, "status_code", 500), str(error)))

    def _forget(self, rid: str) -> None:
        self.engine._remote_rids.discard(rid)
        self._versions.pop(rid, None)

    def _post(self, events: list[tuple[str, Any]]) -> None:
        """Engine thread: each front-end request's one final event."""
        for rid, event in events:
            version = self._versions.get(rid, "")
            self._forget(rid)
            if isinstance(event, Collected):
                self.send(("done", rid, version, event))
            else:
                status = getattr(event, "status_code", 500)
                self.send(("error", rid, status, str(event)))

    def _fail(self, error: BaseException) -> None:
        self.engine._remote_rids.clear()
        self.send(("fatal", str(error)))


# ---------------------------------------------------------------------------------------------------
# the front-end process's side


# Not passed on by a proxy: they describe one connection, not the message.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host",
})  # fmt: skip


class RemoteEngine:
    """What generate.py's handler needs of an AsyncEngine, served by the engine process over `conn`."""

    def __init__(self, conn: Connection, *, tokenizer: Any, model_path: str, vocab_size: int,
                 context_len: int) -> None:  # fmt: skip
        self.conn = conn
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.context_len = context_len
        self._waiting: dict[str, asyncio.Future] = {}
        self._fatal: str | None = None
        self.stopping = False

    def check_alive(self) -> None:
        if self._fatal is not None:
            raise EngineUnavailableError(self._fatal)
        if self.stopping:
            raise EngineUnavailableError("the engine is shutting down")

    async def generate_full(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationResult]:
        """AsyncEngine.generate_full, over the socket: one result per sample, ordered by index."""
        rid = check_new_request(self, prompt_ids, params, request_id, in_flight=self._waiting)
        done = asyncio.get_running_loop().create_future()
        self._waiting[rid] = done
        answered = False
        try:
            self.conn.send(("add", rid, list(prompt_ids), params))
            version, collected = await done
            answered = True
        finally:
            self._waiting.pop(rid, None)
            if not answered and self._fatal is None and not self.stopping:
                self.conn.send(("abort", rid))  # the client left: free the engine's work
        return collect_results(rid, prompt_ids, params, self.tokenizer, version, collected)

    def dispatch(self, message: tuple) -> None:
        """One message of the engine process (event loop thread)."""
        kind = message[0]
        if kind == "done":
            _, rid, version, collected = message
            _settle(self._waiting.get(rid), result=(version, collected))
        elif kind == "error":
            _, rid, status, text = message
            _settle(self._waiting.get(rid), error=_error(status, text))
        elif kind == "fatal":
            self._fatal = message[1]
            self.fail_all(EngineUnavailableError(self._fatal))
        elif kind == "stop":
            self.stopping = True
            self.fail_all(EngineUnavailableError("the engine is shutting down"))

    def fail_all(self, error: BaseException) -> None:
        for future in list(self._waiting.values()):
            _settle(future, error=error)


def _settle(future: asyncio.Future | None, *, result: Any = None, error: BaseException | None = None) -> None:
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _error(status: int, text: str) -> Exception:
    if status == 400:
        return RequestError(text)
    if status == 503:
        return EngineUnavailableError(text)
    return RuntimeError(text)


class FrontendApp:
    """ASGI app: non-streaming POST /generate here, everything else to `engine_url`."""

    def __init__(self, engine: RemoteEngine, engine_url: str) -> None:
        self.engine = engine
        self.engine_url = engine_url.rstrip("/")
        self._session: Any = None  # aiohttp.ClientSession, made on the serving loop

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        request = Request(scope, receive)
        body = await request.body()  # read (and cached) before the disconnect watch takes over `receive`
        try:
            if scope["path"] == "/generate" and scope["method"] == "POST":
                req = await generate.read_request(request, generate.GenerateRequest)
                if not req.stream:
                    handler = self._generate(req)
                    response = await generate.unless_client_leaves(handler, receive)
                    if response is not None:
                        await response(scope, receive, send)
                    return
            await generate.unless_client_leaves(self._pass_through(scope, body, send), receive)
        except Exception as error:  # 400 / 503 as the engine's app answers them; anything else is a bug: 500
            if not isinstance(error, (RequestError, EngineUnavailableError)):
                logger.exception("%s %s failed", scope["method"], scope["path"])
            await (await generate.error_response(request, error))(scope, receive, send)

    async def _generate(self, req: Any) -> Any:
        return generate.respond(await generate.generate(self.engine, req))

    async def _pass_through(self, scope: dict, body: bytes, send: Any) -> None:
        """Send the request to the engine's server as it came; stream its answer back as it comes."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0),
            )  # fmt: skip
        query = scope.get("query_string", b"")
        url = self.engine_url + scope["path"] + ("?" + query.decode("latin-1") if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in _HOP_BY_HOP]  # fmt: skip
        try:
            upstream = await self._session.request(scope["method"], url, headers=headers, data=body)
        except aiohttp.ClientError as error:
            raise EngineUnavailableError(
                f"the engine's server at {self.engine_url} did not answer: {error!r}"
            ) from None
        async with upstream:
            out = [(k, v) for k, v in upstream.raw_headers if k.decode("latin-1").lower() not in _HOP_BY_HOP]
            await send({"type": "http.response.start", "status": upstream.status, "headers": out})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def read_messages(conn: Connection, loop: asyncio.AbstractEventLoop, engine: RemoteEngine,
                  on_close: Any = None) -> None:  # fmt: skip
    """Reader thread: the engine process's messages to the loop. When that process is gone, so is this one
    (`on_close`, default: exit at once): its clients see the connection close, as they would have with the
    engine in one process."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            (on_close or (lambda: os._exit(0)))()
            return
        loop.call_soon_threadsafe(engine.dispatch, message)


async def serve(args: argparse.Namespace, conn: Connection, tokenizer: Any, engine_url: str, vocab_size: int,
                context_len: int) -> None:  # fmt: skip
    import uvicorn

    listener = socket.socket(fileno=args.listen_fd)
    engine = RemoteEngine(conn, tokenizer=tokenizer, model_path=args.model_path, vocab_size=vocab_size,
                          context_len=context_len)  # fmt: skip
    app = FrontendApp(engine, engine_url)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, lifespan="off", timeout_keep_alive=30,
                                           timeout_graceful_shutdown=5))  # fmt: skip
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if serving.done():
        serving.result()  # start-up failed: raise its error
    loop = asyncio.get_running_loop()
    original = engine.dispatch

    def dispatch(message: tuple) -> None:
        original(message)
        if message[0] == "stop":
            server.should_exit = True

    engine.dispatch = dispatch
    threading.Thread(target=read_messages, args=(conn, loop, engine), name="clawrl-engine-link",
                     daemon=True).start()  # fmt: skip
    conn.send(("ready",))
    await serving
    await app.close()


def _load_tokenizer(model_path: str) -> Any:
    """The engine's tokenizer (core/engine.py loads the same directory the same way)."""
    from pathlib import Path

    path = Path(model_path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conn-fd", type=int, required=True, help="the socket to the engine process")
    p.add_argument("--listen-fd", type=int, required=True, help="the listening socket of the public port")
    p.add_argument("--model-path", required=True, help="the served model directory (its tokenizer)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    conn = Connection(args.conn_fd)
    tokenizer = _load_tokenizer(args.model_path)  # while the engine loads
    try:
        message = conn.recv()  # ("serve", engine url, vocab size, context length) once the engine is up
    except (EOFError, OSError):
        return  # the engine process is gone
    if message[0] != "serve":
        return  # ("stop",): the engine did not come up
    asyncio.run(serve(args, conn, tokenizer, *message[1:]))


if __name__ == "__main__":
    main()
