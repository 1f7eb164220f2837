"""What `clawrl debug show` shows, shared by its terminal view (show.py) and its HTML page (show_html.py):
the `Shown` record of one dump and the per-sample values both views print (reward, log-prob mismatch,
prompt text). A module of its own so that the two views import it instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from clawrl.data.sample import Sample
from clawrl.debug.dump import RolloutDump


@dataclass(kw_only=True)
class Shown:
    """One dump to show, with its train dump when there is one."""

    dump: RolloutDump
    """The rollout or eval dump."""
    train: dict[str, Any] | None = None
    """The train dump of the same rollout id (what the trainer consumed), or None."""
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Train records by the position of their sample in `dump.samples` (only records whose tokens match)."""


def reward_value(sample: Sample, reward_key: str | None) -> float | None:
    """The sample's scalar reward (a dict reward needs `reward_key`); None when there is none."""
    reward = sample.reward
    if isinstance(reward, dict):
        reward = reward.get(reward_key) if reward_key is not None else None
    return float(reward) if isinstance(reward, (int, float)) else None


def logprob_diff(record: dict) -> torch.Tensor | None:
    """|trainer log-prob - rollout log-prob| per response token of a train record (None if either is absent)."""
    train, rollout = record.get("log_probs"), record.get("rollout_log_probs")
    if not isinstance(train, torch.Tensor) or not isinstance(rollout, torch.Tensor):
        return None
    if train.shape != rollout.shape:
        return None
    return (train.float() - rollout.float()).abs()


def prompt_text(prompt: Any) -> str:
    """A prompt as text: chat messages become "[role] content" lines."""
    if isinstance(prompt, list):
        return "\n".join(
            f"[{m.get('role', '?')}] {m.get('content', '')}" if isinstance(m, dict) else str(m)
            for m in prompt
        )
    return str(prompt)
