"""Multi-turn tool rollouts (clawrl.rollout.multi_turn.generate) against a real engine server on CPU.

A random tiny model never writes a tool call, so the module first teaches one by plain SFT (a few seconds):
two conversations in which the assistant calls the calculator example's tool and then states the result.
Greedy decoding (--rollout-top-k 1) then reproduces them, so the episode is known by hand: turn 1 is the
tool call, the calculator's real output comes back as a tool turn, turn 2 is the answer. The RolloutManager
runs the generate function exactly as a training job does (the calculator env and reward are loaded from
examples/calculator_tool/calculator.py by path). The last test trains for two rollouts with `clawrl train`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cpu_server import cpu_server

from clawrl.config.data import DataConfig
from clawrl.config.job import JobConfig
from clawrl.config.model import ModelConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.validate import validate
from clawrl.data.chat import render_chat, tokenize_conversation
from clawrl.data.sample import Status
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from clawrl.rollout.manager import RolloutManager
from clawrl.rollout.multi_turn import GENERATE_PATH

HERE = __name__
CALCULATOR = Path(__file__).resolve().parents[2] / "examples" / "calculator_tool" / "calculator.py"
ENV_PATH = f"{CALCULATOR}:CalculatorEnv"
REWARD_PATH = f"{CALCULATOR}:reward"
PROBLEMS = [(7, 8, 56), (9, 6, 54)]


def _calculator_tool() -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator_example", CALCULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CALCULATOR_TOOL


TOOLS = [_calculator_tool()]


def _call_text(a: int, b: int) -> str:
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _conversation(a: int, b: int, result: int) -> list[dict]:
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": _call_text(a, b)},
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


def _sft(model_dir: Path, tokenizer, max_steps: int = 600) -> None:
    """Plain SFT on the assistant tokens of PROBLEMS until greedy decoding reproduces every one of them with a
    logit margin of 2 (teacher-forced argmax right everywhere), then save over the random weights.

    The weights saved are the ones the margin was measured on: the check comes before the optimizer step, as one
    more Adam step at this learning rate can turn a margin of 2 negative (greedy decoding then leaves the script).
    """
    from transformers import AutoModelForCausalLM

    data = [tokenize_conversation(tokenizer, _conversation(*p), TOOLS) for p in PROBLEMS]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        margin = float("inf")
        for ids, mask in data:
            x = torch.tensor([ids])
            keep = torch.tensor(mask[1:], dtype=torch.bool)
            logits, target = model(x).logits[0, :-1][keep], x[0, 1:][keep]
            torch.nn.functional.cross_entropy(logits, target).backward()
            with torch.no_grad():
                right = logits.gather(1, target[:, None])[:, 0]
                others = logits.scatter(1, target[:, None], float("-inf")).max(-1).values
                margin = min(margin, (right - others).min().item())
        if margin > 2.0:
            model.save_pretrained(model_dir)
            return
        optimizer.step()
        optimizer.zero_grad()
    raise AssertionError(f"SFT did not fit the tool conversations in {max_steps} steps (margin {margin:.3f})")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tiny_tokenizer(2048)
    path = build_tiny_model(
        tmp_path_factory.mktemp("mt") / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2,
        tokenizer=tokenizer,
    )  # fmt: skip
    _sft(path, tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    with cpu_server(model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _write_prompts(path: Path, *, rendered: bool) -> str:
    rows = []
    for a, b, result in PROBLEMS:
        row = {"messages": [{"role": "user", "content": f"What is {a} * {b}?"}], "label": str(result)}
        if rendered:  # the dataset renders the prompt (--apply-chat-template) with the tools of --tool-key
            row["tools"] = TOOLS
        rows.append(row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _run(model_dir, server, prompt_data, *, apply_chat_template=False, **rollout):
    settings = {
        "rollout_batch_size": 2, "n_samples_per_prompt": 1, "num_rollout": 1, "rollout_max_response_len": 96,
        "rollout_top_k": 1, "custom_generate_function_path": GENERATE_PATH, "custom_env_path": ENV_PATH,
        "custom_rm_path": REWARD_PATH, "max_turns": 4, **rollout,
    }  # fmt: skip
    job = validate(
        JobConfig(
            model=ModelConfig(hf_checkpoint=model_dir),
            data=DataConfig(
                prompt_data=prompt_data,
                input_key="messages",
                label_key="label",
                apply_chat_template=apply_chat_template,
            ),  # fmt: skip
            rollout=RolloutConfig(**settings),
        )
    )
    with RolloutManager(job, [server.url], rollout_timeout_s=120, abort_timeout_s=20) as manager:
        batch, metrics = manager.generate(0)
        return batch, metrics, manager.last_samples


def _closed_conversation_ids(tokenizer, messages) -> tuple[list[int], list[int], int]:
    """(ids, loss mask) of the whole conversation up to its last end-of-turn token, and the prompt length."""
    ids, mask = tokenize_conversation(tokenizer, messages, TOOLS)
    end = max(i for i, t in enumerate(ids) if t == tokenizer.eos_token_id) + 1
    prompt = render_chat(tokenizer, messages[:1], TOOLS, add_generation_prompt=True)
    return ids[:end], mask[:end], len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------------------------
# episodes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rendered", [False, True], ids=["messages", "apply-chat-template"])
def test_calculator_episode_tokens_mask_reward_and_metrics(model_dir, server, tokenizer, tmp_path, rendered):
    prompts = _write_prompts(tmp_path / "p.jsonl", rendered=rendered)
    batch, metrics, samples = _run(model_dir, server, prompts, apply_chat_template=rendered)

    for sample, (a, b, result) in zip(samples, PROBLEMS, strict=True):
        expected_ids, expected_mask, num_prompt = _closed_conversation_ids(
            tokenizer, _conversation(a, b, result)
        )
        # the token stream is exactly the template's rendering of the conversation, tool turn included
        assert sample.tokens == expected_ids
        assert sample.response_length == len(expected_ids) - num_prompt
        # model turns (bodies + <|im_end|>) are trained on; the tool turn and the role headers are not
        assert sample.loss_mask == expected_mask[num_prompt:]
        response_ids = sample.tokens[num_prompt:]
        tool_turn = f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
        tool_ids = tokenizer(tool_turn + "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        first_turn = tokenizer(_call_text(a, b), add_special_tokens=False)["input_ids"]
        start = len(first_turn)  # the tool turn starts after the call and its end-of-turn token (index start)
        assert response_ids[start : start + len(tool_ids)] == tool_ids
        assert sample.loss_mask[: start + 1] == [1] * (start + 1)
        assert sample.loss_mask[start + 1 : start + len(tool_ids)] == [0] * (len(tool_ids) - 1)
        assert sum(sample.loss_mask) == len(first_turn) + 1 + len(
            tokenizer(f"The answer is {result}.<|im_end|>", add_special_tokens=False)["input_ids"]
        )
        # rollout log-probs: the engine's for model tokens, the 0.0 placeholder for tool tokens
        assert len(sample.rollout_log_probs) == sample.response_length
        model_lps = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m]
        tool_lps = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not m]
        assert model_lps and all(lp <= 0.0 for lp in model_lps)
        assert tool_lps and all(lp == 0.0 for lp in tool_lps)
        assert f"<tool_response>\n{result}\n</tool_response>" in sample.response
        episode = sample.metadata["multi_turn"]
        assert episode["messages"] == [
            {"role": "assistant", "content": _call_text(a, b)},
            {"role": "tool", "content": str(result), "name": "calculator"},
            {"role": "assistant", "content": f"The answer is {result}."},
        ]
        assert (episode["num_turns"], episode["num_tool_calls"], episode["num_tool_errors"]) == (2, 1, 0)
        assert episode["stop_reason"] == "answer" and sample.status == Status.COMPLETED
        assert sample.reward == 1.0
        assert len(sample.weight_versions) == 2  # one engine call per model turn
    assert batch.loss_masks == [s.loss_mask for s in samples]
    assert batch.raw_rewards == [1.0, 1.0]
    assert metrics["multi_turn/turns/mean"] == 2.0 and metrics["multi_turn/turns/max"] == 2.0
    assert metrics["multi_turn/tool_calls"] == 2.0 and metrics["multi_turn/tool_calls/mean"] == 1.0
    assert metrics["multi_turn/tool_errors"] == 0.0 and metrics["multi_turn/tool_timeouts"] == 0.0


def test_last_allowed_turn_asking_for_a_tool_is_truncated(model_dir, server, tokenizer, tmp_path):
    _, metrics, samples = _run(
        model_dir, server, _write_prompts(tmp_path / "p.jsonl", rendered=False), max_turns=1
    )
    for sample, (a, b, _) in zip(samples, PROBLEMS, strict=True):
        call_ids = tokenizer(_call_text(a, b) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        assert sample.tokens[-sample.response_length :] == call_ids  # no tool turn appended
        assert sample.loss_mask == [1] * len(call_ids)
        assert (
            sample.status == Status.TRUNCATED and sample.metadata["multi_turn"]["stop_reason"] == "max_turns"
        )
        assert sample.reward == 0.0  # the example reward needs a final answer
    assert metrics["multi_turn/turns/mean"] == 1.0 and metrics["rollout/truncated_ratio"] == 1.0


def test_response_budget_covers_model_and_tool_tokens(model_dir, server, tokenizer, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", rendered=False)
    turn = len(tokenizer(_call_text(7, 8) + "<|im_end|>", add_special_tokens=False)["input_ids"])
    # room for the first turn but not for the tool turn (11 tokens) plus one more token: stop before it
    _, _, samples = _run(model_dir, server, prompts, rollout_max_response_len=turn + 5)
    for sample in samples:
        assert sample.response_length == turn and sample.status == Status.TRUNCATED
        assert sample.metadata["multi_turn"]["stop_reason"] == "length"
    # the first turn itself is cut by the engine at the budget
    _, _, samples = _run(model_dir, server, prompts, rollout_max_response_len=turn - 3)
    for sample in samples:
        assert sample.response_length == turn - 3 and sample.loss_mask == [1] * (turn - 3)
        assert sample.status == Status.TRUNCATED and sample.metadata["multi_turn"]["num_tool_calls"] == 0


class SlowEnv:
    """A tool that takes longer than the test's --tool-call-timeout."""

    tools = TOOLS  # the prompt the model was trained on shows the calculator

    def __init__(self, args):
        pass

    async def step(self, calls):
        await asyncio.sleep(30)
        return ["never"] * len(calls)


def test_timed_out_tool_is_an_error_message_to_the_model(model_dir, server, tokenizer, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", rendered=False)
    started = time.monotonic()
    _, metrics, samples = _run(
        model_dir, server, prompts, custom_env_path=f"{HERE}:SlowEnv", tool_call_timeout=0.3, max_turns=2
    )
    assert time.monotonic() - started < 25  # the 30 s tools were abandoned at their deadline
    for sample in samples:
        episode = sample.metadata["multi_turn"]
        error = "Error: the tool call (calculator) timed out after 0.3 s"
        assert episode["messages"][1] == {"role": "tool", "content": error, "name": "calculator"}
        assert (
            episode["num_tool_timeouts"] >= 1 and episode["num_tool_errors"] == episode["num_tool_timeouts"]
        )
        assert f"<tool_response>\n{error}\n</tool_response>" in sample.response
        error_ids = tokenizer(error, add_special_tokens=False)["input_ids"]
        response = sample.tokens[-sample.response_length :]
        at = next(i for i in range(len(response)) if response[i : i + len(error_ids)] == error_ids)
        assert sample.loss_mask[at : at + len(error_ids)] == [0] * len(error_ids)
    assert metrics["multi_turn/tool_timeouts"] >= 2.0


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------
SPREAD_REWARD = """
import importlib.util

spec = importlib.util.spec_from_file_location("calculator_example", {path!r})
calculator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calculator)


async def reward(args, sample, **kwargs):
    # The SFT'd policy mostly gets every problem right (or, early, wrong) in a whole group, which gives zero
    # GRPO advantages; half a point by sample parity makes every group's rewards differ.
    return await calculator.reward(args, sample) + 0.5 * (sample.index % 2)
"""


def _spread_reward(root: Path) -> str:
    path = root / "spread_reward.py"
    path.write_text(SPREAD_REWARD.format(path=str(CALCULATOR)))
    return f"{path}:reward"


@pytest.mark.slow
def test_clawrl_train_runs_two_rollouts_with_tool_episodes(model_dir, tmp_path):
    out = tmp_path / "run"
    prompts = _write_prompts(tmp_path / "p.jsonl", rendered=False)
    flags = [
        "--hf-checkpoint", model_dir, "--prompt-data", prompts, "--input-key", "messages", "--label-key", "label",
        "--custom-generate-function-path", GENERATE_PATH, "--custom-env-path", ENV_PATH,
        "--custom-rm-path", _spread_reward(tmp_path), "--max-turns", "3", "--tool-call-timeout", "10",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "96",
        "--rollout-temperature", "1.0", "--global-batch-size", "4", "--num-rollout", "2", "--lr", "1e-4",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024", "--output-dir", str(out),
        "--run-name", "multi-turn",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "train", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    summary = [
        {k: v for k, v in r.items() if k.startswith(("multi_turn/", "rollout/raw", "train/grad"))}
        for r in rows
    ]
    for row in rows:
        assert 1.0 <= row["multi_turn/turns/mean"] <= 3.0, summary
        assert row["multi_turn/tool_calls"] >= 1.0, summary  # the SFT'd policy calls the tool while sampling
        assert "train/loss" in row
    assert all(row["train/grad_norm"] > 0 for row in rows), summary
    # the trainer recomputes the engine's log-probs of the model tokens; tool tokens (placeholder 0.0)
    # would make this gap large if they were not masked out
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5
