"""Built-in generate function for multi-turn tool-calling conversations (an agent loop per sample).

    clawrl train ... --custom-generate-function-path clawrl.rollout.multi_turn.generate \\
        --custom-env-path examples/calculator_tool/calculator.py:CalculatorEnv \\
        --max-turns 4 --tool-call-timeout 10 --rollout-max-response-len 512

Per sample: `env = NAME(args)` from --custom-env-path, `env.reset(sample)` (optional), then up to
--max-turns model turns. Each turn is one engine call that continues the sample's tokens; its tokens are
trained on (loss mask 1, with the engine's log-probs). The turn's `<tool_call>` blocks (clawrl/rollout/
tool_parse.py) go to `env.step(calls)` under a --tool-call-timeout deadline; a malformed call, a timed-out
step and a step that raised are answered with an error message instead. The results are rendered as the
chat template's tool turn and appended as tokens the model did not produce (loss mask 0, log-prob 0),
followed by the template's generation prompt, and the next turn starts. The conversation ends when a turn
has no tool call (COMPLETED), the env says done (COMPLETED), the model's turn hits the token budget
(TRUNCATED), the budget has no room for the tool turn plus one token (TRUNCATED), or the last allowed turn
asked for tools (TRUNCATED). --rollout-max-response-len bounds all response tokens, the tool turns included.

The prompt: a list of chat messages is rendered here with the tools (`sample.metadata["tools"]` from
--tool-key, else `env.tools`) and the generation prompt; a string rendered by --apply-chat-template is used
as it is; a plain string becomes one user message. Tool turns are re-rendered with the template: the tokens
appended for a tool turn are what `render(conversation + tool messages, add_generation_prompt=True)` adds
to `render(conversation)`, after the assistant turn's end-of-turn token. So the template must be
prefix-stable; that is checked once per process (the first tool turn) over every prefix of the
conversation, and a failure is one ChatTemplateError naming the first differing token.

Environment plugin (sync or async methods; see docs/multi_turn.md):

    class MyEnv:
        tools = [...]                              # optional: JSON schemas for message-list prompts
        def __init__(self, args): ...
        def reset(self, sample): ...               # optional
        def step(self, calls: list[ToolCall]) -> EnvStep | list[str]: ...
        def close(self): ...                       # optional

`EnvStep.outputs` has one entry per call (a string, or an Exception to fail just that call); `done` ends
the episode (the step's outputs are recorded but not appended); the last non-None `reward` becomes the
sample's reward (otherwise --rm-type / --custom-rm-path scores it). A sync `step` runs in a worker thread;
after its deadline it is abandoned, not killed (make slow tools async, or run them in a subprocess).

Recorded per sample in `sample.metadata["multi_turn"]`: num_turns, num_tool_calls, num_tool_errors
(malformed + failed + timed out), num_tool_timeouts, num_malformed_tool_calls, stop_reason, and messages
(the assistant and tool messages of the episode). `multi_turn_metrics` aggregates them per rollout as
multi_turn/* metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from clawrl.config.plugins import PluginError, load_function
from clawrl.data.chat import (
    END_OF_TURN_TOKENS,
    ChatTemplateError,
    check_prefix_stable,
    encode_text,
    end_of_turn_ids,
    render_chat,
)
from clawrl.data.sample import Sample, Status
from clawrl.rollout.context import rollout_context
from clawrl.rollout.generate import generate as generate_one_turn
from clawrl.rollout.tool_parse import EXPECTED_FORMAT, MalformedToolCall, ToolCall, parse_tool_calls

logger = logging.getLogger(__name__)

ENV_FLAG = "--custom-env-path"
GENERATE_PATH = "clawrl.rollout.multi_turn.generate"
METADATA_KEY = "multi_turn"
# Seed offset between turns: each turn samples from its own stream, reproducibly.
_TURN_SEED_STRIDE = 1_000_003
# Stand-in conversation before the assistant turn when the prompt came already rendered as text.
_STAND_IN_PROMPT = [{"role": "user", "content": "..."}]

_checked_templates: set[str] = set()  # chat templates whose prefix stability this process has checked
_env_factories: dict[str, Any] = {}


@dataclass(kw_only=True)
class EnvStep:
    """What an environment returns for the tool calls of one model turn."""

    outputs: list[Any]
    """One entry per call, in order: the tool's output text, or an Exception to fail that call."""
    done: bool = False
    """True ends the episode now (the outputs are recorded, not shown to the model)."""
    reward: float | dict[str, Any] | None = None
    """If set, the sample's reward (the last one set wins); None leaves it to the reward function."""


@dataclass(kw_only=True)
class EpisodeStats:
    """Per-sample counts, stored in sample.metadata["multi_turn"]."""

    num_turns: int = 0
    """Model turns (engine calls) of the episode."""
    num_tool_calls: int = 0
    """`<tool_call>` blocks the model wrote, malformed ones included."""
    num_tool_errors: int = 0
    """Calls answered with an error: malformed, failed in the env, or timed out."""
    num_tool_timeouts: int = 0
    """Calls whose env step missed --tool-call-timeout."""
    num_malformed_tool_calls: int = 0
    """Calls that could not be parsed."""
    stop_reason: str = ""
    """answer, env_done, max_turns, length (budget) or aborted."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The episode's assistant and tool messages, in order."""


# ------------------------------------------------------------------------------------------------------------
# the generate function
# ------------------------------------------------------------------------------------------------------------
async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's generate signature: run one tool-calling episode for `sample` (module docstring)."""
    ctx = rollout_context()
    if sample.response_length:
        raise ValueError(
            f"sample {sample.index} already has {sample.response_length} response tokens; {GENERATE_PATH} "
            "starts episodes from the prompt and cannot continue a partial one"
        )
    env = _new_env(args)
    stats = EpisodeStats()
    try:
        await _call(getattr(env, "reset", None), sample)
        chat = Conversation.open(ctx.tokenizer, sample, getattr(env, "tools", None), args)
        sample.tokens = list(chat.prompt_ids)
        await _run_episode(args, sample, sampling_params, env, chat, stats)
    finally:
        sample.metadata[METADATA_KEY] = asdict(stats)
        await _call(getattr(env, "close", None))
    return sample


async def _run_episode(
    args: Any,
    sample: Sample,
    sampling_params: dict[str, Any],
    env: Any,
    chat: Conversation,
    stats: EpisodeStats,
) -> None:
    budget = sampling_params.get("max_new_tokens")
    base_seed = sampling_params.get("seed")
    if base_seed is None and sample.index is not None:
        base_seed = int(args.rollout_seed) + sample.index
    for turn in range(args.max_turns):
        params = dict(sampling_params)
        if base_seed is not None:
            params["seed"] = base_seed + _TURN_SEED_STRIDE * turn
        start = len(sample.tokens)
        await generate_one_turn(args, sample, params)
        turn_ids = sample.tokens[start:]
        if not turn_ids:  # aborted or no budget left: no request was sent
            stats.stop_reason = "aborted" if sample.status == Status.ABORTED else "length"
            return
        stats.num_turns += 1
        text, ended = chat.add_assistant(turn_ids)
        stats.messages.append(chat.history[-1])
        if sample.status != Status.COMPLETED:
            stats.stop_reason = "aborted" if sample.status == Status.ABORTED else "length"
            return
        calls = parse_tool_calls(text)
        if not calls:
            stats.stop_reason = "answer"
            return
        if turn == args.max_turns - 1:  # nobody would read the tool results
            stats.stop_reason, sample.status = "max_turns", Status.TRUNCATED
            return
        step = await _run_tools(env, calls, args.tool_call_timeout, sample, stats)
        tool_messages = [_tool_message(c, out) for c, out in zip(calls, step.outputs, strict=True)]
        stats.messages.extend(tool_messages)
        if step.reward is not None:
            sample.reward = step.reward
        if step.done:
            stats.stop_reason = "env_done"
            return
        tool_ids = chat.add_tool_turn(tool_messages, ended)
        if budget is not None and sample.response_length + len(tool_ids) >= budget:
            stats.stop_reason, sample.status = "length", Status.TRUNCATED
            return
        sample.append_response(tool_ids, None, chat.decode(tool_ids), trainable=False)


def _tool_message(call: ToolCall | MalformedToolCall, output: str) -> dict[str, Any]:
    message = {"role": "tool", "content": output}
    if isinstance(call, ToolCall):
        message["name"] = call.name
    return message


# ------------------------------------------------------------------------------------------------------------
# the environment
# ------------------------------------------------------------------------------------------------------------
def _new_env(args: Any) -> Any:
    path = getattr(args, "custom_env_path", None)
    if not path:
        raise PluginError(
            f"{GENERATE_PATH} needs {ENV_FLAG} MODULE:NAME (a tool environment class or factory)"
        )
    if path not in _env_factories:
        _env_factories[path] = load_function(path, ENV_FLAG)
    env = _env_factories[path](args)
    if not callable(getattr(env, "step", None)):
        raise PluginError(f"{ENV_FLAG} {path!r} made a {type(env).__name__} without a step(calls) method")
    return env


async def _call(method: Any, *call_args: Any) -> Any:
    """Call an env method (sync in a worker thread, or async); None when the env lacks it."""
    if method is None:
        return None
    if inspect.iscoroutinefunction(method):
        return await method(*call_args)
    result = await asyncio.to_thread(method, *call_args)
    return await result if inspect.isawaitable(result) else result


async def _run_tools(
    env: Any, calls: list[ToolCall | MalformedToolCall], timeout_s: float, sample: Sample, stats: EpisodeStats
) -> EnvStep:
    """The env's step over the well-formed calls; error texts for the others. Outputs are in call order."""
    stats.num_tool_calls += len(calls)
    good = [c for c in calls if isinstance(c, ToolCall)]
    outputs: dict[int, str] = {}
    for call in calls:
        if isinstance(call, MalformedToolCall):
            stats.num_malformed_tool_calls += 1
            outputs[call.index] = f"Error: {call.error}. Write each call as {EXPECTED_FORMAT}."
    step = EnvStep(outputs=[])
    if good:
        started = time.monotonic()
        step = await _env_step(env, good, timeout_s, stats)
        sample.non_generation_time += time.monotonic() - started
        for call, output in zip(good, step.outputs, strict=True):
            outputs[call.index] = output
    stats.num_tool_errors += sum(1 for text in outputs.values() if text.startswith("Error: "))
    return EnvStep(outputs=[outputs[c.index] for c in calls], done=step.done, reward=step.reward)


async def _env_step(env: Any, calls: list[ToolCall], timeout_s: float, stats: EpisodeStats) -> EnvStep:
    """env.step(calls) under the deadline, its result checked; failures become "Error: ..." outputs."""
    try:
        result = await asyncio.wait_for(_call(env.step, calls), timeout_s)
    except asyncio.TimeoutError:
        stats.num_tool_timeouts += len(calls)
        names = ", ".join(c.name for c in calls)
        return EnvStep(
            outputs=[f"Error: the tool call ({names}) timed out after {timeout_s:g} s"] * len(calls)
        )
    except Exception as exc:  # a tool failing on the model's arguments is feedback for the model
        logger.warning("%s: env.step raised %s: %s", ENV_FLAG, type(exc).__name__, exc, exc_info=True)
        return EnvStep(outputs=[_error_text(exc)] * len(calls))
    step = _as_step(result, len(calls), getattr(env, "__class__", type(env)).__name__)
    step.outputs = [_error_text(out) if isinstance(out, BaseException) else out for out in step.outputs]
    return step


def _error_text(exc: BaseException) -> str:
    return f"Error: {type(exc).__name__}: {exc}"


def _as_step(result: Any, num_calls: int, env_name: str) -> EnvStep:
    if isinstance(result, list):
        result = EnvStep(outputs=result)
    if not isinstance(result, EnvStep):
        raise PluginError(
            f"{ENV_FLAG}: {env_name}.step returned {type(result).__name__}; expected EnvStep or a list of outputs"
        )
    if len(result.outputs) != num_calls or not all(
        isinstance(out, str | BaseException) for out in result.outputs
    ):
        raise PluginError(
            f"{ENV_FLAG}: {env_name}.step returned outputs {result.outputs!r:.200} for {num_calls} tool call(s); "
            "expected one string (or Exception) per call"
        )
    return EnvStep(outputs=list(result.outputs), done=bool(result.done), reward=result.reward)


# ------------------------------------------------------------------------------------------------------------
# the conversation as chat messages and as tokens
# ------------------------------------------------------------------------------------------------------------
class Conversation:
    """The episode's chat messages and how the chat template turns a tool turn into tokens."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_messages: list[dict[str, Any]] | None,
        tools: list | None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """`prompt_messages` None: the prompt came rendered as `prompt_ids`; tool turns are then rendered
        after a stand-in prompt (the template's tool turn does not depend on what came before it)."""
        if tokenizer is None:
            raise ValueError(f"{GENERATE_PATH} needs the policy's tokenizer (set --hf-checkpoint)")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.prompt_messages = prompt_messages
        self.history: list[dict[str, Any]] = []
        self.end_ids = end_of_turn_ids(tokenizer)
        prompted = self._ids(self._messages(), prompted=True)
        self.prompt_ids = prompted if prompt_ids is None else prompt_ids
        self._prompted_len = len(prompted)  # where the current assistant turn starts in a fresh render

    @classmethod
    def open(cls, tokenizer: Any, sample: Sample, env_tools: list | None, args: Any) -> Conversation:
        """The prompt as messages and token ids (module docstring: which prompts are rendered here)."""
        tools = sample.metadata.get("tools") or env_tools
        prompt = sample.prompt
        if isinstance(prompt, str) and getattr(args, "apply_chat_template", False):
            ids = encode_text(tokenizer, prompt) if tokenizer is not None else []
            return cls(tokenizer, None, tools, ids)
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        )
        return cls(tokenizer, messages, tools)

    def add_assistant(self, turn_ids: list[int]) -> tuple[str, bool]:
        """Record a model turn; returns (its text without the end-of-turn token, whether it had one)."""
        ended = bool(turn_ids) and turn_ids[-1] in self.end_ids
        text = self.decode(turn_ids[:-1] if ended else turn_ids)
        self.history.append({"role": "assistant", "content": text})
        return text, ended

    def add_tool_turn(self, tool_messages: list[dict[str, Any]], assistant_ended: bool) -> list[int]:
        """Token ids that follow the model's last token: the rest of its turn as the template closes it
        (when the model stopped before the end-of-turn token), the tool turn, and the generation prompt."""
        before = self._messages()
        after = before + tool_messages
        self._check_once(after)
        closed = self._ids(before, prompted=False)
        extended = self._ids(after, prompted=True)
        _require_prefix(self.tokenizer, closed, extended)
        end = next(
            (i for i in range(len(closed) - 1, self._prompted_len - 1, -1) if closed[i] in self.end_ids), None
        )
        if end is None:
            raise ChatTemplateError(
                _template_problem(
                    f"the assistant turn has no end-of-turn token (one of {END_OF_TURN_TOKENS})"
                )
            )
        self.history.extend(tool_messages)
        self._prompted_len = len(extended)
        return closed[end + 1 if assistant_ended else end :] + extended[len(closed) :]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _messages(self) -> list[dict[str, Any]]:
        return [*(self.prompt_messages or _STAND_IN_PROMPT), *self.history]

    def _ids(self, messages: list[dict[str, Any]], *, prompted: bool) -> list[int]:
        text = render_chat(self.tokenizer, messages, self.tools, add_generation_prompt=prompted)
        return encode_text(self.tokenizer, text)

    def _check_once(self, messages: list[dict[str, Any]]) -> None:
        """Every prefix of the conversation (and of the next turn's prompt) must render as a token prefix."""
        key = hashlib.sha256(str(self.tokenizer.chat_template).encode()).hexdigest()
        if key in _checked_templates:
            return
        try:
            check_prefix_stable(self.tokenizer, [*messages, {"role": "assistant", "content": ""}], self.tools)
        except ChatTemplateError as exc:
            raise ChatTemplateError(_template_problem(str(exc))) from None
        _checked_templates.add(key)


def _require_prefix(tokenizer: Any, closed: list[int], extended: list[int]) -> None:
    """ChatTemplateError naming the first differing token unless `closed` is a prefix of `extended`."""
    if extended[: len(closed)] == closed:
        return
    pos = next((i for i, (a, b) in enumerate(zip(closed, extended, strict=False)) if a != b), len(extended))
    before = tokenizer.decode(closed[max(0, pos - 8) : pos + 4], skip_special_tokens=False)
    after = tokenizer.decode(extended[max(0, pos - 8) : pos + 4], skip_special_tokens=False)
    raise ChatTemplateError(
        _template_problem(
            f"appending the tool turn changes token {pos} of the conversation before it ({before!r} becomes "
            f"{after!r})"
        )
    )


def _template_problem(detail: str) -> str:
    return (
        f"{GENERATE_PATH}: the tokenizer's chat template cannot be used for multi-turn tool rollouts: {detail}. "
        "Turns are appended token by token, so rendering the conversation with a turn appended must extend "
        "the previous rendering exactly (templates that drop earlier <think> blocks or re-format earlier "
        "turns break this); give the checkpoint a template that renders every turn the same way wherever it is"
    )


# ------------------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------------------
def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """multi_turn/* metrics of a rollout's samples ({} when none ran through this generate function).

    turns/{mean,max,min} per sample, tool_calls/mean per sample, and batch totals of tool_calls,
    tool_errors, tool_timeouts and malformed_tool_calls, plus tool_error_ratio = errors / calls.
    """
    stats = [s.metadata[METADATA_KEY] for s in samples if isinstance(s.metadata.get(METADATA_KEY), dict)]
    if not stats:
        return {}
    turns = [st["num_turns"] for st in stats]
    totals = {key: sum(st[f"num_{key}"] for st in stats) for key in _TOTALS}
    metrics = {
        "multi_turn/turns/mean": statistics.fmean(turns),
        "multi_turn/turns/max": float(max(turns)),
        "multi_turn/turns/min": float(min(turns)),
        "multi_turn/tool_calls/mean": totals["tool_calls"] / len(stats),
        "multi_turn/tool_error_ratio": totals["tool_errors"] / max(totals["tool_calls"], 1),
    }
    metrics.update({f"multi_turn/{key}": float(value) for key, value in totals.items()})
    return metrics


_TOTALS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed_tool_calls")
