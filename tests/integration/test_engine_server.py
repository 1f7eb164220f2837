"""The engine's HTTP server, for real: uvicorn on 127.0.0.1, a tiny fp32 model on CPU, used through
EngineClient / AsyncEngineClient and through the official `openai` package; `clawrl engine` as a subprocess.

One server serves the whole module (tests that change its state restore it). Model "a" is served; model
"b" (same tokenizer, other seed) is the checkpoint weight updates load.
"""

import asyncio
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from cpu_server import cpu_server

from clawrl import fast_json
from clawrl.engine.async_engine import AsyncEngine, EngineUnavailableError
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.http.client import AsyncEngineClient, EngineClient, EngineClientError
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer

GREEDY = {"temperature": 0.0, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-server")
    tokenizer = build_tiny_tokenizer(2048)
    # Untied: with tied random embeddings greedy decoding just repeats the last token, whatever the seed.
    model_a = build_tiny_model(
        root / "a", vocab_size=2048, seed=0, tokenizer=tokenizer, tie_word_embeddings=False
    )
    model_b = build_tiny_model(
        root / "b", vocab_size=2048, seed=1, tokenizer=tokenizer, tie_word_embeddings=False
    )
    return str(model_a), str(model_b)


@pytest.fixture(scope="module")
def server(models):
    with cpu_server(models[0]) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.url, timeout=60) as engine_client:
        yield engine_client


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models[0])


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def _greedy(client, ids, max_new_tokens=8):
    return client.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, **GREEDY})


def _chat_prompt_ids(tokenizer, messages, tools=None):
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------
# info routes


def test_health_info_and_models(client, models):
    assert client.health()["status"] == "ok"
    assert client.health_generate()["status"] == "ok"
    info = client.get_model_info()
    assert (info["model_path"], info["vocab_size"], info["context_length"]) == (models[0], 2048, 2048)
    assert info["weight_version"] == client.get_weight_version()["weight_version"]
    listed = client.models()["data"]
    assert [m["id"] for m in listed] == [models[0]] and listed[0]["max_model_len"] == 2048


# ---------------------------------------------------------------------------------------------------
# /generate


def test_generate_text_and_input_ids_agree(client, tokenizer):
    out = client.generate(text="hello world", sampling_params={"max_new_tokens": 6, **GREEDY})
    by_ids = _greedy(client, tokenizer.encode("hello world"), 6)
    assert out["output_ids"] == by_ids["output_ids"] and len(out["output_ids"]) == 6
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(tokenizer.encode("hello world")), 6)
    assert meta["weight_version"] == client.get_weight_version()["weight_version"]
    assert "output_token_logprobs" not in meta


def test_logprobs_match_a_full_forward(client, models):
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 300, 42, 7, 900, 11]
    params = {"max_new_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    out = client.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["output_ids"]])).logits[0, len(prompt) - 1 : -1]
    # Engine logprobs are of the temperature-scaled distribution it sampled from (decision 7).
    expected = torch.log_softmax(logits / 0.8, dim=-1).gather(1, torch.tensor(out["output_ids"])[:, None])[
        :, 0
    ]
    assert torch.allclose(torch.tensor([t[0] for t in triples]), expected, atol=1e-5, rtol=0)
    again = client.generate(input_ids=prompt, sampling_params=params)
    assert again["output_ids"] == out["output_ids"]  # same seed, same tokens


def test_compact_logprobs_carry_the_same_floats_bit_for_bit(client):
    """clawrl's compact_logprobs (the rollout asks its own engines for them): the logprobs of output_ids packed
    as float64 bytes, the weight versions as runs; the same tokens and the same floats as SGLang's triples."""
    prompts = [[5, 17, 300, 42], [7, 900, 11]]
    params = {"max_new_tokens": 9, "temperature": 0.9, "seed": 4, "ignore_eos": True, "n": 2}
    plain = client.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    compact = client.generate(
        input_ids=prompts, sampling_params=params, return_logprob=True, compact_logprobs=True
    )
    assert len(plain) == len(compact) == 4
    for a, b in zip(plain, compact, strict=True):
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        ma, mb = a["meta_info"], b["meta_info"]
        assert "output_token_logprobs" not in mb and "output_token_weight_versions" not in mb
        floats = fast_json.unpack_floats(mb["output_token_logprobs_b64"])
        assert [struct.pack("<d", t[0]) for t in ma["output_token_logprobs"]] == [
            struct.pack("<d", v) for v in floats
        ]
        assert mb["output_token_weight_version_runs"] == [[ma["weight_version"], 9]]
        assert ma["output_token_weight_versions"] == [ma["weight_version"]] * 9
    with pytest.raises(EngineClientError) as info:
        client.generate(
            input_ids=[1, 2], return_logprob=True, compact_logprobs=True, return_text_in_logprobs=True
        )
    assert info.value.status_code == 400 and "send return_text_in_logprobs false" in info.value.message
    streamed = list(client.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 3, **GREEDY},
                                    return_logprob=True, compact_logprobs=True, stream=True))  # fmt: skip
    assert [len(fast_json.unpack_floats(c["meta_info"]["output_token_logprobs_b64"])) for c in streamed] == [
        1,
        2,
        3,
    ]


def test_generate_batch_and_n(client):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    batch = client.generate(input_ids=prompts, sampling_params={"max_new_tokens": 5, **GREEDY})
    assert [item["output_ids"] for item in batch] == [_greedy(client, p, 5)["output_ids"] for p in prompts]
    grouped = client.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "n": 2, "seed": 3},
                              rid=["grp-0", "grp-1"])  # fmt: skip
    assert len(grouped) == 4  # prompt-major: two samples of prompt 0, then two of prompt 1
    assert [item["meta_info"]["prompt_tokens"] for item in grouped] == [3, 3, 5, 5]
    assert [item["meta_info"]["id"] for item in grouped] == ["grp-0", "grp-0", "grp-1", "grp-1"]
    assert all(len(item["output_ids"]) <= 4 for item in grouped)
    single_n = client.generate(text="hi", sampling_params={"max_new_tokens": 3, "n": 3, "seed": 1})
    assert isinstance(single_n, list) and len(single_n) == 3


def test_generate_stream_is_cumulative_and_ends_with_the_full_result(client):
    chunks = list(client.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 7, **GREEDY},
                                  return_logprob=True, stream=True))  # fmt: skip
    assert len(chunks) == 7  # one per step
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6, 7]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 6
    final = _greedy(client, [3, 4, 5], 7)
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 7


def test_stop_strings_and_stop_token_ids(client, tokenizer):
    base = _greedy(client, [3, 4, 5], 10)
    text, ids = base["text"], base["output_ids"]
    out = client.generate(
        input_ids=[3, 4, 5],
        sampling_params={"max_new_tokens": 10, **GREEDY, "stop_token_ids": [ids[3]], "ignore_eos": False},
    )
    # The matched stop token ends the output; its text is trimmed (SGLang), its id and logprob are kept.
    first = ids.index(ids[3])
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
    assert out["text"] == tokenizer.decode(ids[:first])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    trimmed = client.generate(
        input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 10, **GREEDY, "stop": [stop]}
    )
    assert trimmed["text"] == text[: text.index(stop)]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


# ---------------------------------------------------------------------------------------------------
# OpenAI API through the official package


def test_openai_chat_completion_with_logprobs(oai, client, tokenizer, models):
    resp = oai.chat.completions.create(model=models[0], messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, extra_body={"ignore_eos": True})  # fmt: skip
    prompt_ids = _chat_prompt_ids(tokenizer, MESSAGES)
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 8
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    same = _greedy(client, prompt_ids, 8)
    assert choice.message.content == same["text"]
    assert [entry.token for entry in choice.logprobs.content] == [
        tokenizer.decode([t]) for t in same["output_ids"]
    ]
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert resp.model_extra["weight_version"] == client.get_weight_version()["weight_version"]


def test_openai_chat_streams_token_by_token(oai):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kwargs).choices[0].message.content
    stream = oai.chat.completions.create(
        **kwargs, stream=True, logprobs=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks[1:] if c.choices]
    assert len(token_chunks) == 9  # one chunk per generated token
    assert all(len(c.choices[0].logprobs.content) == 1 for c in token_chunks)
    assert "".join(c.choices[0].delta.content for c in token_chunks) == full
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 8 + ["length"]
    assert chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices


def test_openai_chat_n_and_tools(oai, tokenizer):
    resp = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, n=2, seed=11,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in resp.choices) == [0, 1] and resp.usage.completion_tokens == 8
    with_tools = oai.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=2,
                                             extra_body={"return_token_ids": True})  # fmt: skip
    expected = _chat_prompt_ids(tokenizer, MESSAGES, tools=[WEATHER_TOOL])
    assert with_tools.model_extra["prompt_token_ids"] == expected
    assert with_tools.usage.prompt_tokens == len(expected) > len(_chat_prompt_ids(tokenizer, MESSAGES))
    assert '"name": "get_weather"' in tokenizer.decode(expected)


def test_openai_completions_and_models(oai, client, models):
    resp = oai.completions.create(model="m", prompt="hello world", max_tokens=6, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    same = client.generate(text="hello world", sampling_params={"max_new_tokens": 6, **GREEDY})
    assert resp.choices[0].text == same["text"] and resp.usage.completion_tokens == 6
    assert len(resp.choices[0].logprobs.token_logprobs) == 6
    streamed = oai.completions.create(model="m", prompt="hello world", max_tokens=6, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == same["text"]
    assert [m.id for m in oai.models.list().data] == [models[0]]
    raw = client.completions(prompt=[[5, 6], [7, 8, 9]], max_tokens=2, temperature=0)
    assert [c["index"] for c in raw["choices"]] == [0, 1] and raw["usage"]["prompt_tokens"] == 5


# ---------------------------------------------------------------------------------------------------
# bad requests


def test_bad_requests_get_400_naming_the_field_and_serving_continues(client, oai, server):
    cases = [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
         "sampling_params.max_new_tokens must be >= 0, got -1"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
         "sampling_params.temperature must be a number, got 'hot'"),
        ({"input_ids": [1] * 5000}, "prompt has 5000 tokens; the model's context is 2048"),
        ({"input_ids": [[1, 2], [3, 99999]]}, "input_ids[1][1] = 99999 is outside the vocabulary (size 2048)"),
        ({"text": "x", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token is not a known field"),
        # a batch's list of sampling params (one per prompt)
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"temperature": "hot"}]},
         "sampling_params[1].temperature must be a number, got 'hot'"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"max_new_tokens": -2}]},
         "sampling_params[1].max_new_tokens must be >= 0, got -2"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries for a batch of 2 prompts"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {}]},
         "sampling_params[].n must be the same for every prompt, got [2, 1]"),
        ({"input_ids": [1], "sampling_params": [{}]}, "sampling_params may be a list only for a batch of prompts"),
    ]  # fmt: skip
    for body, message in cases:
        with pytest.raises(EngineClientError) as info:
            client.generate(**body)
        assert info.value.status_code == 400 and info.value.message.endswith(message), info.value.message
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be >= 0, got -1"):
        oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=-1)
    not_json = httpx.post(f"{server.url}/generate", content=b"{nope", timeout=10)
    assert not_json.status_code == 400 and not_json.json()["error"]["message"].startswith(
        "request body is not valid JSON"
    )
    assert len(_greedy(client, [1, 2, 3], 3)["output_ids"]) == 3


def test_generate_fast_path_answers_a_handler_bug_with_500_and_an_unavailable_engine_with_503(
    server, client, monkeypatch
):
    # POST /generate skips FastAPI's router (GenerateFastPath); its failures must still be the app's JSON.
    from clawrl.engine.http import generate as generate_module

    async def broken(engine, req):
        raise ZeroDivisionError("a bug in the handler")

    async def unavailable(engine, req):
        raise EngineUnavailableError("the engine thread died: injected")

    monkeypatch.setattr(generate_module, "generate", broken)
    bug = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 2]}, timeout=10)
    assert bug.status_code == 500 and bug.json()["error"] == {
        "message": "a bug in the handler",
        "type": "internal_error",
        "code": 500,
    }
    monkeypatch.setattr(generate_module, "generate", unavailable)
    down = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 2]}, timeout=10)
    assert down.status_code == 503 and down.json()["error"]["type"] == "engine_unavailable"
    assert "injected" in down.json()["message"]
    monkeypatch.undo()
    assert httpx.get(f"{server.url}/generate", timeout=10).status_code == 405  # other methods: the router's
    assert len(_greedy(client, [1, 2, 3], 3)["output_ids"]) == 3


def test_unreachable_server_is_a_clear_client_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineClientError, match=rf"GET http://127.0.0.1:{port}/health failed: ConnectError"):
        EngineClient(f"http://127.0.0.1:{port}", timeout=5).health()


# ---------------------------------------------------------------------------------------------------
# control: pause/continue, abort, weights, memory, cache


async def _collect(stream, sink: list, first: asyncio.Event):
    async for chunk in stream:
        sink.append(chunk)
        first.set()


def test_pause_in_place_holds_requests_until_continue(server):
    async def scenario():
        async with AsyncEngineClient(server.url, timeout=60) as ac:
            chunks, first = [], asyncio.Event()
            stream = await ac.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 400, **GREEDY},
                                       stream=True)  # fmt: skip
            task = asyncio.create_task(_collect(stream, chunks, first))
            await asyncio.wait_for(first.wait(), 30)
            assert (await ac.pause_generation("in_place"))["num_aborted"] == 0
            late = asyncio.create_task(ac.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 2}))
            await asyncio.sleep(0.3)
            held = len(chunks)
            await asyncio.sleep(0.7)
            assert len(chunks) == held < 400 and not late.done()  # nothing moves while paused
            assert (await ac.health_generate())["status"] == "paused"
            await ac.continue_generation()
            await asyncio.wait_for(task, 60)
            assert len((await asyncio.wait_for(late, 30))["output_ids"]) == 2
            return chunks[-1]

    final = asyncio.run(scenario())
    assert len(final["output_ids"]) == 400 and final["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_abort_and_abort_request_end_long_generations(server, client):
    async def scenario():
        async with AsyncEngineClient(server.url, timeout=60) as ac:
            long = {"max_new_tokens": 1500, **GREEDY}
            chunks, first = [], asyncio.Event()
            stream = await ac.generate(input_ids=[9, 10], sampling_params=long, stream=True, rid="long-1")
            task = asyncio.create_task(_collect(stream, chunks, first))
            await asyncio.wait_for(first.wait(), 30)
            assert (await ac.abort_request(rid="long-1"))["num_aborted"] == 1
            await asyncio.wait_for(task, 30)
            by_rid = chunks[-1]
            running = asyncio.create_task(ac.generate(input_ids=[11, 12], sampling_params=long))
            await asyncio.sleep(0.3)
            assert (await ac.pause_generation("abort"))["num_aborted"] == 1
            by_pause = await asyncio.wait_for(running, 30)
            await ac.continue_generation()
            return by_rid, by_pause

    by_rid, by_pause = asyncio.run(scenario())
    for out in (by_rid, by_pause):
        assert out["meta_info"]["finish_reason"] == {"type": "abort"}
        assert 0 < out["meta_info"]["completion_tokens"] < 1500
    assert client.abort_request(abort_all=True)["num_aborted"] == 0
    assert len(_greedy(client, [1, 2], 2)["output_ids"]) == 2


def test_client_disconnect_aborts_its_request(server, client):
    aengine = server.app.state.engine
    # 2000 tokens take seconds on CPU; an abort on disconnect ends the request within a step or two.
    body = {"input_ids": [13, 14], "sampling_params": {"max_new_tokens": 2000, **GREEDY}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=30) as response:
        # Keep the line iterator alive: dropping it would close the connection right here.
        lines = response.iter_lines()
        assert next(lines).startswith("data: ") and aengine.num_requests == 1
    deadline = time.monotonic() + 2.5
    while aengine.num_requests or aengine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request kept running after its client went away"
        time.sleep(0.05)
    assert len(_greedy(client, [1, 2], 2)["output_ids"]) == 2


def test_a_non_streaming_client_that_times_out_aborts_its_request(server, client):
    aengine = server.app.state.engine
    body = {"input_ids": [13, 15], "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{server.url}/generate", json=body, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.monotonic() + 2.5
    while aengine.num_requests or aengine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request kept running after its client went away"
        time.sleep(0.05)
    assert len(_greedy(client, [1, 2], 2)["output_ids"]) == 2


def test_weight_update_from_disk_changes_outputs_and_bumps_the_version(client, models):
    prompt = [21, 22, 23, 24]
    before = _greedy(client, prompt, 10)
    version = client.get_weight_version()["weight_version"]
    updated = client.update_weights_from_disk(models[1])
    assert updated["success"] and updated["weight_version"] == str(int(version) + 1)
    assert client.get_weight_version()["weight_version"] == updated["weight_version"]
    after = _greedy(client, prompt, 10)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == updated["weight_version"]
    restored = client.update_weights_from_disk(models[0], weight_version="a-again")
    assert restored["weight_version"] == "a-again"
    again = _greedy(client, prompt, 10)
    assert again["output_ids"] == before["output_ids"] and again["meta_info"]["weight_version"] == "a-again"
    with pytest.raises(EngineClientError) as info:
        client.update_weights_from_disk(models[0] + "-missing")
    assert info.value.status_code == 400 and models[0] + "-missing" in info.value.message
    assert client.get_weight_version()["weight_version"] == "a-again"


def test_weight_update_while_paused_in_place_versions_each_token(server, client, models):
    async def scenario():
        async with AsyncEngineClient(server.url, timeout=60) as ac:
            chunks, first = [], asyncio.Event()
            stream = await ac.generate(input_ids=[30, 31], sampling_params={"max_new_tokens": 300, **GREEDY},
                                       return_logprob=True, stream=True)  # fmt: skip
            task = asyncio.create_task(_collect(stream, chunks, first))
            await asyncio.wait_for(first.wait(), 30)
            await ac.pause_generation("in_place")
            new_version = (await ac.update_weights_from_disk(models[1], weight_version="b-live"))[
                "weight_version"
            ]
            await ac.continue_generation()
            await asyncio.wait_for(task, 60)
            await ac.update_weights_from_disk(models[0], weight_version="a-back")
            return chunks[-1], new_version

    final, new_version = asyncio.run(scenario())
    versions = final["meta_info"]["output_token_weight_versions"]
    assert len(versions) == 300 and versions[-1] == new_version == final["meta_info"]["weight_version"]
    old = versions[0]
    switch = versions.index(new_version)
    assert switch > 0 and set(versions[:switch]) == {old} and set(versions[switch:]) == {new_version}
    assert client.get_weight_version()["weight_version"] == "a-back"


def test_release_resume_keeps_outputs_and_holds_requests(client, server):
    prompt = [40, 41, 42]
    before = _greedy(client, prompt, 8)
    assert client.release_memory_occupation()["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert client.health_generate()["status"] == "released"
    result: dict = {}
    waiting = threading.Thread(
        target=lambda: result.update(out=_greedy(EngineClient(server.url, 60), prompt, 8))
    )
    waiting.start()
    time.sleep(0.5)
    assert "out" not in result  # requests wait while memory is released
    # slime's order: weights first (then a weight update would come), then KV cache and CUDA graphs.
    assert client.resume_memory_occupation(["weights"])["released"] == ["cuda_graph", "kv_cache"]
    assert client.resume_memory_occupation(["kv_cache", "cuda_graph"])["released"] == []
    waiting.join(30)
    assert result["out"]["output_ids"] == before["output_ids"]
    assert _greedy(client, prompt, 8)["output_ids"] == before["output_ids"]


def test_flush_cache_drops_the_prefix_cache(client):
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks can be reused
    _greedy(client, prompt, 2)
    assert _greedy(client, prompt, 2)["meta_info"]["cached_tokens"] == 32
    assert client.flush_cache()["success"]
    assert _greedy(client, prompt, 2)["meta_info"]["cached_tokens"] == 0


# ---------------------------------------------------------------------------------------------------
# deadlines and the CLI


def test_stuck_step_fails_requests_with_a_stack_dump(models, capfd):
    engine = Engine(EngineConfig(model_path=models[0], device="cpu", dtype="float32"))
    release = threading.Event()
    real_step = engine.step

    def stuck_step():  # fault injection: the real step, after a hang the watchdog must catch
        release.wait(30)
        return real_step()

    engine.step = stuck_step
    aengine = AsyncEngine(engine, step_timeout_s=0.5, watchdog_poll_s=0.05)

    async def scenario():
        aengine.start()
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError, match=r"'step' has run for .* step_timeout_s=0.5 s"):
            await aengine.generate_full([1, 2, 3], SamplingParams(max_new_tokens=4))
        assert time.monotonic() - started < 10
        assert not aengine.is_alive
        with pytest.raises(EngineUnavailableError):
            await aengine.generate_full([1, 2, 3], SamplingParams(max_new_tokens=4))

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        aengine.shutdown()
    assert "stuck_step" in capfd.readouterr().err  # faulthandler's dump names the hanging frame


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_engine_serves_health_and_rejects_a_bad_model_path(models, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "engine", "--model-path", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2
    assert (
        bad.stderr.strip().splitlines()[-1]
        == f"clawrl engine: error: --model-path '{tmp_path / 'nope'}' does not exist"
    )
    port = _free_port()
    cmd = [sys.executable, "-m", "clawrl.cli.main", "engine", "--model-path", models[0], "--port", str(port),
           "--device", "cpu", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                health = EngineClient(f"http://127.0.0.1:{port}", timeout=5).health()
                break
            except EngineClientError:
                assert time.monotonic() < deadline, "clawrl engine did not answer /health within 60 s"
                time.sleep(0.3)
        assert health == {"status": "ok", "weight_version": "0"}
        cli_client = EngineClient(f"http://127.0.0.1:{port}", timeout=30)
        out = cli_client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 3, **GREEDY})
        assert out["meta_info"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)
