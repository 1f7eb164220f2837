"""`remote_rm` against a real HTTP server on 127.0.0.1: payload, number/dict bodies, retries, 4xx, deadline."""

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards import RemoteRewardError, RemoteRewardModel, build_reward_fn, compute_reward


class _Handler(BaseHTTPRequestHandler):
    """Routes: /number, /dict, /echo, /flaky (503 twice, then 1.0), /bad (400), /text (200, not JSON)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        if self.path == "/flaky":
            self.server.flaky_calls += 1
            if self.server.flaky_calls <= 2:
                return self._reply(503, "busy")
            return self._reply(200, json.dumps(1.0))
        replies = {
            "/number": (200, json.dumps(0.75)),
            "/dict": (200, json.dumps({"score": 1.0, "acc": True})),
            "/echo": (200, json.dumps({"score": 0.0, "got": body})),
            "/bad": (400, "label missing"),
            "/text": (200, "great answer"),
        }
        self._reply(*replies[self.path])

    def _reply(self, status, text):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.requests, httpd.flaky_calls = [], 0
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _fast(url, **kw):
    return RemoteRewardModel(url=url, backoff_base_s=0.05, jitter_s=0.01, **kw)


async def _call(model, sample):
    try:
        return await model(sample)
    finally:
        await model.aclose()


def test_number_reward_through_build_reward_fn(server):
    _, base = server
    fn = build_reward_fn(rm_type="remote_rm", rm_url=f"{base}/number")

    async def score():
        try:
            return await compute_reward(Sample(response="r", label="l"), fn)
        finally:
            await fn.aclose()

    assert asyncio.run(score()) == 0.75


def test_dict_reward_and_payload(server):
    httpd, base = server
    sample = Sample(prompt=[{"role": "user", "content": "2+2?"}], response="4", label=4)
    assert asyncio.run(_call(_fast(f"{base}/dict"), sample)) == {"score": 1.0, "acc": True}
    echoed = asyncio.run(_call(_fast(f"{base}/echo"), sample))
    assert echoed["got"] == {"prompt": [{"role": "user", "content": "2+2?"}], "response": "4", "label": 4}


def test_503_is_retried_until_success(server):
    httpd, base = server
    assert asyncio.run(_call(_fast(f"{base}/flaky"), Sample())) == 1.0
    assert [path for path, _ in httpd.requests] == ["/flaky"] * 3


def test_400_is_not_retried_and_says_why(server):
    httpd, base = server
    with pytest.raises(
        RemoteRewardError,
        match=r"--rm-url .*/bad rejected the request \(not retried\): HTTP 400.*label missing",
    ):
        asyncio.run(_call(_fast(f"{base}/bad"), Sample()))
    assert len(httpd.requests) == 1


def test_non_json_body_is_a_clear_error(server):
    _, base = server
    with pytest.raises(RemoteRewardError, match="returned 'great answer'; expected a JSON number or object"):
        asyncio.run(_call(_fast(f"{base}/text"), Sample()))


def test_max_attempts_bounds_retries(server):
    httpd, base = server
    with pytest.raises(RemoteRewardError, match=r"after 2 attempt\(s\).*last failure: HTTP 503"):
        asyncio.run(_call(_fast(f"{base}/flaky", max_attempts=2), Sample()))
    assert len(httpd.requests) == 2


def test_unreachable_url_fails_within_the_deadline():
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/reward"
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        asyncio.run(_call(_fast(url, deadline_s=1.0, max_attempts=100), Sample()))
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed < 2.0, elapsed
    message = str(info.value)
    assert url in message and "ClientConnectorError" in message and "deadline 1 s" in message


def test_a_url_that_is_not_http_fails_at_once_without_retries():
    start = time.monotonic()
    with pytest.raises(
        RemoteRewardError, match=r"--rm-url 'ftp://127.0.0.1/reward' is not a usable http\(s\) URL"
    ):
        asyncio.run(_call(_fast("ftp://127.0.0.1/reward", deadline_s=30.0, max_attempts=100), Sample()))
    assert time.monotonic() - start < 2.0
