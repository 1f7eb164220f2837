"""`--rm-type f1`: SQuAD-style token F1 between the response and the label.

Trailing end-of-turn special tokens (`<|im_end|>`, `</s>`, ...) are stripped from the response. Both texts
are normalised: lower case, punctuation removed, the articles a/an/the removed, whitespace
collapsed; then split into tokens. F1 = 2PR/(P+R) over the multiset of shared tokens. If either side
normalises to "yes", "no" or "noanswer", the other must be exactly the same, else the score is 0.0. A list
label (several acceptable answers) scores the best of them. The whole response is compared; use
`--rm-type boxed_f1` to compare only the last `\\boxed{}` content.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from clawrl.rollout.rewards.special_tokens import strip_end_tokens

_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})
_PUNCTUATION = frozenset(string.punctuation)


def normalise_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> tuple[float, float, float]:
    """(f1, precision, recall) of the normalised token multisets."""
    pred_norm, ref_norm = normalise_text(prediction), normalise_text(reference)
    if (pred_norm in _SPECIAL_ANSWERS or ref_norm in _SPECIAL_ANSWERS) and pred_norm != ref_norm:
        return 0.0, 0.0, 0.0
    pred_tokens, ref_tokens = pred_norm.split(), ref_norm.split()
    num_same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if num_same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = num_same / len(pred_tokens), num_same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward_value(response: str, label: Any) -> float:
    """Best F1 of the response against the label (or each label of a list); empty label -> 0.0."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    response = strip_end_tokens(response)
    scores = [f1_score(response, str(item))[0] for item in labels if item is not None and str(item).strip()]
    return max(scores, default=0.0)


async def f1_reward(sample, **kw) -> float:
    """Reward for `--rm-type f1`: token F1 of `sample.response` against `sample.label`."""
    return f1_reward_value(sample.response, sample.label)
