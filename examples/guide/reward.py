"""A custom reward function (slime's signature) for arithmetic answers, with a small bonus against repetition.

    clawrl train ... --custom-rm-path examples/guide/reward.py:reward

The label is the expected number, as GSM8K writes it (`#### 8`) or bare (`8`). The reward is 1.0 when the last
number in the response equals it, plus up to 0.1 for the share of distinct tokens in the response (a model
that repeats one token gets ~0, one that never repeats gets 0.1). The bonus also keeps the rewards of a
group apart while the model cannot answer yet, so GRPO has a signal from the first rollout.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
REPETITION_BONUS = 0.1


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands commas removed), or None."""
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


async def reward(args, sample, **kwargs) -> float:
    """slime's signature: `args` holds every flag (unused here), `sample` the finished clawrl Sample."""
    expected = last_number(str(sample.label or ""))
    answer = last_number(sample.response or "")
    correct = 1.0 if expected is not None and answer == expected else 0.0
    response_tokens = sample.tokens[len(sample.tokens) - sample.response_length :]
    distinct_share = len(set(response_tokens)) / max(len(response_tokens), 1)
    return correct + REPETITION_BONUS * distinct_share
