"""Tool calls in a model turn, in the format of Qwen2.5 / Qwen3 chat templates (the "Hermes" format).

The model writes each call as a JSON object between tags, anywhere in its turn:

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "7 * 8"}}
    </tool_call>

`parse_tool_calls(text)` returns one entry per `<tool_call>` tag, in order: a `ToolCall` when the block is a
JSON object with a string "name" and an "arguments" object (or a JSON string holding one; absent means {}),
else a `MalformedToolCall` saying what is wrong. A malformed call never raises: the multi-turn generate
function (clawrl/rollout/multi_turn.py) answers it with an error message to the model, which is how a
policy learns the format. Other formats (Llama 3 JSON without tags, Mistral `[TOOL_CALLS]`) are not parsed.

    calls = parse_tool_calls(text)
    [c.name for c in calls if isinstance(c, ToolCall)]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
EXPECTED_FORMAT = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


@dataclass(kw_only=True)
class ToolCall:
    """One well-formed call."""

    index: int
    """Position among the turn's `<tool_call>` blocks (0-based)."""
    name: str
    """Name of the tool to run."""
    arguments: dict[str, Any]
    """Keyword arguments of the call (a JSON object)."""


@dataclass(kw_only=True)
class MalformedToolCall:
    """A `<tool_call>` block that cannot be run."""

    index: int
    """Position among the turn's `<tool_call>` blocks (0-based)."""
    raw: str
    """The text after the opening tag (up to the closing tag, if any)."""
    error: str
    """What is wrong, phrased for the model (it is sent back as the tool's output)."""


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every `<tool_call>` block of `text`, in order (see the module docstring); [] when there is none."""
    calls: list[ToolCall | MalformedToolCall] = []
    start = text.find(TOOL_CALL_OPEN)
    while start != -1:
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        index = len(calls)
        if close == -1 or (next_open != -1 and next_open < close):
            end = len(text) if next_open == -1 else next_open
            calls.append(
                MalformedToolCall(
                    index=index,
                    raw=text[body_start:end],
                    error=f"tool call {index} is not closed with {TOOL_CALL_CLOSE}",
                )
            )
            start = next_open
            continue
        calls.append(_parse_body(text[body_start:close], index))
        start = text.find(TOOL_CALL_OPEN, close + len(TOOL_CALL_CLOSE))
    return calls


def _parse_body(raw: str, index: int) -> ToolCall | MalformedToolCall:
    def bad(error: str) -> MalformedToolCall:
        return MalformedToolCall(index=index, raw=raw, error=f"tool call {index} {error}")

    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return bad(f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
    if not isinstance(data, dict):
        return bad(f"must be a JSON object, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return bad('needs a "name" string')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI-style: the arguments object serialised as a string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return bad(f'has "arguments" that are not valid JSON ({exc.msg})')
    if not isinstance(arguments, dict):
        return bad(f'needs "arguments" to be a JSON object, got {type(arguments).__name__}')
    return ToolCall(index=index, name=name.strip(), arguments=arguments)
