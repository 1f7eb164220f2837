"""PromptSource: a resumable cursor over a PromptDataset that hands out groups of samples.

Each call to `get_groups(num_groups, n)` takes the next `num_groups` prompts and copies each one `n` times
(`--n-samples-per-prompt`); the copies share a `group_index` and get consecutive global `index` values. When
the dataset is exhausted the cursor wraps into the next epoch. With `shuffle=True` (`--rollout-shuffle`) every
epoch visits the prompts in the order of a permutation seeded by `seed + epoch` (`--rollout-seed`), so the
sequence of samples is a pure function of (dataset, seed, number of samples drawn so far).

`state_dict()` holds only ints; `load_state_dict()` on a fresh PromptSource over the same dataset continues
with exactly the samples the original would have produced next.

    source = PromptSource(dataset, shuffle=True, seed=42)
    groups = source.get_groups(num_groups=8, n_samples_per_prompt=4)   # 8 lists of 4 Samples
"""

from __future__ import annotations

import copy
import random
from typing import Any

from clawrl.data.dataset import PromptDataset
from clawrl.data.sample import Sample

_STATE_KEYS = ("epoch", "offset", "next_group_index", "next_sample_index", "num_prompts")


class PromptSource:
    """Hands out prompt groups in (optionally shuffled) epoch order; resumable via state_dict."""

    def __init__(self, dataset: PromptDataset, *, shuffle: bool = False, seed: int = 0) -> None:
        if len(dataset) == 0:
            raise ValueError(f"{dataset.path}: no prompts left (after --rollout-max-prompt-len filtering)")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._epoch = 0
        self._offset = 0  # position in this epoch's order of the next prompt to hand out
        self._next_group_index = 0
        self._next_sample_index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        """Number of prompts per epoch."""
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        """Epoch of the next prompt to be handed out (0-based)."""
        return self._epoch

    def get_groups(self, num_groups: int, n_samples_per_prompt: int) -> list[list[Sample]]:
        """The next `num_groups` prompts, each as `n_samples_per_prompt` independent Sample copies."""
        if num_groups < 0 or n_samples_per_prompt < 1:
            raise ValueError(
                f"need num_groups >= 0 and n_samples_per_prompt >= 1, got {num_groups}, {n_samples_per_prompt}"
            )
        return [self._next_group(n_samples_per_prompt) for _ in range(num_groups)]

    def state_dict(self) -> dict[str, int]:
        """Cursor position as plain ints (safe for json / torch.load(weights_only=True))."""
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "next_group_index": self._next_group_index,
            "next_sample_index": self._next_sample_index,
            "num_prompts": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; the dataset must have the same number of prompts."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"prompt source state is missing {missing}; got keys {sorted(state)}")
        if state["num_prompts"] != len(self.dataset):
            raise ValueError(
                f"prompt source state was saved for {state['num_prompts']} prompts but {self.dataset.path} "
                f"now has {len(self.dataset)}; resuming would hand out different prompts"
            )
        if not 0 <= state["offset"] <= len(self.dataset):
            raise ValueError(
                f"prompt source state offset={state['offset']} is outside 0..{len(self.dataset)}"
            )
        self._epoch = int(state["epoch"])
        self._offset = int(state["offset"])
        self._next_group_index = int(state["next_group_index"])
        self._next_sample_index = int(state["next_sample_index"])
        self._order = self._epoch_order(self._epoch)

    # --------------------------------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _next_group(self, n_samples_per_prompt: int) -> list[Sample]:
        if self._offset == len(self._order):
            self._epoch += 1
            self._offset = 0
            self._order = self._epoch_order(self._epoch)
        prototype = self.dataset[self._order[self._offset]]
        self._offset += 1
        group = []
        for _ in range(n_samples_per_prompt):
            sample = copy.deepcopy(prototype)  # copies never share prompt/metadata containers
            sample.group_index = self._next_group_index
            sample.index = self._next_sample_index
            self._next_sample_index += 1
            group.append(sample)
        self._next_group_index += 1
        return group
