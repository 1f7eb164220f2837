"""RolloutDataSource: slime's DataSource API over a resumable PromptSource, plus a buffer of groups.

What `--rollout-function-path` functions receive as `data_source`:

    groups = data_source.get_samples(num_groups)   # list of groups, each --n-samples-per-prompt Samples
    data_source.add_samples(groups)                # put groups back; served before new prompts
    data_source.save(rollout_id) / load(rollout_id=None)    # <--save|--load>/rollout/data_source_<id>.json
    len(data_source)                               # prompts per epoch
    data_source.state_dict() / load_state_dict(state)       # plain types (cursor + buffered groups)

Without a prompt dataset (a custom rollout function that makes its own prompts) `get_samples` hands out
empty Samples that only carry group/sample indices, as slime does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from clawrl.data.sample import Sample
from clawrl.data.source import PromptSource

_STATE_FILE = "data_source_{rollout_id}.json"


class RolloutDataSource:
    """Groups of prompt samples: the buffer first (oldest first), then the PromptSource's cursor."""

    def __init__(
        self,
        source: PromptSource | None,
        n_samples_per_prompt: int,
        *,
        save_dir: str | None = None,
        load_dir: str | None = None,
    ) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {n_samples_per_prompt}")
        self.source = source
        self.n_samples_per_prompt = n_samples_per_prompt
        self.save_dir = save_dir
        self.load_dir = load_dir
        self._buffer: list[list[Sample]] = []
        # Indices for sample-less operation (no dataset): continue across calls like the PromptSource's.
        self._next_group_index = 0
        self._next_sample_index = 0

    def __len__(self) -> int:
        """Prompts per epoch (0 without a dataset)."""
        return 0 if self.source is None else len(self.source)

    @property
    def buffer_size(self) -> int:
        """Groups waiting in the buffer."""
        return len(self._buffer)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next `num_samples` groups (slime counts groups here, despite the name)."""
        if num_samples < 0:
            raise ValueError(f"get_samples: num_samples must be >= 0, got {num_samples}")
        groups, self._buffer = self._buffer[:num_samples], self._buffer[num_samples:]
        missing = num_samples - len(groups)
        if self.source is not None:
            groups += self.source.get_groups(missing, self.n_samples_per_prompt)
        else:
            groups += [self._empty_group() for _ in range(missing)]
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Append groups to the buffer; each must hold exactly --n-samples-per-prompt Samples."""
        for position, group in enumerate(samples):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise ValueError(f"add_samples: group {position} is not a list of Samples: {group!r:.100}")
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(
                    f"add_samples: group {position} has {len(group)} samples, "
                    f"--n-samples-per-prompt is {self.n_samples_per_prompt}"
                )
        self._buffer.extend(samples)

    # --------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Cursor and buffer as plain types (json / torch.load(weights_only=True) safe)."""
        return {
            "source": None if self.source is None else self.source.state_dict(),
            "buffer": [[sample.to_dict() for sample in group] for group in self._buffer],
            "next_group_index": self._next_group_index,
            "next_sample_index": self._next_sample_index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` of a data source over the same dataset."""
        missing = [key for key in ("source", "buffer") if key not in state]
        if missing:
            raise ValueError(f"data source state is missing {missing}; got keys {sorted(state)}")
        if (state["source"] is None) != (self.source is None):
            raise ValueError(
                "data source state was saved "
                + ("without" if state["source"] is None else "with")
                + " a prompt dataset but this one "
                + ("has one (--prompt-data)" if self.source is not None else "has none")
            )
        if self.source is not None:
            self.source.load_state_dict(state["source"])
        self._buffer = [[Sample.from_dict(d) for d in group] for group in state["buffer"]]
        self._next_group_index = int(state.get("next_group_index", 0))
        self._next_sample_index = int(state.get("next_sample_index", 0))

    def save(self, rollout_id: int) -> str:
        """Write the state to <save_dir>/rollout/data_source_<rollout_id>.json; returns the path."""
        if self.save_dir is None:
            raise ValueError("data_source.save needs --save DIR (unset)")
        path = os.path.join(self.save_dir, "rollout", _STATE_FILE.format(rollout_id=rollout_id))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated state file behind
        return path

    def load(self, rollout_id: int | None = None) -> bool:
        """Load <load_dir>/rollout/data_source_<rollout_id>.json (None: the latest); False if there is none."""
        if self.load_dir is None:
            return False
        directory = os.path.join(self.load_dir, "rollout")
        if rollout_id is None:
            rollout_id = _latest_rollout_id(directory)
            if rollout_id is None:
                return False
        path = os.path.join(directory, _STATE_FILE.format(rollout_id=rollout_id))
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))
        return True

    def _empty_group(self) -> list[Sample]:
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(Sample(group_index=self._next_group_index, index=self._next_sample_index))
            self._next_sample_index += 1
        self._next_group_index += 1
        return group


def _latest_rollout_id(directory: str) -> int | None:
    if not os.path.isdir(directory):
        return None
    prefix, suffix = _STATE_FILE.split("{rollout_id}")
    ids = [
        int(name[len(prefix) : -len(suffix)])
        for name in os.listdir(directory)
        if name.startswith(prefix) and name.endswith(suffix) and name[len(prefix) : -len(suffix)].isdigit()
    ]
    return max(ids) if ids else None
