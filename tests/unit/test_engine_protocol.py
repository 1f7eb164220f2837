"""Request validation of the engine's HTTP API: every bad field gives one message naming it and its value."""

import re

import pytest

from clawrl.engine.core.request import RequestError, check_prompt
from clawrl.engine.http.app import AbortRequest, PauseGenerationRequest
from clawrl.engine.http.generate import GenerateRequest, parse_request
from clawrl.engine.http.openai import ChatCompletionRequest, CompletionRequest


def _error(model, body) -> str:
    with pytest.raises(RequestError) as info:
        parse_request(model, body)
    return str(info.value)


@pytest.mark.parametrize(
    "sampling_params, message",
    [
        ({"max_new_tokens": -1}, "sampling_params.max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": "8"}, "sampling_params.max_new_tokens must be an integer, got '8'"),
        ({"max_new_tokens": 2.5}, "sampling_params.max_new_tokens must be an integer, got 2.5"),
        ({"temperature": "hot"}, "sampling_params.temperature must be a number, got 'hot'"),
        ({"temperature": -0.5}, "sampling_params.temperature must be >= 0 (0 means greedy), got -0.5"),
        ({"top_p": 1.5}, "sampling_params.top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "sampling_params.top_k must be -1 or 0 (off) or >= 1, got -2"),
        ({"min_p": 1.0}, "sampling_params.min_p must be in [0, 1), got 1.0"),
        ({"n": 0}, "sampling_params.n must be >= 1, got 0"),
        ({"ignore_eos": "yes"}, "sampling_params.ignore_eos must be true or false, got 'yes'"),
        ({"stop": 5}, "sampling_params.stop must be a string or a list of strings, got 5"),
        ({"stop_token_ids": [3, -1]}, "sampling_params.stop_token_ids must hold token ids >= 0, got -1"),
        ({"max_new_token": 3}, "sampling_params.max_new_token is not a known field"),
        (
            {"repetition_penalty": 0},
            "sampling_params.repetition_penalty must be > 0 (1 = off), got 0.0",
        ),
        ({"regex": "a+"}, "sampling_params.regex (constrained decoding) is not supported by this engine"),
    ],
)
def test_generate_sampling_param_errors_name_the_field(sampling_params, message):
    assert _error(GenerateRequest, {"input_ids": [1, 2], "sampling_params": sampling_params}) == message


def test_generate_reports_every_bad_field_in_one_message():
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": -1, "top_p": 0.0}}
    assert _error(GenerateRequest, body) == (
        "sampling_params.top_p must be in (0, 1], got 0.0; sampling_params.max_new_tokens must be >= 0, got -1"
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "exactly one of text or input_ids must be given"),
        ({"text": "a", "input_ids": [1]}, "exactly one of text or input_ids must be given"),
        ({"text": 3}, "text must be a string or a non-empty list of strings, got 3"),
        (
            {"input_ids": [1, "a"]},
            "input_ids must be a non-empty list of integer token ids or a list of such lists, got [1, 'a']",
        ),
        (
            {"input_ids": []},
            "input_ids must be a non-empty list of integer token ids or a list of such lists, got []",
        ),
        ({"input_ids": [[1], [2]], "rid": "x"}, "rid must be a list of strings for a batch request, got 'x'"),
        ({"input_ids": [[1], [2]], "rid": ["x"]}, "rid has 1 ids for a batch of 2 prompts"),
        (
            {"input_ids": [[1], [2]], "rid": ["x", "x"]},
            "rid must not repeat an id within a batch, got ['x', 'x']",
        ),
        ({"input_ids": [1], "return_logprob": 1}, "return_logprob must be true or false, got 1"),
        (
            {"input_ids": [1], "top_logprobs_num": -5},
            "top_logprobs_num must be >= 0, got -5",
        ),
        ({"input_ids": [1], "foo": 1}, "foo is not a known field"),
    ],
)
def test_generate_request_errors(body, message):
    assert _error(GenerateRequest, body) == message


def test_generate_request_normalises_prompts_and_params():
    req = parse_request(GenerateRequest, {"input_ids": [[1, 2], [3]], "rid": ["a", "b"],
                                          "sampling_params": {"stop": "\n", "max_new_tokens": 7, "n": 2}})  # fmt: skip
    assert req.is_batch and req.prompts == [[1, 2], [3]] and req.request_ids() == ["a", "b"]
    assert req.prompt_field == "input_ids"
    params = req.sampling_params.sampling_params(5)
    assert (params.max_new_tokens, params.stop, params.n, params.temperature) == (5, ["\n"], 2, 1.0)
    single = parse_request(GenerateRequest, {"text": "hi", "sampling_params": {"max_new_tokens": None}})
    assert not single.is_batch and single.prompts == ["hi"] and single.sampling_params.max_new_tokens is None
    # slime's default sampling params pass (spaces_between_special_tokens is accepted and has no effect).
    parse_request(GenerateRequest, {"input_ids": [1], "sampling_params": {"spaces_between_special_tokens": False,
                                                                         "no_stop_trim": True}})  # fmt: skip


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "messages is required"),
        ({"messages": []}, "messages must hold at least one message"),
        ({"messages": "hi"}, "messages must be a list, got 'hi'"),
        ({"messages": [{"role": "robot", "content": "x"}]},
         "messages[0].role must be one of system, user, assistant, tool, developer, got 'robot'"),
        ({"messages": [{"role": "user", "content": 5}]},
         "messages[0].content must be a string or a list of text parts, got 5"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0] must be a text part {\"type\": \"text\", \"text\": ...}, got {'type': 'image_url'}"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens must be >= 0, got -1"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "many"},
         "max_completion_tokens must be an integer, got 'many'"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "warm"},
         "temperature must be a number, got 'warm'"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n must be >= 1, got 0"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5},
         "frequency_penalty must be in [-2, 2], got 2.5"),
    ],
)  # fmt: skip
def test_chat_request_errors(body, message):
    assert _error(ChatCompletionRequest, body) == message


def test_chat_request_ignores_unknown_openai_fields_and_joins_text_parts():
    req = parse_request(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
        "parallel_tool_calls": True, "metadata": {"k": "v"}, "max_tokens": 4, "max_completion_tokens": 3,
        "stop": ["x", ""], "stream_options": {"include_usage": True},
    })  # fmt: skip
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.max_new_tokens == 3  # max_completion_tokens wins over the deprecated max_tokens
    assert req.stop == ["x"] and req.include_usage


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": 3}, "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                        "lists, got 3"),
        ({"prompt": "x", "logprobs": 21}, "logprobs must be in [0, 20] (top alternatives per token), got 21"),
        ({"prompt": "x", "echo": True}, "echo is not supported by this engine"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens must be >= 0, got -3"),
    ],
)  # fmt: skip
def test_completion_request_errors(body, message):
    assert _error(CompletionRequest, body) == message


def test_completion_prompts():
    assert parse_request(CompletionRequest, {"prompt": [5, 6]}).prompts == [[5, 6]]
    assert parse_request(CompletionRequest, {"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_request(CompletionRequest, {"prompt": [[5], [6, 7]]}).prompts == [[5], [6, 7]]
    assert parse_request(CompletionRequest, {"prompt": "a"}).max_tokens == 16  # OpenAI's default


def test_control_request_errors():
    assert _error(PauseGenerationRequest, {"mode": "later"}) == (
        "mode must be one of 'abort', 'in_place' or 'retract', got 'later'"
    )
    assert _error(AbortRequest, {}) == 'give rid ("...") or abort_all (true)'
    assert parse_request(PauseGenerationRequest, {}).mode == "abort"  # SGLang's default
    assert _error(GenerateRequest, [1, 2]) == "request body must be a JSON object, got list"


def test_check_prompt_fits_the_context():
    kwargs = {"field": "input_ids", "vocab_size": 100, "context_len": 2048}
    with pytest.raises(RequestError, match=r"^prompt has 5000 tokens; the model's context is 2048$"):
        check_prompt([1] * 5000, max_new_tokens=8, **kwargs)
    with pytest.raises(RequestError, match=r"^prompt has 2048 tokens; the model's context is 2048 \(no room"):
        check_prompt([1] * 2048, max_new_tokens=8, **kwargs)
    with pytest.raises(RequestError, match=r"^input_ids\[2\] = 100 is outside the vocabulary \(size 100\)$"):
        check_prompt([1, 2, 100], max_new_tokens=8, **kwargs)
    with pytest.raises(RequestError, match=r"^input_ids is empty"):
        check_prompt([], max_new_tokens=8, **kwargs)
    assert check_prompt([1] * 2000, max_new_tokens=8, **kwargs) == 8
    assert check_prompt([1] * 2000, max_new_tokens=100, **kwargs) == 48  # clamped to the context, like SGLang
    assert check_prompt([1] * 2000, max_new_tokens=-1, **kwargs) == 48  # -1: as many as fit


# --- the default-value shortcut of the rule table ---------------------------------------------------------


def test_every_default_passes_its_own_rule():
    # The rule table skips a value equal to its field's default (same type): only sound if the default passes.
    from clawrl.engine.core.request import _PASSING, _RULES

    assert set(_PASSING) == set(_RULES)
    for name, (_, default) in _PASSING.items():
        assert _RULES[name](default) is None, name


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_p", True, "sampling_params.top_p must be a number, got True"),  # True == 1.0, the default
        ("temperature", float("nan"), "sampling_params.temperature must be a number, got nan"),
        ("n", 1.0, "sampling_params.n must be an integer, got 1.0"),  # 1.0 == 1, the default
        ("ignore_eos", 0, "sampling_params.ignore_eos must be true or false, got 0"),  # 0 == False
        ("min_p", 0, None),  # an int of the default's value still goes through the rule, and passes
    ],
)
def test_a_value_equal_to_the_default_but_of_another_type_is_still_checked(field, value, message):
    from clawrl.engine.core.request import SamplingParams

    params = SamplingParams(**{field: value})
    if message is None:
        params.validate()
        return
    with pytest.raises(RequestError, match=f"^{re.escape(message)}$"):
        params.validate()


def test_answer_logprob_triples_are_json_arrays_and_lengths_must_agree():
    from clawrl import fast_json
    from clawrl.engine.core.request import GenerationResult
    from clawrl.engine.http.generate import generate_item

    req = parse_request(GenerateRequest, {"input_ids": [1, 2], "return_logprob": True})
    result = GenerationResult(request_id="r", index=0, output_ids=[5, 7], logprobs=[-0.25, -1.5],
                              weight_versions=["3", "3"], finish_reason={"type": "length", "length": 2})  # fmt: skip
    item = fast_json.loads(fast_json.dumps(generate_item(result, req, None, 0.0)))
    assert item["meta_info"]["output_token_logprobs"] == [[-0.25, 5, None], [-1.5, 7, None]]
    assert item["output_ids"] == [5, 7] and item["meta_info"]["output_token_weight_versions"] == ["3", "3"]
    compact = parse_request(
        GenerateRequest, {"input_ids": [1, 2], "return_logprob": True, "compact_logprobs": True}
    )
    meta = fast_json.loads(fast_json.dumps(generate_item(result, compact, None, 0.0)))["meta_info"]
    assert fast_json.unpack_floats(meta["output_token_logprobs_b64"]) == [-0.25, -1.5]
    assert meta["output_token_weight_version_runs"] == [["3", 2]]
    result.logprobs.append(-2.0)  # an engine bug: one logprob too many must not be cut off silently
    for request in (req, compact):
        with pytest.raises(ValueError, match="request r: 3 logprobs for 2 tokens"):
            generate_item(result, request, None, 0.0)
