"""The Sample record: one prompt + one response as it travels rollout -> reward -> trainer.

A Sample crosses process boundaries (Ray) and is written to disk (rollout dumps), so it holds only plain
types: numbers, strings, lists and dicts. `to_dict` / `from_dict` round-trip it losslessly.

Field names follow slime's `Sample` so that user plugins written against slime read the same attributes.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Where a sample is in its life; stored as its string value."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


# Engine finish_reason["type"] -> status (SGLang's vocabulary).
_FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass(kw_only=True)
class Sample:
    """One rollout sample. Per-token lists over the response have length `response_length`."""

    group_index: int | None = None
    """Index of the prompt group (all `--n-samples-per-prompt` copies of a prompt share it)."""
    index: int | None = None
    """Global index of this sample, unique within a run."""
    rollout_id: int | None = None
    """Rollout step that produced this sample."""
    prompt: str | list[dict[str, Any]] = ""
    """The prompt: plain text, or a list of chat messages."""
    tokens: list[int] = field(default_factory=list)
    """Prompt + response token ids."""
    response: str = ""
    """Decoded response text."""
    response_length: int = 0
    """Number of response tokens at the end of `tokens`."""
    label: Any = None
    """Reference answer for the reward function (from `--label-key`)."""
    reward: float | dict[str, Any] | None = None
    """Reward: a number, or a dict (pick the value with `--reward-key`)."""
    loss_mask: list[int] | None = None
    """Per response token: 1 = trained on, 0 = not (tool output, env text). None means all ones."""
    rollout_log_probs: list[float] | None = None
    """Per response token: log-prob under the engine's temperature-scaled sampling distribution."""
    teacher_log_probs: list[float] | None = None
    """Per response token: log-prob under a teacher (on-policy distillation)."""
    weight_versions: list[str] = field(default_factory=list)
    """Weight versions that generated the response, in order: one per generate call (so one per segment of a
    resumed partial rollout, e.g. ["3", "4"]), one more per weight change within a call, none for a call
    aborted before its first token. Written to rollout dumps; rollout/weight_version{,_max} and
    rollout/weight_staleness/* are computed from it."""
    status: Status = Status.PENDING
    """pending / completed / truncated / aborted / failed."""
    remove_sample: bool = False
    """If set, the sample keeps its place in reward normalisation but contributes no loss."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form per-sample data from the dataset (`--metadata-key`) and from plugins."""
    train_metadata: dict[str, Any] | None = None
    """Extra data handed to the trainer unchanged."""
    generate_function_path: str | None = None
    """Per-sample override of `--custom-generate-function-path`."""
    custom_rm_path: str | None = None
    """Per-sample override of `--custom-rm-path`."""
    session_id: str | None = None
    """Routing key: requests of one session go to the same engine (prefix-cache reuse)."""
    non_generation_time: float = 0.0
    """Seconds spent outside the engine (tools, environment) while producing this sample."""

    # ----------------------------------------------------------------------------------------------
    @property
    def effective_response_length(self) -> int:
        """Number of response tokens that are trained on."""
        return self.response_length if self.loss_mask is None else int(sum(self.loss_mask))

    def get_reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward; `reward_key` selects it from a dict reward."""
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise ValueError(
                    f"sample {self.index}: reward is a dict with keys {sorted(self.reward)}; "
                    "pass --reward-key to choose one"
                )
            return float(self.reward[reward_key])
        if self.reward is None:
            raise ValueError(f"sample {self.index}: reward is not set")
        return float(self.reward)

    def append_response(
        self,
        token_ids: list[int],
        log_probs: list[float] | None,
        text: str,
        *,
        trainable: bool = True,
    ) -> None:
        """Extend the response with engine output (trainable) or environment/tool tokens (not trained on)."""
        if log_probs is not None and len(log_probs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(log_probs)} log-probs")
        if trainable and log_probs is None:
            raise ValueError("trainable tokens need their rollout log-probs")
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * self.response_length
        self.tokens.extend(token_ids)
        self.response += text
        self.response_length += len(token_ids)
        self.loss_mask.extend([1 if trainable else 0] * len(token_ids))
        # Non-trainable tokens get placeholder log-probs: they are masked out of every loss and metric.
        self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(token_ids))

    def apply_finish(self, finish_reason: dict[str, Any] | None, weight_version: str | None) -> None:
        """Record the end of one generate call: its weight version and the resulting status."""
        if weight_version is not None:
            self.weight_versions.append(str(weight_version))
        if finish_reason is not None:
            self.status = _FINISH_TO_STATUS.get(finish_reason.get("type"), self.status)

    # ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-type dict (status as its string value); `Sample.from_dict` inverts it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["status"] = self.status.value
        out.update(self.__dict__.get("_extra", {}))
        return _plain_copy(out)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict`. Unknown keys (written by plugins or newer versions) are kept as extras."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = _plain_copy({k: v for k, v in data.items() if k in names})
        if "status" in known:  # after the copy, which turns enums back into their string values
            known["status"] = Status(known["status"])
        sample = cls(**known)
        extra = {k: v for k, v in data.items() if k not in names}
        if extra:
            sample.__dict__["_extra"] = _plain_copy(extra)
        return sample

    @property
    def extra(self) -> dict[str, Any]:
        """Fields not declared on Sample that came in through `from_dict` (kept for the round trip)."""
        return self.__dict__.setdefault("_extra", {})


def _plain_copy(value: Any) -> Any:
    """Deep copy of nested plain containers, so a dict never aliases the Sample's lists."""
    if isinstance(value, dict):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_copy(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value
