"""The demo's task: procedurally generated arithmetic word problems, scored by the gsm8k reward.

Every problem is built from word lists and templates with a seeded `random.Random`, so a seed always gives the
same problems. A problem's label is GSM8K's answer line (`#### 8`), and its SFT target is a tiny worked
solution ending in that line:

    question: "Tom has 3 apples and buys 5 more. How many apples does Tom have now?"
    target:   "3 + 5 = 8\\n#### 8"           label: "#### 8"

Kinds: `add`, `sub`, `mul` (one equation) and `add_sub` (two equations: buy, then give away). Operand ranges
come from `TaskSpec`, so the difficulty is a setting, not code.

The warm-up data comes from a chatty teacher: a `TaskSpec.verbose_fraction` share of its solutions first retell
the problem in words (no numbers, ~30 tokens), then solve it:

    "Tom gets more apples, so the number of apples goes up and we add the two numbers.\\n3 + 5 = 8\\n#### 8"

Both styles are correct, but under the demo's 24-token response budget a verbose solution is cut off before
its first number and scores 0. After SFT the model opens verbosely as often as the teacher did, so greedy
decoding mostly runs out of budget while sampling often finds the concise style: GRPO has a reward signal from
its first step, and learning to answer concisely is what turns the model's arithmetic into eval accuracy.

    spec = TaskSpec()
    paths = write_task_files("/tmp/demo/data", spec, seed=0, num_train=2000, num_eval=200)
    # paths["train"] / paths["eval"]: jsonl rows {"input": question, "label": "#### 8", "metadata": {...}}
    #   usable as --prompt-data / --eval-prompt-data with --input-key input --label-key label
    #   --apply-chat-template --rm-type gsm8k
    # paths["sft"]: rows {"messages": [user, assistant]} (the warm-up data)
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from clawrl.models.tiny_corpus import NAMES as CORPUS_NAMES

KINDS = ("add", "sub", "mul", "add_sub")
_MAX_CONSECUTIVE_DUPLICATES = 1000

# The first 14 names of the tiny tokenizer's training corpus (clawrl.models.tiny_corpus), so they tokenize well.
_NAMES = tuple(CORPUS_NAMES[:14])
_ITEMS = ("apples", "pencils", "books", "marbles", "cookies", "stickers", "cards", "eggs", "shells", "coins")
_ITEMS += ("balloons", "flowers", "candies", "toys", "stamps", "cupcakes")
_CONTAINERS = ("bags", "boxes", "jars", "baskets", "packs")

# One equation per kind; templates take name, other (a second name), item, container and the operands a, b.
_TEMPLATES = {
    "add": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "{name} finds {a} {item} in the morning and {b} {item} in the afternoon. How many {item} does "
        "{name} find in total?",
        "There are {a} {item} on the table. {name} puts {b} more on it. How many {item} are on the table?",
    ),
    "sub": (
        "{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?",
        "There are {a} {item} in a box. {name} takes {b} of them. How many {item} are still in the box?",
        "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?",
    ),
    "mul": (
        "{name} has {a} {container} with {b} {item} in each. How many {item} does {name} have?",
        "{name} buys {a} {container} of {item}. Each one holds {b} {item}. How many {item} does {name} buy?",
        "There are {a} {container} and every one has {b} {item}. How many {item} are there in total?",
    ),
}
# A chatty teacher's opening: the problem retold in words WITHOUT numbers (28-33 tokens with the demo's
# tokenizer). A verbose solution cut off by a short response budget holds no number, so the gsm8k reward gives 0.
# Every opening starts with the same words, so the choice between the styles is one first-token decision.
_RESTATEMENTS = {
    "add": "The story says that {name} gets more {item}, so the number goes up and we add the two numbers.",
    "sub": "The story says that some of the {item} are gone, so the number goes down and we subtract.",
    "mul": "The story says that all the {container} hold the same number of {item}, so we multiply.",
    "add_sub": "The story says that {name} gets more {item} and then some are gone, so we add and subtract.",
}
_TWO_STEP_TEMPLATES = (
    "{name} has {a} {item}, buys {b} more and then gives {c} to {other}. How many {item} does {name} have now?",
    "There are {a} {item} in a jar. {name} adds {b} and {other} takes out {c}. How many {item} are in the jar?",
)


@dataclass(kw_only=True)
class TaskSpec:
    """Which problems the generator makes and how large their numbers are."""

    kinds: tuple[str, ...] = KINDS
    """Problem kinds to draw from, uniformly: add, sub, mul, add_sub."""
    max_operand: int = 9
    """add/sub/add_sub operands are 1..max_operand (a subtraction's first operand up to 2 x max_operand)."""
    max_factor: int = 9
    """mul operands are 2..max_factor."""
    worked_solution: bool = True
    """SFT targets show the equations before the answer line ("3 + 5 = 8\\n#### 8"); else only "#### 8"."""
    verbose_fraction: float = 0.0
    """Share of SFT targets from a chatty teacher that first restates the problem in words (~30 tokens)."""

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or bad:
            raise ValueError(f"TaskSpec.kinds must be a non-empty subset of {KINDS}, got {self.kinds!r}")
        if self.max_operand < 1:
            raise ValueError(f"TaskSpec.max_operand must be >= 1, got {self.max_operand}")
        if self.max_factor < 2:
            raise ValueError(f"TaskSpec.max_factor must be >= 2, got {self.max_factor}")
        if not 0.0 <= self.verbose_fraction <= 1.0:
            raise ValueError(f"TaskSpec.verbose_fraction must be in [0, 1], got {self.verbose_fraction}")


@dataclass(kw_only=True)
class Problem:
    """One word problem with its worked solution and answer."""

    kind: str
    """One of KINDS."""
    question: str
    """The problem text (the user's message)."""
    equations: list[str] = field(default_factory=list)
    """The worked solution, one equation per line, e.g. ["3 + 5 = 8"]."""
    answer: int
    """The final answer."""
    restatement: str = ""
    """The problem retold in words, without any number (a chatty teacher's opening)."""

    @property
    def label(self) -> str:
        """GSM8K's answer line, the reward function's label."""
        return f"#### {self.answer}"

    def target(self, worked_solution: bool = True, verbose: bool = False) -> str:
        """The SFT response text (without the end-of-turn token); `verbose` opens with the restatement."""
        lines = [*self.equations, self.label] if worked_solution else [self.label]
        return "\n".join([self.restatement, *lines] if verbose else lines)


def generate_problem(rng: random.Random, spec: TaskSpec) -> Problem:
    """One problem of a kind drawn uniformly from `spec.kinds`."""
    kind = rng.choice(spec.kinds)
    name, other = rng.sample(_NAMES, 2)
    words = {"name": name, "other": other, "item": rng.choice(_ITEMS), "container": rng.choice(_CONTAINERS)}
    if kind == "add_sub":
        return _two_step(rng, spec, words)
    if kind == "add":
        a, b = rng.randint(1, spec.max_operand), rng.randint(1, spec.max_operand)
        answer, sign = a + b, "+"
    elif kind == "sub":
        b, answer = rng.randint(1, spec.max_operand), rng.randint(0, spec.max_operand)
        a, sign = answer + b, "-"
    else:
        a, b = rng.randint(2, spec.max_factor), rng.randint(2, spec.max_factor)
        answer, sign = a * b, "*"
    question = rng.choice(_TEMPLATES[kind]).format(a=a, b=b, **words)
    return Problem(
        kind=kind, question=question, equations=[f"{a} {sign} {b} = {answer}"], answer=answer,
        restatement=_RESTATEMENTS[kind].format(**words),
    )  # fmt: skip


def _two_step(rng: random.Random, spec: TaskSpec, words: dict[str, str]) -> Problem:
    """a + b = total, total - c = answer, with 1 <= c <= total so the answer is never negative."""
    a, b = rng.randint(1, spec.max_operand), rng.randint(1, spec.max_operand)
    total = a + b
    c = rng.randint(1, min(total, spec.max_operand))
    question = rng.choice(_TWO_STEP_TEMPLATES).format(a=a, b=b, c=c, **words)
    equations = [f"{a} + {b} = {total}", f"{total} - {c} = {total - c}"]
    restatement = _RESTATEMENTS["add_sub"].format(**words)
    return Problem(
        kind="add_sub", question=question, equations=equations, answer=total - c, restatement=restatement
    )


def generate_problems(num: int, spec: TaskSpec, *, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
    """`num` problems with distinct questions, none of them in `exclude`; deterministic in `seed`."""
    rng = random.Random(seed)
    seen = set(exclude)
    problems: list[Problem] = []
    misses = 0
    # The question space is finite: after this many duplicates in a row it is (nearly) used up; fail loudly.
    while len(problems) < num and misses < _MAX_CONSECUTIVE_DUPLICATES:
        problem = generate_problem(rng, spec)
        if problem.question in seen:
            misses += 1
            continue
        misses = 0
        seen.add(problem.question)
        problems.append(problem)
    if len(problems) < num:
        raise ValueError(f"TaskSpec {spec} yields only {len(problems)} distinct questions, {num} were asked")
    return problems


def make_splits(
    spec: TaskSpec, *, seed: int, num_train: int, num_eval: int
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): disjoint by question text; the eval split is drawn first so it depends only on seed."""
    eval_problems = generate_problems(num_eval, spec, seed=seed * 1000 + 1)
    train = generate_problems(
        num_train, spec, seed=seed * 1000 + 2, exclude=(p.question for p in eval_problems)
    )
    return train, eval_problems


def prompt_row(problem: Problem) -> dict:
    """The --prompt-data row of a problem: input (question), label ("#### N") and metadata."""
    return {
        "input": problem.question,
        "label": problem.label,
        "metadata": {"kind": problem.kind, "solution": "\n".join(problem.equations)},
    }


def sft_row(problem: Problem, worked_solution: bool = True, verbose: bool = False) -> dict:
    """The warm-up row of a problem: a two-message conversation."""
    return {
        "messages": [
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": problem.target(worked_solution, verbose)},
        ]
    }


def sft_rows(problems: list[Problem], spec: TaskSpec, *, seed: int) -> list[dict]:
    """Warm-up rows; a seeded `spec.verbose_fraction` of them in the chatty teacher's verbose style."""
    rng = random.Random(seed * 1000 + 3)
    return [sft_row(p, spec.worked_solution, rng.random() < spec.verbose_fraction) for p in problems]


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write one JSON object per line (parent directories created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_task_files(
    out_dir: str | Path, spec: TaskSpec, *, seed: int, num_train: int, num_eval: int
) -> dict[str, Path]:
    """Write train.jsonl, eval.jsonl (prompt rows) and sft.jsonl (the train split as conversations)."""
    train, eval_problems = make_splits(spec, seed=seed, num_train=num_train, num_eval=num_eval)
    out = Path(out_dir)
    return {
        "train": write_jsonl(map(prompt_row, train), out / "train.jsonl"),
        "eval": write_jsonl(map(prompt_row, eval_problems), out / "eval.jsonl"),
        "sft": write_jsonl(sft_rows(train, spec, seed=seed), out / "sft.jsonl"),
    }
