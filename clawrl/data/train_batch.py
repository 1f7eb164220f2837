"""TrainBatch: the samples of one rollout in the form the trainer consumes (the rollout -> trainer hand-off).

Plain Python lists only (it crosses Ray and is written to debug dumps). One entry per sample, in rollout
order; per-token lists cover the response only (length = response_lengths[i]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from clawrl.data.sample import Sample, Status


@dataclass(kw_only=True)
class TrainBatch:
    """One rollout's training data."""

    rollout_id: int
    """Rollout step these samples come from."""
    tokens: list[list[int]]
    """Prompt + response token ids per sample."""
    response_lengths: list[int]
    """Response tokens at the end of each `tokens` entry."""
    loss_masks: list[list[int]]
    """Per response token: 1 trained on, 0 not (tool output); all zeros for removed samples."""
    rewards: list[float]
    """Scalar reward per sample after group normalisation (the advantage estimator's input)."""
    raw_rewards: list[float]
    """Scalar reward per sample as the reward function returned it (for logging)."""
    rollout_log_probs: list[list[float]] | None = None
    """Per response token: the engine's log-prob of the sampled token (temperature-scaled); None if absent."""
    truncated: list[int] | None = None
    """1 where the response hit the length limit."""
    sample_indices: list[int] | None = None
    """Sample.index of each entry (to trace a row back to its sample)."""
    group_indices: list[int] | None = None
    """Sample.group_index of each entry."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("response_lengths", "loss_masks", "rewards", "raw_rewards"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, tokens has {n}")
        for i, (toks, r, m) in enumerate(
            zip(self.tokens, self.response_lengths, self.loss_masks, strict=True)
        ):
            if not 0 < r < len(toks) + 1 or len(m) != r:
                raise ValueError(
                    f"TrainBatch sample {i}: response_length {r}, {len(toks)} tokens, loss mask of {len(m)}"
                )
            if r == len(toks):
                raise ValueError(f"TrainBatch sample {i}: no prompt token before the {r} response tokens")
        if self.rollout_log_probs is not None:
            bad = [
                i
                for i, (lp, r) in enumerate(zip(self.rollout_log_probs, self.response_lengths, strict=True))
                if len(lp) != r
            ]
            if bad:
                raise ValueError(f"TrainBatch sample {bad[0]}: rollout_log_probs length != response_length")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def total_lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @classmethod
    def from_samples(
        cls, rollout_id: int, samples: list[Sample], rewards: list[float], raw_rewards: list[float]
    ) -> TrainBatch:
        """Build from rewarded samples; `rewards` are the normalised ones, `raw_rewards` the originals."""
        has_logprobs = all(s.rollout_log_probs is not None for s in samples)
        return cls(
            rollout_id=rollout_id,
            tokens=[list(s.tokens) for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[
                [0] * s.response_length
                if s.remove_sample
                else list(s.loss_mask if s.loss_mask is not None else [1] * s.response_length)
                for s in samples
            ],
            rewards=[float(r) for r in rewards],
            raw_rewards=[float(r) for r in raw_rewards],
            rollout_log_probs=[list(s.rollout_log_probs) for s in samples] if has_logprobs else None,
            truncated=[int(s.status == Status.TRUNCATED) for s in samples],
            sample_indices=[s.index for s in samples],
            group_indices=[s.group_index for s in samples],
        )

    def select(self, indices: list[int]) -> TrainBatch:
        """A TrainBatch of the given entries, in the given order."""
        values: dict[str, Any] = {"rollout_id": self.rollout_id}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "rollout_id":
                values[f.name] = None if value is None else [value[i] for i in indices]
        return TrainBatch(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainBatch:
        return cls(**data)
