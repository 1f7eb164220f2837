"""Client CPU per /generate call: the rollout's AsyncEngineClient (aiohttp) vs httpx's AsyncClient.

A rollout sends all of its requests at once and reads every answer when the last engine step ends, so the
client's CPU per call is on the rollout's critical path twice. This benchmark times that alone. A canned
server (uvicorn in a subprocess) answers each call after --delay-s with a /generate answer of
--answer-tokens tokens, each with its logprob, which is what a rollout gets back. The client sends
--calls calls at once, --rounds times, and prints its process CPU per call and the wall time per round.

Clients:
- `engine-client`: clawrl.engine.http.client.AsyncEngineClient (aiohttp, one session, no connection limit);
- `httpx-pools`: httpx.AsyncClient pools of 16 connections each, opened as the calls need them (how
  AsyncEngineClient was built before 2026-12-05: one pool without a limit does work quadratic in its
  connections);
- `httpx`: one httpx.AsyncClient without a connection limit.

    .venv/bin/python bench/http_client_overhead.py
    .venv/bin/python bench/http_client_overhead.py --calls 256 --rounds 5 --server-http h11
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawrl import fast_json  # noqa: E402
from clawrl.engine.http.client import AsyncEngineClient  # noqa: E402

SERVER = r"""
import asyncio, sys
import orjson, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

port, tokens, delay, http = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
meta = {"id": "r", "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 128,
        "completion_tokens": tokens, "cached_tokens": 0, "weight_version": "1", "e2e_latency": 0.5,
        "output_token_logprobs": [[-1.2345678 - i * 1e-6, i, None] for i in range(tokens)],
        "output_token_weight_versions": ["1"] * tokens}
answer = orjson.dumps({"text": "word " * tokens, "output_ids": list(range(tokens)), "meta_info": meta})

async def generate(request):
    orjson.loads(await request.body())
    await asyncio.sleep(delay)
    return Response(answer, media_type="application/json")

app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=http)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HttpxPools:
    """httpx.AsyncClient pools of `per_pool` connections, the least busy one taking each call."""

    def __init__(self, url: str, per_pool: int | None) -> None:
        self.url, self.per_pool = url, per_pool
        self.pools: list[httpx.AsyncClient] = []
        self.busy: list[int] = []

    async def generate(self, **body) -> dict:
        index = min(range(len(self.busy)), key=self.busy.__getitem__, default=-1)
        if index < 0 or (self.per_pool is not None and self.busy[index] >= self.per_pool):
            keep = self.per_pool or 256
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=keep)
            self.pools.append(httpx.AsyncClient(base_url=self.url, limits=limits, timeout=600))
            self.busy.append(0)
            index = len(self.pools) - 1
        self.busy[index] += 1
        try:
            response = await self.pools[index].post("/generate", json=body)
        finally:
            self.busy[index] -= 1
        return fast_json.loads(response.content)

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


async def run_client(kind: str, url: str, args) -> list[dict]:
    rng = random.Random(0)
    body = {"input_ids": [rng.randrange(2000) for _ in range(args.prompt_tokens)],
            "sampling_params": {"max_new_tokens": args.answer_tokens, "temperature": 1.0},
            "return_logprob": True}  # fmt: skip
    client = {"engine-client": lambda: AsyncEngineClient(url), "httpx-pools": lambda: HttpxPools(url, 16),
              "httpx": lambda: HttpxPools(url, None)}[kind]()  # fmt: skip
    rounds = []
    try:
        for _ in range(args.rounds + 1):  # the first round opens the connections: left out
            cpu, wall = time.process_time(), time.perf_counter()
            answers = await asyncio.gather(*(client.generate(**body) for _ in range(args.calls)))
            assert all(len(a["output_ids"]) == args.answer_tokens for a in answers)
            rounds.append({"cpu_ms_per_call": (time.process_time() - cpu) * 1e3 / args.calls,
                           "wall_s": time.perf_counter() - wall})  # fmt: skip
    finally:
        await client.aclose()
    return rounds[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--delay-s", type=float, default=0.3, help="the server's wait before each answer")
    p.add_argument("--server-http", default="httptools", choices=("httptools", "h11"))
    p.add_argument("--clients", default="engine-client,httpx-pools,httpx")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.answer_tokens),
                               str(args.delay_s), args.server_http])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the canned server did not start") from None
                time.sleep(0.1)
        results = {"args": vars(args), "clients": {}}
        print(f"{args.calls} calls at once, {args.prompt_tokens} prompt / {args.answer_tokens} answer tokens, "
              f"server {args.server_http}, answer after {args.delay_s} s")  # fmt: skip
        for kind in args.clients.split(","):
            rounds = asyncio.run(run_client(kind, url, args))
            results["clients"][kind] = rounds
            cpu = sorted(r["cpu_ms_per_call"] for r in rounds)
            wall = sorted(r["wall_s"] for r in rounds)
            print(f"{kind:14s} client CPU {cpu[len(cpu) // 2]:.2f} ms/call (min {cpu[0]:.2f}, max {cpu[-1]:.2f}),"
                  f" round {wall[len(wall) // 2]:.3f} s (the server waits {args.delay_s} s)")  # fmt: skip
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=1))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
