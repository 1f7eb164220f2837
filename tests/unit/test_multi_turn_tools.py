"""Multi-turn tool rollouts without an engine: the tool-call parser, the tool turn's tokens and the prefix check
with the tiny tokenizer's real chat template, tool execution (errors, timeouts), metrics and the flags.

The engine-backed episode tests are in tests/integration/test_multi_turn_episodes.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from clawrl.config.errors import ConfigError
from clawrl.config.plugins import PluginError
from clawrl.config.rollout import RolloutConfig
from clawrl.data.chat import ChatTemplateError, render_chat, tokenize_conversation
from clawrl.data.sample import Sample
from clawrl.models.tiny import CHAT_TEMPLATE, build_tiny_tokenizer
from clawrl.rollout import multi_turn
from clawrl.rollout.multi_turn import Conversation, EnvStep, EpisodeStats, multi_turn_metrics
from clawrl.rollout.tool_parse import MalformedToolCall, ToolCall, parse_tool_calls

CALCULATOR = Path(__file__).resolve().parents[2] / "examples" / "calculator_tool" / "calculator.py"


def _calculator():
    spec = importlib.util.spec_from_file_location("calculator_example_unit", CALCULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


calculator = _calculator()
TOOLS = [calculator.CALCULATOR_TOOL]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 8"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(2048)


# ---------------------------------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------------------------------
def test_parse_well_formed_calls_in_order():
    text = (
        "Let me compute.\n" + CALL + "\n"
        '<tool_call>{"name": " lookup ", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call> done'
    )
    assert parse_tool_calls(text) == [
        ToolCall(index=0, name="calculator", arguments={"expression": "7 * 8"}),
        ToolCall(index=1, name="lookup", arguments={"q": "x"}),  # JSON-string arguments, name stripped
        ToolCall(index=2, name="now", arguments={}),  # no arguments
    ]
    assert parse_tool_calls("The answer is 56.") == []
    assert parse_tool_calls("stray </tool_call> only") == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            '{"name": "calculator", "arguments": {"expression": "7 * 8"}',
            "is not valid JSON (Expecting ',' delimiter",
        ),
        ('["calculator"]', "must be a JSON object, got list"),
        ('{"arguments": {}}', 'needs a "name" string'),
        ('{"name": "", "arguments": {}}', 'needs a "name" string'),
        ('{"name": "f", "arguments": [1]}', 'needs "arguments" to be a JSON object, got list'),
        ('{"name": "f", "arguments": "{oops"}', 'has "arguments" that are not valid JSON'),
    ],
)
def test_malformed_call_is_reported_not_raised(body, error):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, MalformedToolCall)
    assert call.index == 0 and call.raw == body
    assert call.error.startswith(f"tool call 0 {error}")


def test_unclosed_calls():
    calls = parse_tool_calls(
        '<tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call><tool_call>{"name"'
    )
    assert [type(c) for c in calls] == [MalformedToolCall, ToolCall, MalformedToolCall]
    assert (
        calls[0].error == "tool call 0 is not closed with </tool_call>" and calls[0].raw == '{"name": "a"} '
    )
    assert calls[1] == ToolCall(index=1, name="b", arguments={})
    assert calls[2].error == "tool call 2 is not closed with </tool_call>" and calls[2].raw == '{"name"'


# ---------------------------------------------------------------------------------------------------------------
# tool-turn tokens and the prefix check, with the tiny tokenizer's chat template
# ---------------------------------------------------------------------------------------------------------------
def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _messages():
    return [
        {"role": "user", "content": "What is 7 * 8?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "56"},
        {"role": "assistant", "content": "56"},
    ]


def test_tool_turn_tokens_extend_the_conversation_like_the_template(tokenizer):
    multi_turn._checked_templates.clear()
    sample = Sample(prompt=[{"role": "user", "content": "What is 7 * 8?"}])
    chat = Conversation.open(tokenizer, sample, TOOLS, args=None)
    full_ids, full_mask = tokenize_conversation(tokenizer, _messages(), TOOLS)
    prompt_text = render_chat(tokenizer, _messages()[:1], TOOLS, add_generation_prompt=True)
    assert chat.prompt_ids == _ids(tokenizer, prompt_text)

    turn = _ids(tokenizer, CALL + "<|im_end|>")
    text, ended = chat.add_assistant(turn)
    assert (text, ended) == (CALL, True)
    tool_ids = chat.add_tool_turn([_messages()[2]], ended)
    # by hand: the "\n" after <|im_end|>, the tool turn, and the next generation prompt
    expected = "\n<|im_start|>user\n<tool_response>\n56\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tool_ids == _ids(tokenizer, expected)
    stream = chat.prompt_ids + turn + tool_ids
    assert stream == full_ids[: len(stream)]
    # the mask the rollout gives (1 on model tokens, 0 on tool tokens) is the conversation's loss mask
    assert [1] * len(turn) + [0] * len(tool_ids) == full_mask[len(chat.prompt_ids) : len(stream)]
    assert len(multi_turn._checked_templates) == 1  # checked once, remembered for the process


def test_turn_stopped_before_end_of_turn_gets_it_as_a_tool_token(tokenizer):
    """With --rollout-stop '</tool_call>' the model stops before <|im_end|>: the template's closing of the
    turn is appended with the tool turn, as tokens the model did not produce."""
    chat = Conversation.open(tokenizer, Sample(prompt="What is 7 * 8?"), TOOLS, args=None)
    text, ended = chat.add_assistant(_ids(tokenizer, CALL))
    assert (text, ended) == (CALL, False)
    tool_ids = chat.add_tool_turn([{"role": "tool", "content": "56"}], ended)
    assert tokenizer.decode(tool_ids) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n56\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_rendered_text_prompt_uses_a_stand_in_for_tool_turns(tokenizer):
    prompt = render_chat(tokenizer, _messages()[:1], TOOLS, add_generation_prompt=True)
    chat = Conversation.open(tokenizer, Sample(prompt=prompt), None, args=_Args(apply_chat_template=True))
    assert chat.prompt_ids == _ids(tokenizer, prompt)
    chat.add_assistant(_ids(tokenizer, CALL + "<|im_end|>"))
    tool_ids = chat.add_tool_turn([{"role": "tool", "content": "56"}], True)
    assert tokenizer.decode(tool_ids).startswith("\n<|im_start|>user\n<tool_response>\n56\n")


class _Args:
    def __init__(self, **values):
        self.__dict__.update(values)


def _drops_earlier_thinking(tokenizer):
    """The tiny tokenizer with a Qwen3-like flaw: earlier assistant turns lose their <think> block."""
    broken = build_tiny_tokenizer(2048)
    body = "{{- '<|im_start|>assistant\\n' + text(message.content) -}}"
    assert body in CHAT_TEMPLATE
    broken.chat_template = CHAT_TEMPLATE.replace(
        body,
        "{%- set shown = text(message.content) if loop.last else text(message.content).split('</think>')[-1] -%}"
        "{{- '<|im_start|>assistant\\n' + shown -}}",
    )
    return broken


def test_prefix_check_names_the_template_problem(tokenizer):
    multi_turn._checked_templates.clear()
    broken = _drops_earlier_thinking(tokenizer)
    chat = Conversation.open(broken, Sample(prompt="What is 7 * 8?"), TOOLS, args=None)
    chat.add_assistant(_ids(broken, "<think>\nmultiply\n</think>" + CALL + "<|im_end|>"))
    with pytest.raises(ChatTemplateError) as info:
        chat.add_tool_turn([{"role": "tool", "content": "56"}], True)
    message = str(info.value)
    assert "clawrl.rollout.multi_turn.generate: the tokenizer's chat template cannot be used" in message
    assert "not prefix-stable" in message and "<think>" in message
    assert not multi_turn._checked_templates  # a failed check is not remembered as passed


def test_prefix_check_each_turn_after_the_first(tokenizer):
    """Once the check passed, a later conversation that breaks the prefix still fails with the position."""
    broken = _drops_earlier_thinking(tokenizer)
    multi_turn._checked_templates.clear()
    first = Conversation.open(broken, Sample(prompt="hi"), TOOLS, args=None)
    first.add_assistant(_ids(broken, CALL + "<|im_end|>"))
    first.add_tool_turn([{"role": "tool", "content": "56"}], True)  # no <think>: passes and is remembered
    second = Conversation.open(broken, Sample(prompt="hi"), TOOLS, args=None)
    second.add_assistant(_ids(broken, "<think>x</think>" + CALL + "<|im_end|>"))
    with pytest.raises(ChatTemplateError, match="appending the tool turn changes token"):
        second.add_tool_turn([{"role": "tool", "content": "56"}], True)
    multi_turn._checked_templates.clear()


# ---------------------------------------------------------------------------------------------------------------
# tool execution
# ---------------------------------------------------------------------------------------------------------------
class SlowEnv:
    def __init__(self, args):
        pass

    async def step(self, calls):
        await asyncio.sleep(10)


class NoStepEnv:
    def __init__(self, args):
        pass


class RaisingEnv:
    def __init__(self, args):
        pass

    def step(self, calls):
        raise RuntimeError("database down")


class WrongEnv:
    def __init__(self, args):
        pass

    def step(self, calls):
        return ["only one"]


def _run_tools(env, text, timeout_s=5.0):
    stats = EpisodeStats()
    sample = Sample()
    step = asyncio.run(multi_turn._run_tools(env, parse_tool_calls(text), timeout_s, sample, stats))
    return step, stats, sample


def test_calculator_env_outputs_and_errors_in_call_order():
    text = (
        CALL
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1 / 0"}}</tool_call>'
        + "<tool_call>not json</tool_call>"
        + '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "(2 + 3) * 4 / 8"}}</tool_call>'
    )
    step, stats, sample = _run_tools(calculator.CalculatorEnv(None), text)
    assert step.outputs == [
        "56",
        "Error: ValueError: division by zero",
        "Error: tool call 2 is not valid JSON (Expecting value at line 1 column 1). Write each call as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
        "Error: ValueError: unknown tool 'search'; the only tool is 'calculator'",
        "2.5",
    ]
    assert (stats.num_tool_calls, stats.num_tool_errors, stats.num_malformed_tool_calls) == (5, 3, 1)
    assert stats.num_tool_timeouts == 0 and not step.done and step.reward is None
    assert sample.non_generation_time > 0


def test_timeout_and_exception_become_error_outputs():
    two_calls = CALL + CALL
    step, stats, _ = _run_tools(SlowEnv(None), two_calls, timeout_s=0.05)
    assert step.outputs == ["Error: the tool call (calculator, calculator) timed out after 0.05 s"] * 2
    assert (stats.num_tool_timeouts, stats.num_tool_errors) == (2, 2)
    step, stats, _ = _run_tools(RaisingEnv(None), CALL)
    assert step.outputs == ["Error: RuntimeError: database down"]
    assert (stats.num_tool_timeouts, stats.num_tool_errors) == (0, 1)


def test_env_returning_the_wrong_shape_is_a_plugin_error():
    with pytest.raises(
        PluginError, match=r"--custom-env-path: WrongEnv.step returned outputs \['only one'\] for 2"
    ):
        _run_tools(WrongEnv(None), CALL + CALL)


def test_env_step_record_passes_done_and_reward():
    class Done:
        def step(self, calls):
            return EnvStep(outputs=["ok"], done=True, reward=0.5)

    step, _, _ = _run_tools(Done(), CALL)
    assert (step.outputs, step.done, step.reward) == (["ok"], True, 0.5)


def test_env_factory_is_loaded_from_the_flag():
    env = multi_turn._new_env(_Args(custom_env_path=f"{__name__}:RaisingEnv"))
    assert isinstance(env, RaisingEnv)
    with pytest.raises(PluginError, match="needs --custom-env-path"):
        multi_turn._new_env(_Args(custom_env_path=None))
    with pytest.raises(PluginError, match="without a step"):
        multi_turn._new_env(_Args(custom_env_path=f"{__name__}:NoStepEnv"))


# ---------------------------------------------------------------------------------------------------------------
# metrics, the example reward, flags
# ---------------------------------------------------------------------------------------------------------------
def _episode(turns, calls, errors, timeouts, malformed):
    stats = EpisodeStats(
        num_turns=turns, num_tool_calls=calls, num_tool_errors=errors, num_tool_timeouts=timeouts,
        num_malformed_tool_calls=malformed,
    )  # fmt: skip
    return Sample(metadata={"multi_turn": json.loads(json.dumps(stats.__dict__))})


def test_metrics_by_hand():
    samples = [_episode(2, 1, 0, 0, 0), _episode(4, 3, 2, 1, 1), _episode(1, 0, 0, 0, 0), Sample()]
    assert multi_turn_metrics(samples) == {
        "multi_turn/turns/mean": 7 / 3,
        "multi_turn/turns/max": 4.0,
        "multi_turn/turns/min": 1.0,
        "multi_turn/tool_calls/mean": 4 / 3,
        "multi_turn/tool_error_ratio": 2 / 4,
        "multi_turn/tool_calls": 4.0,
        "multi_turn/tool_errors": 2.0,
        "multi_turn/tool_timeouts": 1.0,
        "multi_turn/malformed_tool_calls": 1.0,
    }
    assert multi_turn_metrics([Sample()]) == {}


def test_example_reward_reads_the_final_answer():
    def scored(stop_reason, final, label="56"):
        messages = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "56"}]
        messages.append({"role": "assistant", "content": final})
        sample = Sample(
            label=label, metadata={"multi_turn": {"stop_reason": stop_reason, "messages": messages}}
        )
        return asyncio.run(calculator.reward(None, sample))

    assert scored("answer", "The answer is 56.") == 1.0
    assert scored("answer", "The answer is 54.") == 0.0
    assert scored("max_turns", "The answer is 56.") == 0.0
    assert scored("answer", "no number") == 0.0
    assert calculator.evaluate("2 ** 3 - -1") == 9
    with pytest.raises(ValueError, match="unsupported expression element Call"):
        calculator.evaluate("__import__('os')")
    with pytest.raises(ValueError, match="exponent 1000 is too large"):
        calculator.evaluate("9 ** 1000")


def _rollout(**kw):
    return RolloutConfig(rollout_batch_size=1, **kw)


def test_flags_and_their_rules():
    cfg = _rollout(
        custom_generate_function_path="clawrl.rollout.multi_turn.generate", custom_env_path="m:Env"
    )
    assert (cfg.max_turns, cfg.tool_call_timeout) == (8, 30.0)
    with pytest.raises(ConfigError, match="clawrl.rollout.multi_turn:generate needs --custom-env-path"):
        _rollout(custom_generate_function_path="clawrl.rollout.multi_turn:generate")
    with pytest.raises(ConfigError, match="--custom-env-path m:Env is only used by a generate function"):
        _rollout(custom_env_path="m:Env")
    with pytest.raises(ConfigError, match="--max-turns must be >= 1, got 0"):
        _rollout(max_turns=0)
    with pytest.raises(ConfigError, match="--tool-call-timeout must be > 0, got 0.0"):
        _rollout(tool_call_timeout=0.0)
