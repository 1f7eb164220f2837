"""The OpenAI chat layer's parsing of a finished assistant turn: tool calls in Qwen's format (through
clawrl/rollout/tool_parse.py) and Llama 3's, the `<think>` reasoning split, and the finish reason."""

import json

from clawrl.engine.http.openai import assistant_message, parse_tool_call_text, split_reasoning


def test_qwen_tool_calls_keep_the_text_before_them_as_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_call_text(text)
    assert content == "Let me check."
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "get_weather", {"city": "Paris"})]


def test_llama3_json_tool_calls_with_parameters():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", "parameters": {}}'
    content, calls = parse_tool_call_text(text)
    assert content == ""
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "add", {"a": 1, "b": 2}), (1, "now", {})]


def test_text_that_is_not_a_valid_call_stays_content():
    for text in ("The answer is 4.", '<tool_call>{"name": 3}</tool_call>', '{"answer": 4}', "{not json"):
        assert parse_tool_call_text(text) == (text, [])


def test_reasoning_split():
    assert split_reasoning("<think>a\nb</think>\n\nThe answer.") == ("a\nb", "The answer.")
    assert split_reasoning("thinking in the prompt's tag</think>Done") == (
        "thinking in the prompt's tag",
        "Done",
    )
    assert split_reasoning("<think>cut off mid-thought") == ("cut off mid-thought", "")
    assert split_reasoning("No reasoning.") == (None, "No reasoning.")


def test_assistant_message_with_reasoning_and_a_tool_call():
    text = '<think>need data</think><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    message, finish = assistant_message(text, {"type": "stop", "matched": 2}, tools=True, reasoning=True)
    assert (
        finish == "tool_calls" and message["content"] is None and message["reasoning_content"] == "need data"
    )
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"x": 1}
    # Without tools in the request the text is left alone; a turn cut by the length limit keeps "length".
    assert assistant_message(text, {"type": "stop"}, tools=False, reasoning=False) == (
        {"role": "assistant", "content": text}, "stop",
    )  # fmt: skip
    assert assistant_message(text, {"type": "length"}, tools=True, reasoning=False)[1] == "length"
