"""The demo's task generator: determinism, answers that the gsm8k reward accepts, splits and jsonl files."""

import json
import random
import re

import pytest

from clawrl.data.dataset import PromptDataset
from clawrl.demo.task import (
    KINDS,
    Problem,
    TaskSpec,
    generate_problem,
    generate_problems,
    make_splits,
    write_task_files,
)
from clawrl.rollout.rewards.gsm8k import gsm8k_score


def test_same_seed_same_problems_other_seed_other_problems():
    spec = TaskSpec()
    first = generate_problems(50, spec, seed=3)
    assert first == generate_problems(50, spec, seed=3)
    other = generate_problems(50, spec, seed=4)
    assert [p.question for p in first] != [p.question for p in other]


def test_hand_built_problem_target_and_label():
    problem = Problem(
        kind="add", question="Tom has 3 apples and buys 5 more.", equations=["3 + 5 = 8"], answer=8
    )
    assert problem.label == "#### 8"
    assert problem.target() == "3 + 5 = 8\n#### 8"
    assert problem.target(worked_solution=False) == "#### 8"
    assert gsm8k_score(problem.target(), problem.label) == 1.0
    assert gsm8k_score("3 + 5 = 8\n#### 9", problem.label) == 0.0


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def _answer_from_question(problem: Problem) -> int:
    """Re-derive the answer from the question text alone (numbers appear in operand order)."""
    nums = _numbers(problem.question)
    if problem.kind == "add":
        return nums[0] + nums[1]
    if problem.kind == "sub":
        return nums[0] - nums[1]
    if problem.kind == "mul":
        return nums[0] * nums[1]
    return nums[0] + nums[1] - nums[2]


@pytest.mark.parametrize("kind", KINDS)
def test_answers_are_right_and_scored_one_by_the_gsm8k_reward(kind):
    spec = TaskSpec(kinds=(kind,), max_operand=9, max_factor=9)
    for problem in generate_problems(200, spec, seed=11):
        assert problem.kind == kind
        assert problem.answer == _answer_from_question(problem), problem
        assert problem.answer >= 0
        for worked in (True, False):
            assert gsm8k_score(problem.target(worked), problem.label) == 1.0
        # every worked equation is true arithmetic, and the last one's result is the answer
        for line in problem.equations:
            left, right = line.split(" = ")
            a, op, b = left.split(" ")
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(right)
        assert int(problem.equations[-1].split(" = ")[1]) == problem.answer
        # a wrong final answer scores 0
        assert gsm8k_score(f"#### {problem.answer + 1}", problem.label) == 0.0


def test_operand_ranges_follow_the_spec():
    spec = TaskSpec(kinds=("add", "mul"), max_operand=3, max_factor=4)
    rng = random.Random(0)
    for _ in range(300):
        problem = generate_problem(rng, spec)
        a, b = _numbers(problem.question)[:2]
        if problem.kind == "add":
            assert 1 <= a <= 3 and 1 <= b <= 3
        else:
            assert 2 <= a <= 4 and 2 <= b <= 4


def test_splits_are_disjoint_and_sized():
    train, held_out = make_splits(TaskSpec(), seed=5, num_train=400, num_eval=100)
    assert len(train) == 400 and len(held_out) == 100
    assert not {p.question for p in train} & {p.question for p in held_out}
    assert len({p.question for p in train}) == 400
    # every kind shows up in both splits
    assert {p.kind for p in train} == set(KINDS) == {p.kind for p in held_out}


def test_too_many_problems_for_a_tiny_spec_is_one_clear_error():
    spec = TaskSpec(kinds=("mul",), max_factor=2)  # 2 * 2 only: 3 templates x few words
    with pytest.raises(ValueError, match="distinct questions"):
        generate_problems(100_000, spec, seed=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"kinds": ("div",)}, "kinds"), ({"kinds": ()}, "kinds"), ({"max_operand": 0}, "max_operand"),
     ({"max_factor": 1}, "max_factor")],
)  # fmt: skip
def test_bad_spec_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskSpec(**kwargs)


def test_jsonl_files_are_written_and_read_as_prompt_data(tmp_path):
    from clawrl.models.tiny import build_tiny_tokenizer

    paths = write_task_files(tmp_path / "data", TaskSpec(), seed=0, num_train=30, num_eval=10)
    train_rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    eval_rows = [json.loads(line) for line in paths["eval"].read_text().splitlines()]
    sft_rows = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    assert len(train_rows) == 30 and len(eval_rows) == 10 and len(sft_rows) == 30
    for row, sft in zip(train_rows, sft_rows, strict=True):
        assert set(row) == {"input", "label", "metadata"}
        assert re.fullmatch(r"#### \d+", row["label"])
        user, assistant = sft["messages"]
        assert user == {"role": "user", "content": row["input"]}
        assert assistant["role"] == "assistant" and assistant["content"].endswith(row["label"])
        assert gsm8k_score(assistant["content"], row["label"]) == 1.0
    # the files are what --prompt-data / --apply-chat-template / --label-key label read
    tokenizer = build_tiny_tokenizer(2048)
    dataset = PromptDataset(str(paths["eval"]), tokenizer, label_key="label", apply_chat_template=True)
    assert [s.label for s in dataset.samples] == [r["label"] for r in eval_rows]
    first = dataset.samples[0].prompt
    assert first == f"<|im_start|>user\n{eval_rows[0]['input']}<|im_end|>\n<|im_start|>assistant\n"
