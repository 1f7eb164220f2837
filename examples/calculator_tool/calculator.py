"""A calculator tool environment for clawrl's multi-turn tool rollouts, and the reward that goes with it.

The model answers arithmetic questions and may call a `calculator` tool on the way:

    clawrl train --hf-checkpoint MODEL --prompt-data train.jsonl --input-key messages --label-key label \\
        --custom-generate-function-path clawrl.rollout.multi_turn.generate \\
        --custom-env-path examples/calculator_tool/calculator.py:CalculatorEnv \\
        --custom-rm-path examples/calculator_tool/calculator.py:reward \\
        --max-turns 3 --tool-call-timeout 5 --rollout-max-response-len 256 ...

Each prompt row holds chat messages (`messages`) and the expected number (`label`); the tool schema comes
from `CalculatorEnv.tools` (or a `tools` column, --tool-key). The reward is 1 when the episode ended with an
answer (not at a limit) whose last number equals the label, else 0. docs/multi_turn.md explains the plugin
interface.
"""

from __future__ import annotations

import ast
import operator
import re

from clawrl.rollout.multi_turn import EnvStep

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 8"}},
            "required": ["expression"],
        },
    },
}

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPONENT = 100  # keeps 9 ** 9 ** 9 from freezing the rollout
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, huge powers)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def format_number(value: float | int) -> str:
    """56.0 -> '56'; other floats keep up to 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0")


class CalculatorEnv:
    """One instance per sample; stateless apart from counting the calls it served."""

    tools = [CALCULATOR_TOOL]

    def __init__(self, args) -> None:
        self.num_calls = 0

    def reset(self, sample) -> None:
        self.num_calls = 0

    def step(self, calls) -> EnvStep:
        outputs = []
        for call in calls:
            self.num_calls += 1
            if call.name != "calculator":
                outputs.append(ValueError(f"unknown tool {call.name!r}; the only tool is 'calculator'"))
                continue
            try:
                outputs.append(format_number(evaluate(str(call.arguments.get("expression", "")))))
            except ValueError as exc:
                outputs.append(exc)  # this call fails; the model reads "Error: ValueError: ..."
        return EnvStep(outputs=outputs)


async def reward(args, sample, **kwargs) -> float:
    """1.0 when the episode ended with an answer whose last number equals the label, else 0.0."""
    episode = sample.metadata.get("multi_turn", {})
    if episode.get("stop_reason") != "answer":
        return 0.0
    messages = episode.get("messages", [])
    finals = [m["content"] for m in messages if m["role"] == "assistant"]
    numbers = _NUMBER.findall(finals[-1]) if finals else []
    if not numbers or sample.label is None:
        return 0.0
    return 1.0 if abs(float(numbers[-1]) - float(sample.label)) < 1e-6 else 0.0
