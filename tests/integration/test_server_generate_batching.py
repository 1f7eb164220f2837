"""The engine server's non-streaming path, for real (uvicorn on 127.0.0.1, a tiny fp32 model on CPU):

- a non-streaming request is handed to the event loop once, when it is done, not once per step, and its
  response equals the last chunk of the same request streamed (text, tokens, logprobs, meta);
- a non-streaming answer carries the answer path's stamps (received_at <= finished_at <= answered_at, on
  the client's monotonic clock, inside the client's own send and receive times);
- the engine thread's hand-offs reach the loop in order and in one wake-up while the loop is busy;
- AsyncEngineClient gets more than 100 concurrent requests (httpx's and aiohttp's default limits) to the
  engine at once;
- the garbage collector's heap is frozen while the engine serves and unfrozen when it stops.
"""

import asyncio
import gc
import time

import pytest
from cpu_server import cpu_server

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.core.engine import StepOutput
from clawrl.engine.core.request import Collected
from clawrl.engine.http.client import AsyncEngineClient, EngineClient
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-batching")
    path = build_tiny_model(root / "m", vocab_size=2048, seed=3, tokenizer=build_tiny_tokenizer(2048),
                            tie_word_embeddings=False)  # fmt: skip
    with cpu_server(path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.url, timeout=60) as engine_client:
        yield engine_client


def _count_dispatched(aengine: AsyncEngine) -> list:
    """Record every event the engine thread hands to the loop (wraps the instance's own dispatcher)."""
    seen: list = []
    dispatch = aengine._dispatch

    def counting(events):
        seen.extend(event for _, event in events)
        dispatch(events)

    aengine._dispatch = counting
    return seen


def test_non_streaming_requests_reach_the_loop_once_and_match_the_stream(server, client):
    aengine = server.app.state.engine
    body = {"input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True, "rid": ["a", "b"],
            "sampling_params": {"max_new_tokens": 12, "n": 2, "seed": 4, "temperature": 0.9, "stop": ["e"],
                                "ignore_eos": True}}  # fmt: skip
    seen = _count_dispatched(aengine)
    try:
        items = client.generate(**body)
        assert [type(event) for event in seen] == [
            Collected,
            Collected,
        ]  # one hand-off a request, none a step
        seen.clear()
        chunks = list(client.generate(**{**body, "rid": ["c", "d"]}, stream=True))
        streamed_events = list(seen)
    finally:
        del aengine._dispatch
    # Streaming: every step's output of every sample (one token each).
    assert all(isinstance(event, StepOutput) for event in streamed_events)
    assert len(streamed_events) == sum(len(item["output_ids"]) for item in items)
    last = {}
    for chunk in chunks:
        last[chunk.pop("index")] = chunk
    assert len(items) == len(last) == 4
    for index, item in enumerate(items):
        streamed = last[index]
        for meta in (item["meta_info"], streamed["meta_info"]):
            meta.pop("id"), meta.pop("e2e_latency")
        for stamp in ("received_at", "finished_at", "answered_at"):  # the non-streaming answer path's only
            assert stamp not in streamed["meta_info"]
            item["meta_info"].pop(stamp)
        assert item == streamed
    assert {item["meta_info"]["finish_reason"]["type"] for item in items} <= {"stop", "length"}


def test_answers_carry_the_answer_paths_stamps_on_the_shared_clock(client):
    params = [{"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": 40, "ignore_eos": True}]
    body = {"input_ids": [[5, 6, 7], [8, 9, 10, 11]], "return_logprob": True, "sampling_params": params}
    sent = time.monotonic()
    items = client.generate(**body)
    back = time.monotonic()
    short, long = (item["meta_info"] for item in items)
    for meta in (short, long):
        assert sent <= meta["received_at"] <= meta["finished_at"] <= meta["answered_at"] <= back
        assert meta["answered_at"] - meta["received_at"] == pytest.approx(meta["e2e_latency"], abs=2e-3)
    # one batch: one handler (same arrival), one answer built when both were done; 3 tokens finish first
    assert short["received_at"] == long["received_at"]
    assert short["finished_at"] < long["finished_at"] <= short["answered_at"]


def test_hand_offs_are_coalesced_while_the_loop_is_busy_and_keep_their_order(server):
    aengine = server.app.state.engine
    seen = _count_dispatched(aengine)
    drains = []
    drain = aengine._drain_outbox
    aengine._drain_outbox = lambda: (drains.append(1), drain())
    loop, queue = aengine._loop, asyncio.Queue()

    def register_and_block():
        aengine._streams["probe"] = queue
        time.sleep(0.3)  # the loop is busy: the posts below queue up behind this callback

    try:
        loop.call_soon_threadsafe(register_and_block)
        time.sleep(0.05)
        for i in range(5):  # as the engine thread posts its steps
            aengine._post([("probe", i), ("nobody", i)])
        deadline = time.monotonic() + 10
        while queue.qsize() < 5:
            assert time.monotonic() < deadline, f"only {queue.qsize()} of 5 events arrived"
            time.sleep(0.01)
    finally:
        aengine._streams.pop("probe", None)
        del aengine._dispatch, aengine._drain_outbox
    assert [queue.get_nowait() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(drains) == 1 and seen == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_async_client_gets_more_than_100_requests_to_the_engine_at_once(server, client):
    aengine = server.app.state.engine
    num = 130  # a client with httpx's or aiohttp's default limit would hold all but 100 back

    async def scenario():
        async with AsyncEngineClient(server.url, timeout=60) as ac:
            await ac.pause_generation("in_place")  # requests wait in the engine, so all must be in flight
            try:
                one_token = {"max_new_tokens": 1}
                calls = [asyncio.create_task(ac.generate(input_ids=[i + 3], sampling_params=one_token))
                         for i in range(num)]  # fmt: skip
                deadline = time.monotonic() + 30
                while aengine.num_requests < num:
                    assert time.monotonic() < deadline, (
                        f"only {aengine.num_requests} of {num} reached the engine"
                    )
                    await asyncio.sleep(0.05)
            finally:
                await ac.continue_generation()
            outputs = await asyncio.wait_for(asyncio.gather(*calls), 60)
            return outputs

    outputs = asyncio.run(scenario())
    assert [len(out["output_ids"]) for out in outputs] == [1] * num


def test_the_heap_is_frozen_while_serving_and_unfrozen_after(server, tmp_path):
    assert gc.get_freeze_count() > 0  # the module's server froze what was loaded: engine, model, modules
    path = build_tiny_model(tmp_path / "m", vocab_size=512, seed=1, tokenizer=build_tiny_tokenizer(512))
    gc.unfreeze()  # the module's server froze the heap; this test needs a clean start
    try:
        with cpu_server(path, step_timeout_s=60) as running:
            assert gc.get_freeze_count() > 0
            with EngineClient(running.url) as other:
                assert (
                    len(other.generate(input_ids=[3], sampling_params={"max_new_tokens": 2})["output_ids"])
                    == 2
                )
        assert gc.get_freeze_count() == 0
    finally:
        gc.freeze()  # as the module's server expects (it unfreezes at its own stop)
