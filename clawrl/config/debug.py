"""Debugging flags: run the rollout and training halves apart, dump rollouts and train data, replay them.

slime's names and meanings (its debug guide): `--debug-rollout-only` starts engines and rollouts only,
`--debug-train-only` the trainer only; `--save-debug-rollout-data TEMPLATE` writes each rollout's samples
to `TEMPLATE.format(rollout_id=N)` (evals as `eval_N`), `--load-debug-rollout-data TEMPLATE` trains on them
instead of generating. The cross-flag rules (exclusions, implications, `--dump-details` expansion) are in
clawrl/config/validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import in_range, non_empty
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class DebugConfig:
    """Debugging: the two half-runs, rollout and train-data dumps, replay."""

    debug_rollout_only: bool = False
    """Run engines and rollouts only: no trainer process, no training, saving or weight sync."""
    debug_train_only: bool = False
    """Run the trainer only: no engines, no eval, weight sync a no-op (needs --load-debug-rollout-data)."""
    save_debug_rollout_data: str | None = option(metavar="TEMPLATE")
    """Write each rollout's samples to TEMPLATE.format(rollout_id=N) (evals: rollout_id=eval_N)."""
    load_debug_rollout_data: str | None = option(metavar="TEMPLATE")
    """Train on the samples saved by --save-debug-rollout-data instead of generating (implies --debug-train-only)."""
    load_debug_rollout_data_subsample: float | None = None
    """Keep this fraction of each loaded rollout's samples: the first and the last halves of the kept count."""
    save_debug_train_data: str | None = option(metavar="TEMPLATE")
    """Write what the trainer consumed per sample (tokens, masks, log-probs, advantages, ...) to TEMPLATE."""
    dump_details: str | None = option(metavar="DIR")
    """Dump everything to DIR: rollout_data/{rollout_id}.pt, train_data/{rollout_id}.pt and the tokenizer."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("save_debug_rollout_data", "load_debug_rollout_data", "save_debug_train_data",
                     "dump_details"):  # fmt: skip
            non_empty(self, name)
        in_range(self, "load_debug_rollout_data_subsample", 0.0, 1.0, open_low=True)
