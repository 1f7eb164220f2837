"""HTTP server of the built-in engine: SGLang's and OpenAI's routes over one AsyncEngine.

`create_app(async_engine)` builds the FastAPI app (thin handlers: parse -> call -> respond); `serve(config,
host, port)` loads the engine and runs uvicorn; `ServerThread` runs an app in a background thread (tests,
in-process rollouts). Routes:

    POST /generate                      SGLang: text | input_ids (single or batch), sampling_params, stream
    POST /v1/chat/completions           OpenAI chat (chat template + tools; SSE streaming)
    POST /v1/completions                OpenAI completions
    GET  /v1/models
    GET  /health                        200 while the engine thread is alive, else 503
    GET  /health_generate               runs a 1-token generation within a deadline
    GET  /get_model_info, /get_weight_version, /get_server_info (= /server_info)
    POST /flush_cache (also GET), /update_weights_from_disk, /release_memory_occupation,
         /resume_memory_occupation, /pause_generation, /continue_generation, /abort_request
    POST /update_weights_from_tensor, /init_weights_update_group, /update_weights_from_distributed,
         /destroy_weights_update_group; GET /weights_checksum    (weight sync: weight_receiver.py)

Errors are JSON `{"error": {"message", "type", "code"}, "message"}`: 400 for a bad request (the message
names the field), 503 when the engine cannot serve, 500 for a bug.

The control and weight-update routes take SGLang's request bodies and answer with SGLang's fields
(`success`, `message`, ...; extra clawrl fields beside them), as an SGLang v0.5 server does and as slime
calls them, so `--rollout-external-engine-addrs` drives this engine and a real SGLang server alike
(clawrl/cluster/external_engines.py; docs/engine.md, "External engines").

Run: `clawrl engine --model-path DIR --port 30000`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import model_validator

from clawrl.engine.async_engine import AsyncEngine, EngineUnavailableError
from clawrl.engine.core.request import RequestError, SamplingParams
from clawrl.engine.http import generate, openai
from clawrl.engine.http.client import ENGINE_SERVER_KEEPALIVE_S
from clawrl.engine.http.generate import LenientRequest, RequestModel, format_validation_error, read_request
from clawrl.engine.weight_receiver import WeightReceiver

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0

router = APIRouter()


def create_app(async_engine: AsyncEngine) -> FastAPI:
    """The engine's FastAPI app; the engine thread starts and stops with the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            app.state.weight_receiver.close()

    app = FastAPI(title="clawrl engine", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.weight_receiver = WeightReceiver(async_engine.engine)
    app.include_router(generate.router)
    app.include_router(openai.router)
    app.include_router(router)
    app.add_exception_handler(RequestError, _error_response)
    app.add_exception_handler(EngineUnavailableError, _error_response)
    app.add_exception_handler(RequestValidationError, _validation_error_response)
    app.add_exception_handler(Exception, _error_response)
    app.add_middleware(GenerateFastPath)
    return app


class GenerateFastPath:
    """POST /generate straight to its handler, past FastAPI's router, dependency solving and exception
    middleware: a rollout's hundreds of requests arrive, and their answers leave, together, on this one
    event loop, and those layers were a quarter of its CPU per request (bench/rollout_http_overhead.py
    --profile). The handler, the errors' JSON and status codes, and the app's outer middleware (body limit,
    the 500 handler) are the same as on the routed path; every other route takes that path."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            await request.body()  # read (and cached) before the watch below takes over `receive`
            response = await _unless_client_leaves(generate.generate_route(request), receive)
        except (RequestError, EngineUnavailableError) as error:  # the app's handlers for these; others -> 500
            response = await _error_response(request, error)
        if response is not None:
            await response(scope, receive, send)


async def _unless_client_leaves(handler: Any, receive: Any) -> Any:
    """Await `handler`; if the client disconnects first, cancel it and return None. A cancelled generation
    aborts its engine request (AsyncEngine.generate_full), so a client that timed out or died does not leave
    its samples decoding for no one (a stream's disconnect is StreamingResponse's to notice)."""
    task = asyncio.current_task()
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await handler
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
        return None
    finally:
        watcher.cancel()


# ---------------------------------------------------------------------------------------------------
# helpers


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


def _error_body(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": status}, "message": message}


async def _error_response(request: Request, error: Exception) -> JSONResponse:
    status = getattr(error, "status_code", 500)
    if status >= 500:  # (uvicorn logs the traceback of a 500 itself)
        logger.error("%s %s failed: %r", request.method, request.url.path, error)
    kind = {400: "invalid_request_error", 503: "engine_unavailable"}.get(status, "internal_error")
    return JSONResponse(_error_body(str(error), kind, status), status_code=status)


async def _validation_error_response(request: Request, error: RequestValidationError) -> JSONResponse:
    message = format_validation_error(list(error.errors()))
    return JSONResponse(_error_body(message, "invalid_request_error", 400), status_code=400)


# ---------------------------------------------------------------------------------------------------
# health and info


@router.get("/health")
async def health(request: Request):
    engine = _engine(request)
    engine.check_alive()
    return {"status": "ok", "weight_version": engine.weight_version}


@router.get("/health_generate")
async def health_generate(request: Request):
    """Generate one token within HEALTH_GENERATE_TIMEOUT_S; while paused or released, report that instead
    (generation cannot run then, and that is not a failure)."""
    engine = _engine(request)
    engine.check_alive()
    if engine.is_paused or engine.released_tags:
        return {
            "status": "paused" if engine.is_paused else "released",
            "weight_version": engine.weight_version,
        }
    # Any single in-vocabulary token will do; the model's BOS (if any) is the natural one.
    prompt = [engine.engine.model_args.bos_token_id or 0]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    try:
        results = await asyncio.wait_for(engine.generate_full(prompt, params), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise EngineUnavailableError(
            f"health_generate: one token was not generated within {HEALTH_GENERATE_TIMEOUT_S:.0f} s"
        ) from None
    return {"status": "ok", "weight_version": results[0].weight_version,
            "latency_s": round(time.monotonic() - started, 6)}  # fmt: skip


@router.get("/get_model_info")
async def get_model_info(request: Request):
    engine = _engine(request)
    model_args = engine.engine.model_args
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "served_model_name": engine.served_model_name,
        "is_generation": True,
        "architecture": model_args.arch,
        "vocab_size": engine.vocab_size,
        "context_length": engine.context_len,
        "weight_version": engine.weight_version,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request):
    """SGLang's server info: its server-args fields (model_path, dtype, context_length, ...), scheduler
    limits and `version`; plus the served model's `model_type`, `architectures` and `vocab_size`, which a
    client compares with its own checkpoint (SGLang leaves those out: the client reads model_path)."""
    engine = _engine(request)
    config = engine.engine.config
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "served_model_name": engine.served_model_name,
        "dtype": config.dtype,
        "device": config.device,
        "context_length": engine.context_len,
        "max_running_requests": config.max_running_requests,
        "max_req_input_len": engine.context_len - 1,
        "tp_size": config.tp_size,
        "dp_size": 1,
        "random_seed": config.seed,
        "disable_radix_cache": not config.enable_prefix_caching,
        "model_type": engine.engine.model_args.arch,
        "architectures": _architectures(engine.model_path),
        "vocab_size": engine.vocab_size,
        "weight_version": engine.weight_version,
        "version": _clawrl_version(),
        "engine": "clawrl",
        "engine_stats": engine.stats.as_dict(),  # clawrl's: cumulative core steps, busy seconds, outputs
    }


def _architectures(model_path: str) -> list[str] | None:
    """`architectures` of the served model's config.json (None when it has none)."""
    try:
        with open(f"{model_path}/config.json") as f:
            return json.load(f).get("architectures")
    except (OSError, ValueError):
        return None


def _clawrl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clawrl")
    except PackageNotFoundError:
        return "unknown"


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": _engine(request).weight_version}


# ---------------------------------------------------------------------------------------------------
# control


class UpdateWeightsFromDiskRequest(LenientRequest):
    """SGLang `POST /update_weights_from_disk`."""

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    load_format: str | None = None
    flush_cache: bool = True


class MemoryOccupationRequest(LenientRequest):
    """`POST /release_memory_occupation` and `/resume_memory_occupation`: tags None means all."""

    tags: list[str] | None = None


class PauseGenerationRequest(RequestModel):
    """`POST /pause_generation`: abort (SGLang's default) aborts in-flight requests; in_place and retract
    keep them, and they resume at `/continue_generation`."""

    mode: Literal["abort", "in_place", "retract"] = "abort"


class AbortRequest(LenientRequest):
    """`POST /abort_request`: one request id, or every request."""

    rid: str | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _target(self) -> AbortRequest:
        if not self.abort_all and not self.rid:
            raise ValueError('give rid ("...") or abort_all (true)')
        return self


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    if not await _engine(request).flush_cache():
        raise RequestError("cache not flushed: requests are running (pause with mode abort, or wait)")
    return {"success": True, "message": "cache flushed"}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    req = await read_request(request, UpdateWeightsFromDiskRequest)
    version = await _engine(request).update_weights_from_disk(
        req.model_path, weight_version=req.weight_version, abort_all_requests=req.abort_all_requests
    )
    return {"success": True, "message": f"weights loaded from {req.model_path}", "num_paused_requests": 0,
            "weight_version": version}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# weight sync (clawrl/weight_sync/ sends; clawrl/engine/weight_receiver.py does the work)


def _receiver(request: Request) -> WeightReceiver:
    return request.app.state.weight_receiver


async def _json_object(request: Request) -> dict:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise RequestError(f"request body must be a JSON object, got {type(data).__name__}")
    return data


async def _load_and_maybe_finish(request: Request, load: Any, body: dict | None = None) -> dict:
    """Run a bucket load on the engine thread; a finishing message also resumes generation."""
    body = await _json_object(request) if body is None else body
    engine = _engine(request)
    result = await engine.run_in_engine_thread(functools.partial(load, body))
    if result["finished"]:
        await engine.continue_generation()
    return result


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request):
    return await _load_and_maybe_finish(request, _receiver(request).update_from_tensor)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request):
    body = await _json_object(request)
    if body.get("abort_all_requests"):  # SGLang's option: abort what runs before the weights change
        await _engine(request).abort_all()
    return await _load_and_maybe_finish(request, _receiver(request).update_from_distributed, body)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request):
    body = await _json_object(request)
    try:  # joining blocks until every rank is in: a worker thread, never the event loop or engine thread
        return await asyncio.to_thread(_receiver(request).init_group, body)
    except ValueError as error:
        raise RequestError(str(error)) from None


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request):
    body = await _json_object(request)
    try:
        return await asyncio.to_thread(_receiver(request).destroy_group, body)
    except ValueError as error:
        raise RequestError(str(error)) from None


@router.get("/weights_checksum")
async def weights_checksum(request: Request):
    return await _engine(request).run_in_engine_thread(_receiver(request).checksums)


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request):
    req = await read_request(request, MemoryOccupationRequest)
    await _engine(request).release_memory_occupation(req.tags)
    return {"success": True, "released": _engine(request).released_tags}


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request):
    req = await read_request(request, MemoryOccupationRequest)
    await _engine(request).resume_memory_occupation(req.tags)
    return {"success": True, "released": _engine(request).released_tags}


@router.post("/pause_generation")
async def pause_generation(request: Request):
    req = await read_request(request, PauseGenerationRequest)
    num_aborted = await _engine(request).pause_generation(req.mode)
    return {"success": True, "message": "Generation paused successfully.", "mode": req.mode,
            "num_aborted": num_aborted}  # fmt: skip


@router.post("/continue_generation")
async def continue_generation(request: Request):
    await _engine(request).continue_generation()
    return {"success": True, "message": "Generation continued successfully."}


@router.post("/abort_request")
async def abort_request(request: Request):
    req = await read_request(request, AbortRequest)
    engine = _engine(request)
    if req.abort_all:
        return {"success": True, "num_aborted": await engine.abort_all()}
    found = await engine.abort_request(req.rid)
    return {"success": True, "num_aborted": int(found)}


# ---------------------------------------------------------------------------------------------------
# running


def serve(config: Any, host: str = "127.0.0.1", port: int = 30000, *, step_timeout_s: float = 300.0,
          served_model_name: str | None = None, log_level: str = "info",
          reasoning_parser: str | None = None) -> None:  # fmt: skip
    """Load the engine of `config` (EngineConfig) and serve it until interrupted; `reasoning_parser`
    ("qwen3", "deepseek-r1": both split at <think>...</think>) makes chat replies separate the reasoning."""
    import uvicorn

    from clawrl.engine.core.engine import Engine

    async_engine = AsyncEngine(
        Engine(config), step_timeout_s=step_timeout_s, served_model_name=served_model_name
    )
    app = create_app(async_engine)
    app.state.reasoning_parser = reasoning_parser
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=ENGINE_SERVER_KEEPALIVE_S)


class ServerThread:
    """Run an app with uvicorn in a background thread; port 0 picks a free port (read `.port` / `.url`).

    with ServerThread(create_app(async_engine)) as server:
        EngineClient(server.url).health()
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 60.0,
                 log_level: str = "warning") -> None:  # fmt: skip
        import uvicorn

        self.app = app
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._server = uvicorn.Server(
            uvicorn.Config(
                app, host=host, port=port, log_level=log_level, timeout_keep_alive=ENGINE_SERVER_KEEPALIVE_S
            )
        )  # clients drop idle ones sooner
        self._thread = threading.Thread(target=self._server.run, name="clawrl-engine-http", daemon=True)
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(
                    f"the HTTP server on {self.host}:{self.port} exited during startup (see log)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {self.start_timeout_s} s")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
