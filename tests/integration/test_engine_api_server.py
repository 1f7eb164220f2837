"""The generation features of the HTTP routes, against a real server on 127.0.0.1 (tiny fp32 model, CPU):
SGLang `/generate` input / top logprobs (teacher scoring with max_new_tokens=0) and n > 1; the OpenAI routes'
logprobs / top_logprobs, penalties, logit_bias, n, `/v1/models`; and tool calls + reasoning through the
official `openai` client, from a tiny model fine-tuned here (a few dozen Adam steps) to answer one
tools-rendered prompt with `<think>...</think>` and a `<tool_call>`."""

import httpx
import openai
import pytest
import torch
from cpu_server import cpu_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = '<think>look it up</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
PROMPT_IDS = [5, 17, 240, 33, 1000, 7, 81]

pytestmark = pytest.mark.slow  # the fine-tuning fixture takes ~30 s on 2 busy cores


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model that answers MESSAGES (with WEATHER_TOOL rendered) by ANSWER, greedily."""
    path = str(tmp_path_factory.mktemp("api-server") / "m")
    build_tiny_model(
        path, vocab_size=2048, seed=0, tokenizer=build_tiny_tokenizer(2048), tie_word_embeddings=False
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        MESSAGES, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = torch.tensor([prompt_ids + tokenizer.encode(ANSWER, add_special_tokens=False)])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    torch.manual_seed(0)
    for _ in range(150):
        output = model(ids, labels=labels)
        if _greedy_margin(output.logits[0, len(prompt_ids) - 1 : -1], ids[0, len(prompt_ids) :]) > 1.0:
            break  # greedy decoding now writes ANSWER, with a margin no rounding can flip
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
    else:
        pytest.fail("fine-tuning did not make ANSWER the greedy continuation in 150 steps")
    model.save_pretrained(path)
    return path


def _greedy_margin(logits_TV: torch.Tensor, targets_T: torch.Tensor) -> float:
    """Smallest gap between each target token's logit and the best other token's (< 0: greedy differs)."""
    target = logits_TV.gather(1, targets_T.unsqueeze(1)).squeeze(1)
    others = logits_TV.scatter(1, targets_T.unsqueeze(1), float("-inf")).max(dim=1).values
    return (target - others).min().item()


@pytest.fixture(scope="module")
def server(model_dir):
    with cpu_server(model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_openai_client_parses_tool_calls_and_reasoning(client):
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER_TOOL], temperature=0, max_tokens=64,
        extra_body={"separate_reasoning": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "look it up"
    # Without the reasoning split, the text before the call is the message content.
    plain = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER_TOOL], temperature=0)
    assert plain.choices[0].message.content == "<think>look it up</think>"
    assert plain.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_streamed_tool_call_arrives_parsed_in_the_last_chunk(client):
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER_TOOL], temperature=0, stream=True,
        extra_body={"separate_reasoning": True},
    ))  # fmt: skip
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert last.delta.tool_calls[0].function.name == "get_weather"
    assert last.delta.model_extra["reasoning_content"] == "look it up"


def test_generate_scores_a_prompt_like_a_manual_forward(server, model_dir):
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}  # fmt: skip
    item = _post(server, "/generate", body)
    meta = item["meta_info"]
    assert item["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([PROMPT_IDS])).logits[0], dim=-1)
    assert meta["input_token_logprobs"][0] == [None, PROMPT_IDS[0], None]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT_IDS
    want = [expected[p - 1, PROMPT_IDS[p]].item() for p in range(1, len(PROMPT_IDS))]
    assert [lp for lp, _, _ in meta["input_token_logprobs"][1:]] == pytest.approx(want, abs=1e-5)
    assert meta["input_top_logprobs"][0] is None
    values, ids = expected[2].topk(2)
    assert [[lp, t] for lp, t, _ in meta["input_top_logprobs"][3]] == [
        [pytest.approx(v, abs=1e-5), i] for v, i in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def test_generate_n_samples_each_report_the_prompt_logprobs_and_top_tokens(server):
    body = {"input_ids": PROMPT_IDS, "return_logprob": True, "logprob_start_len": 4, "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0.8, "seed": 7, "ignore_eos": True}}  # fmt: skip
    items = _post(server, "/generate", body)
    assert len(items) == 2
    assert items[0]["meta_info"]["input_token_logprobs"] == items[1]["meta_info"]["input_token_logprobs"]
    for item in items:
        meta = item["meta_info"]
        assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT_IDS[4:]
        assert len(meta["output_top_logprobs"]) == 3 and all(
            len(top) == 3 for top in meta["output_top_logprobs"]
        )
        for (logprob, _token, text), top in zip(
            meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
        ):
            assert isinstance(text, str)
            # Sampled at T = 0.8: its logprob is that of the same distribution the top list ranks.
            assert top[0][0] >= logprob - 1e-6 and top == sorted(top, key=lambda e: -e[0])


def test_openai_logprobs_penalties_and_n(client, server):
    chat = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2, n=3,
        frequency_penalty=1.0, presence_penalty=0.5,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1, 2]
    ids = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=4, frequency_penalty=1.0, presence_penalty=0.5,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    # The same request through /generate: same tokens, and the chat top_logprobs equal its top lists.
    prompt_ids = ids.model_extra["prompt_token_ids"]
    sampled = _post(server, "/generate", {
        "input_ids": prompt_ids, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5},
    })  # fmt: skip
    assert ids.choices[0].model_extra["token_ids"] == sampled["output_ids"]
    content = chat.choices[0].logprobs.content
    for entry, top in zip(content, sampled["meta_info"]["output_top_logprobs"], strict=True):
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx([lp for lp, _, _ in top])
    completion = client.completions.create(model="m", prompt=PROMPT_IDS, max_tokens=2, logprobs=2, temperature=0,
                                           logit_bias={"77": 100})  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert completion.choices[0].model_extra.get("token_ids") is None
    assert len(logprobs.top_logprobs) == 2 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert all(
        max(top.values()) == lp
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True)
    )


def test_models_lists_the_served_model(client, server):
    (model,) = client.models.list().data
    assert model.id == server.app.state.engine.served_model_name and model.object == "model"


def test_penalty_values_are_checked_with_the_route_field_names(server):
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": MESSAGES, "presence_penalty": 5, "min_tokens": -1})  # fmt: skip
    assert response.status_code == 400
    assert (
        "presence_penalty must be in [-2, 2], got 5" in response.text
        and "min_tokens must be >= 0" in response.text
    )
