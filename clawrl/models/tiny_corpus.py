"""A procedurally generated English + arithmetic + code + JSON corpus for training tiny offline tokenizers.

Nothing is downloaded: every document is built from the word lists and templates below with a seeded
`random.Random`, so the same seed always yields the same corpus (and therefore the same trained tokenizer).
The mix mirrors what the tiny models are used for in tests and demos: GSM8K-style word problems with
`#### 8` answers, `\\boxed{}` math, number words, Python-ish code, and JSON tool definitions / tool calls.

    from clawrl.models.tiny_corpus import tiny_corpus
    docs = tiny_corpus()          # list[str], deterministic
"""

from __future__ import annotations

import itertools
import json
import random

NAMES = [
    "Tom",
    "Anna",
    "Ben",
    "Lily",
    "Sam",
    "Mia",
    "Jack",
    "Emma",
    "Leo",
    "Zoe",
    "Max",
    "Ava",
    "Noah",
    "Ella",
    "Liam",
    "Grace",
    "Omar",
    "Nina",
    "Ravi",
    "Sara",
    "Kenji",
    "Lucia",
    "Pedro",
    "Fatima",
    "Hugo",
    "Ines",
    "Ivan",
    "Yara",
    "Felix",
    "Chloe",
    "Marco",
    "Julia",
    "Oscar",
    "Rosa",
    "Theo",
    "Clara",
]
ITEMS = [
    "apples",
    "oranges",
    "pencils",
    "books",
    "marbles",
    "cookies",
    "stickers",
    "cards",
    "eggs",
    "cupcakes",
    "shells",
    "stamps",
    "coins",
    "balloons",
    "flowers",
    "candies",
    "toys",
    "bottles",
    "boxes",
    "chairs",
    "tickets",
    "pens",
    "cars",
    "shirts",
    "plates",
    "cups",
    "bananas",
    "muffins",
    "crayons",
    "blocks",
]
PLACES = [
    "store",
    "market",
    "school",
    "library",
    "park",
    "bakery",
    "garden",
    "farm",
    "zoo",
    "beach",
    "museum",
    "office",
    "kitchen",
    "station",
]
ADJECTIVES = [
    "small",
    "large",
    "red",
    "blue",
    "green",
    "old",
    "new",
    "happy",
    "quick",
    "slow",
    "bright",
    "dark",
    "heavy",
    "light",
    "warm",
    "cold",
    "busy",
    "quiet",
    "simple",
    "strange",
    "careful",
    "famous",
    "gentle",
]
NOUNS = [
    "model",
    "engine",
    "token",
    "reward",
    "policy",
    "sample",
    "batch",
    "prompt",
    "answer",
    "question",
    "student",
    "teacher",
    "river",
    "city",
    "window",
    "garden",
    "machine",
    "number",
    "system",
    "server",
    "client",
    "request",
    "response",
    "function",
    "value",
    "result",
    "world",
    "story",
    "problem",
    "lesson",
    "friend",
    "family",
    "morning",
    "evening",
    "weather",
    "journey",
    "market",
]
VERBS = [
    "reads",
    "writes",
    "builds",
    "finds",
    "sees",
    "makes",
    "takes",
    "gives",
    "keeps",
    "opens",
    "closes",
    "learns",
    "counts",
    "checks",
    "sends",
    "moves",
    "carries",
    "paints",
    "visits",
    "explains",
    "solves",
    "computes",
    "trains",
    "samples",
    "returns",
]
ADVERBS = [
    "quickly",
    "slowly",
    "carefully",
    "often",
    "never",
    "always",
    "today",
    "yesterday",
    "again",
    "together",
]
ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
]
ONES += ["sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ran",
    "te",
    "so",
    "vu",
    "pel",
    "dor",
    "is",
    "an",
    "ek",
    "ul",
    "tar",
    "wen",
    "gri",
    "fo",
    "shu",
    "ba",
    "ne",
    "zi",
    "qua",
    "rot",
    "lem",
]
CODE_WORDS = [
    "value",
    "count",
    "total",
    "items",
    "result",
    "index",
    "data",
    "config",
    "model",
    "batch",
    "tokens",
    "reward",
    "loss",
    "step",
    "name",
    "path",
    "size",
    "offset",
    "buffer",
    "weights",
    "logits",
    "labels",
    "mask",
]
CITIES = [
    "Paris",
    "Tokyo",
    "Lima",
    "Cairo",
    "Oslo",
    "Delhi",
    "Rome",
    "Austin",
    "Berlin",
    "Sydney",
    "Nairobi",
    "Seoul",
]


def number_to_words(n: int) -> str:
    """English words for 0 <= n < 1,000,000 (e.g. 342 -> 'three hundred forty-two')."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10 - 2] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + number_to_words(n % 100)
        return ONES[n // 100] + " hundred" + rest
    rest = "" if n % 1000 == 0 else " " + number_to_words(n % 1000)
    return number_to_words(n // 1000) + " thousand" + rest


def _word_problem(rng: random.Random) -> str:
    """A GSM8K-style problem, a worked solution and the `#### N` answer line."""
    name, other = rng.sample(NAMES, 2)
    item, place = rng.choice(ITEMS), rng.choice(PLACES)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    kind = rng.randrange(4)
    if kind == 0:
        question = (
            f"{name} has {a} {item} and buys {b} more at the {place}. How many {item} does {name} have?"
        )
        work, answer = f"{name} has {a} + {b} = {a + b} {item}.", a + b
    elif kind == 1:
        a = a + b
        question = f"{name} had {a} {item} and gave {b} to {other}. How many {item} are left?"
        work, answer = f"{a} - {b} = {a - b} {item} are left.", a - b
    elif kind == 2:
        a, b = a % 12 + 2, b % 9 + 2
        question = f"Each box holds {a} {item}. {name} fills {b} boxes. How many {item} are there in total?"
        work, answer = f"{a} * {b} = {a * b}, so there are {a * b} {item}.", a * b
    else:
        price = rng.randint(1, 20)
        question = (
            f"One of the {item} costs ${price}. {name} buys {b} of them. How much money does {name} spend?"
        )
        work, answer = f"{name} spends {price} * {b} = ${price * b}.", price * b
    return f"Question: {question}\nAnswer: {work}\n#### {answer}"


def _math_text(rng: random.Random) -> str:
    """LaTeX-flavoured math with a final \\boxed{} answer."""
    x, y, z = rng.randint(1, 30), rng.randint(2, 12), rng.randint(1, 99)
    choices = (
        f"Solve for $x$: ${y}x + {z} = {y * x + z}$. Subtracting {z} gives ${y}x = {y * x}$, so $x = {x}$. "
        f"The answer is $\\boxed{{{x}}}$.",
        f"Compute $\\frac{{{x}}}{{{y}}} + \\frac{{1}}{{{y}}}$. The sum is $\\frac{{{x + 1}}}{{{y}}}$, "
        f"so the final answer is \\boxed{{\\frac{{{x + 1}}}{{{y}}}}}.",
        f"What is {x}% of {z * 10}? We have {x} / 100 * {z * 10} = {x * z / 10:g}. Final answer: \\boxed{{{x * z / 10:g}}}",
        f"Let $f(x) = x^2 + {y}$. Then $f({x}) = {x}^2 + {y} = {x * x + y}$. Therefore \\boxed{{{x * x + y}}}.",
        f"The number {number_to_words(z)} is written as {z}, and {number_to_words(x * 100 + z)} is {x * 100 + z}.",
        f"The {rng.choice(ORDINALS)} term is {x}, the common difference is {y}, so the next term is {x + y}.",
    )
    return rng.choice(choices)


def _invent_lexicon(num_words: int, seed: int) -> list[str]:
    """Invented words (syllable strings). Real word lists run out of frequent merges near a 3k vocab."""
    rng = random.Random(seed)
    words: dict[str, None] = {}  # insertion-ordered set, for determinism
    while len(words) < num_words:
        words["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))] = None
    return list(words)


_LEXICON = _invent_lexicon(12000, seed=1234)
# Zipf-like weights: frequent invented words become whole tokens, rare ones stay split, as in real text.
_LEXICON_CUM_WEIGHTS = list(itertools.accumulate(1.0 / (rank + 100) for rank in range(len(_LEXICON))))


def _pseudo_word(rng: random.Random) -> str:
    """An invented word drawn Zipf-like from the lexicon."""
    return rng.choices(_LEXICON, cum_weights=_LEXICON_CUM_WEIGHTS)[0]


def _glossary(rng: random.Random) -> str:
    """A line of invented words with definitions: keeps the BPE trainer supplied with merges up to ~8k."""
    entries = [
        f"{_pseudo_word(rng)} ({rng.choice(ADJECTIVES)} {_pseudo_word(rng)})"
        for _ in range(rng.randint(8, 24))
    ]
    return ", ".join(entries) + "."


def _prose(rng: random.Random) -> str:
    """A few plain English sentences, some with invented names and places."""
    sentences = []
    for _ in range(rng.randint(2, 5)):
        subject = rng.choice([rng.choice(NAMES), "The " + rng.choice(NOUNS), _pseudo_word(rng).capitalize()])
        obj = f"{rng.choice(('a', 'the', 'every'))} {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        tail = rng.choice(
            ("", f" in {rng.choice(CITIES)}", f" near the {rng.choice(PLACES)}", f" with {_pseudo_word(rng)}")
        )
        sentences.append(f"{subject} {rng.choice(VERBS)} {obj} {rng.choice(ADVERBS)}{tail}.")
    if rng.random() < 0.3:
        sentences.append(f"It's {number_to_words(rng.randint(1, 99))} o'clock, and they're not late.")
    return " ".join(sentences)


def _code(rng: random.Random) -> str:
    """A small Python function."""
    fn = f"{rng.choice(VERBS).rstrip('s')}_{rng.choice(CODE_WORDS)}"
    arg, other = rng.sample(CODE_WORDS, 2)
    n = rng.randint(1, 99)
    body = rng.choice(
        (
            f"    {other} = 0\n    for i in range(len({arg})):\n        {other} += {arg}[i] * {n}\n    return {other}\n",
            f'    if {arg} is None:\n        raise ValueError("{arg} must be set")\n    return {{"{other}": {arg}, "n": {n}}}\n',
            f'    {other} = [x for x in {arg} if x > {n}]\n    print(f"{{len({other})}} items")\n    return {other}\n',
        )
    )
    return f'def {fn}({arg}, {other}={n}):\n    """Return the {other} of {arg}."""\n{body}'


def _tool_json(rng: random.Random) -> str:
    """A JSON tool definition or a tool call, as they appear in chat templates and responses."""
    city, n = rng.choice(CITIES), rng.randint(1, 500)
    if rng.random() < 0.5:
        spec = {
            "type": "function",
            "function": {
                "name": f"get_{rng.choice(CODE_WORDS)}",
                "description": f"Return the {rng.choice(NOUNS)} for a {rng.choice(NOUNS)}.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
        return json.dumps(spec)
    call = rng.choice(
        (
            {"name": "get_weather", "arguments": {"city": city}},
            {
                "name": "calculator",
                "arguments": {"expression": f"{n} * {rng.randint(2, 9)} + {rng.randint(1, 50)}"},
            },
            {
                "name": "search",
                "arguments": {"query": f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}", "limit": n},
            },
        )
    )
    result = {"result": n, "status": "ok", "city": city}
    return f"{json.dumps(call)}\n{json.dumps(result)}"


def _chat_words(rng: random.Random) -> str:
    """Role names and reasoning phrases that appear around chat-template special tokens."""
    role = rng.choice(("system", "user", "assistant", "tool"))
    return f"{role}\nYou are a helpful assistant. Let me think step by step. {_prose(rng)}"


_GENERATORS = (
    _word_problem,
    _word_problem,
    _math_text,
    _prose,
    _glossary,
    _glossary,
    _code,
    _tool_json,
    _chat_words,
)


def tiny_corpus(num_docs: int = 6000, seed: int = 0) -> list[str]:
    """`num_docs` documents mixing word problems, math, prose, code and JSON; deterministic in `seed`."""
    rng = random.Random(seed)
    return [rng.choice(_GENERATORS)(rng) for _ in range(num_docs)]
