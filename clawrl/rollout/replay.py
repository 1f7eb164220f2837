"""ReplaySource: rollouts read back from `--save-debug-rollout-data` dumps instead of generated
(`--load-debug-rollout-data TEMPLATE`, which implies `--debug-train-only`: no engine is started).

    source = ReplaySource(job)
    source.num_rollout()                  # --num-rollout, else how many consecutive dumps exist from 0
    batch, metrics = source.generate(k)   # TEMPLATE.format(rollout_id=k) -> the same TrainBatch the run built

The batch is built by the same function as a live rollout (`train_batch_from_groups`), from the saved raw
rewards, so a replay trains on exactly the data the original run trained on. With
`--load-debug-rollout-data-subsample R` only part of each rollout is kept (clawrl.debug.dump.subsample).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from clawrl.config.errors import ConfigError
from clawrl.data.sample import Sample
from clawrl.data.train_batch import TrainBatch
from clawrl.rollout.manager import train_batch_from_groups
from clawrl.rollout.metrics import rollout_metrics

logger = logging.getLogger(__name__)


class ReplaySource:
    """Training batches from rollout dumps, one file per rollout id."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.template: str = job.debug.load_debug_rollout_data
        self.ratio: float | None = job.debug.load_debug_rollout_data_subsample

    def path(self, rollout_id: int) -> str:
        from clawrl.debug.dump import dump_path

        return str(dump_path(self.template, rollout_id))

    def num_rollout(self) -> int:
        """--num-rollout if given, else the number of dumps 0, 1, 2, ... that exist. Every dump the run
        will read must exist (checked now, before the trainer starts)."""
        count = next(k for k in itertools.count() if not os.path.exists(self.path(k)))
        wanted = self.job.rollout.num_rollout
        if wanted is None:
            if count == 0:
                raise ConfigError(self._missing(0))
            logger.info("--load-debug-rollout-data: %d rollout dumps found, --num-rollout %d", count, count)
            self._check_subsample_fits()
            return count
        if count < wanted:
            raise ConfigError(f"{self._missing(count)} (--num-rollout {wanted})")
        self._check_subsample_fits()
        return wanted

    def _check_subsample_fits(self) -> None:
        """With --load-debug-rollout-data-subsample the kept samples must fill whole optimizer steps."""
        if self.ratio is None:
            return
        from clawrl.debug.dump import load_rollout_dump, subsample

        kept = len(subsample(load_rollout_dump(self.path(0)).samples, self.ratio))
        step = self.job.train.global_batch_size
        if kept == 0 or kept % step:
            raise ConfigError(
                f"--load-debug-rollout-data-subsample {self.ratio} keeps {kept} samples of {self.path(0)}, "
                f"not a multiple of --global-batch-size {step}; pass --global-batch-size {max(kept, 1)} "
                "(or a divisor of it)"
            )

    def _missing(self, rollout_id: int) -> str:
        return (
            f"--load-debug-rollout-data {self.template!r}: no dump for rollout {rollout_id}: "
            f"{self.path(rollout_id)} does not exist"
        )

    def generate(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        from clawrl.debug.dump import load_rollout_dump, subsample

        path = self.path(rollout_id)
        if not os.path.exists(path):
            raise FileNotFoundError(self._missing(rollout_id))
        samples = load_rollout_dump(path).samples
        if self.ratio is not None:
            kept = subsample(samples, self.ratio)
            if not kept:
                raise ValueError(
                    f"--load-debug-rollout-data-subsample {self.ratio} keeps none of the {len(samples)} "
                    f"samples of {path}"
                )
            samples = kept
        groups = regroup(samples)
        producer = f"--load-debug-rollout-data {path}"
        batch, raw, groups = train_batch_from_groups(self.job, rollout_id, groups, producer)
        metrics = rollout_metrics(
            groups, raw, estimator=self.job.algo.advantage_estimator, drops={}, num_aborted_samples=0,
            rollout_time_s=0.0, num_rollout_devices=1,
        )  # fmt: skip
        # Nothing was generated: throughput and generation time of a replay would be meaningless.
        return batch, {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def regroup(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive samples with the same group_index form a group (a dump keeps batch order); samples
    without a group index are groups of one."""
    groups: list[list[Sample]] = []
    for sample in samples:
        if groups and sample.group_index is not None and groups[-1][-1].group_index == sample.group_index:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups
