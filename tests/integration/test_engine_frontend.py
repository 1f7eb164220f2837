"""The engine's HTTP front-end process (clawrl/engine/http/frontend.py), for real: a tiny
fp32 model on CPU, real uvicorn servers on 127.0.0.1, the real socket pair between the two sides.

test_engine_server.py runs every route against a FrontendServer too; here: what only the split has (the
front end's own errors, the engine dying under it, the process going away with the engine, the flag).
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import httpx
import pytest
import uvicorn

from clawrl.engine.async_engine import AsyncEngine, EngineUnavailableError
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.http import frontend
from clawrl.engine.http.app import ServerThread, create_app
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-frontend")
    return str(build_tiny_model(root / "m", vocab_size=2048, seed=0, tokenizer=build_tiny_tokenizer(2048),
                                tie_word_embeddings=False))  # fmt: skip


class _LinkedFrontend:
    """The two halves of FrontendServer in this process (so a test can break either): the engine's app in a
    ServerThread with the bridge, and FrontendApp on its own uvicorn loop, joined by a socket pair."""

    def __init__(self, model_dir: str) -> None:
        engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype="float32"))
        self.aengine = AsyncEngine(engine, step_timeout_s=60)
        self.inner = ServerThread(create_app(self.aengine)).start()
        mine, theirs = socket.socketpair()
        self.bridge = frontend._Bridge(self.aengine, Connection(mine.detach()))
        self.bridge.start()
        self.remote = frontend.RemoteEngine(Connection(theirs.detach()), tokenizer=self.aengine.tokenizer,
                                            model_path=model_dir, vocab_size=self.aengine.vocab_size,
                                            context_len=self.aengine.context_len)  # fmt: skip
        self.closed = threading.Event()
        self.server = uvicorn.Server(uvicorn.Config(frontend.FrontendApp(self.remote, self.inner.url), port=0,
                                                    lifespan="off", log_level="warning"))  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),))
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        threading.Thread(target=frontend.read_messages, args=(self.remote.conn, self.loop, self.remote,
                                                               self.closed.set), daemon=True).start()  # fmt: skip

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.bridge.close()
        self.inner.stop()


@pytest.fixture
def linked(model_dir):
    running = _LinkedFrontend(model_dir)
    yield running
    running.stop()


def test_front_end_answers_like_the_engine_and_a_handler_bug_is_a_json_500(linked, monkeypatch):
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 6, **GREEDY},
        "return_logprob": True,
    }
    direct = httpx.post(f"{linked.inner.url}/generate", json=body, timeout=60).json()
    fronted = httpx.post(f"{linked.url}/generate", json=body, timeout=60).json()
    assert fronted["output_ids"] == direct["output_ids"] and len(direct["output_ids"]) == 6
    assert fronted["text"] == direct["text"]
    assert fronted["meta_info"]["output_token_logprobs"] == direct["meta_info"]["output_token_logprobs"]
    assert linked.aengine.num_requests == 0  # the bridge forgot the finished request
    bad = httpx.post(f"{linked.url}/generate", json={"input_ids": [1, 99999]}, timeout=10)
    assert bad.status_code == 400 and "input_ids[1] = 99999" in bad.json()["error"]["message"]

    async def broken(engine, req):
        raise ZeroDivisionError("a bug in the front end's handler")

    monkeypatch.setattr(frontend.generate, "generate", broken)
    bug = httpx.post(f"{linked.url}/generate", json=body, timeout=10)
    assert bug.status_code == 500 and bug.json()["error"] == {
        "message": "a bug in the front end's handler", "type": "internal_error", "code": 500,
    }  # fmt: skip


def test_engine_death_fails_the_front_ends_requests_with_503(linked):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100_000, **GREEDY}}
    answers: list[httpx.Response] = []
    caller = threading.Thread(target=lambda: answers.append(httpx.post(f"{linked.url}/generate", json=body,
                                                                        timeout=60)))  # fmt: skip
    caller.start()
    deadline = time.monotonic() + 30
    while not linked.aengine._remote_rids:  # in the engine
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    linked.aengine._die(EngineUnavailableError("the engine thread died: injected"))
    caller.join(30)
    assert answers[0].status_code == 503
    assert answers[0].json()["error"]["message"] == "the engine thread died: injected"
    later = httpx.post(f"{linked.url}/generate", json=body, timeout=10)  # refused at once from now on
    assert later.status_code == 503 and "injected" in later.json()["error"]["message"]


def test_front_end_notices_the_engine_side_closing(linked):
    linked.bridge.close()  # what the engine process's death does to the socket
    assert linked.closed.wait(10), "the front end's reader did not see the engine go away"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _front_end_pid(parent: int) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"clawrl.engine.http.frontend" in f.read():
                        return int(entry)
    return None


def test_cli_engine_with_a_front_end_process_serves_and_goes_away_with_the_engine(model_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "clawrl.cli.main", "engine", "--model-path", model_dir, "--port", str(port),
           "--device", "cpu", "--http-frontend-process", "on", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
        while True:
            assert proc.poll() is None, "clawrl engine exited during start-up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "clawrl engine did not come up"
            time.sleep(0.2)
        child = _front_end_pid(proc.pid)
        assert child is not None, "no front-end process under clawrl engine"
        out = httpx.post(f"{url}/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4,
                                                                                     **GREEDY}}, timeout=30)  # fmt: skip
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGKILL)  # the engine process crashes
        proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and _state(child) != "Z":
            assert time.monotonic() < deadline, "the front end outlived its engine"
            time.sleep(0.05)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_front_end_is_on_for_cuda_engines_by_default_and_the_setting_is_checked(model_dir):
    assert EngineConfig(model_path=model_dir, device="cuda").frontend_process is True
    assert EngineConfig(model_path=model_dir, device="cpu").frontend_process is False
    assert (
        EngineConfig(model_path=model_dir, device="cuda", http_frontend_process=False).frontend_process
        is False
    )
    with pytest.raises(
        ValueError, match=r"EngineConfig.http_frontend_process must be true, false or null .* 'yes'"
    ):
        EngineConfig(model_path=model_dir, http_frontend_process="yes")


def test_a_launched_front_end_that_never_serves_stops_cleanly(model_dir):
    front = frontend.FrontendServer.launch(model_dir)  # as EngineActor does before the engine loads
    front.stop(timeout_s=30)  # the engine failed to load: the process must not linger
    assert front.process.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{front.url}/health", timeout=2)
