"""CI flags: in-run checks that observe the metric stream and the weight sync (reference/slime.md 9.4)."""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.fields import check_types


@dataclass(kw_only=True)
class CIConfig:
    """Checks for CI runs."""

    ci_test: bool = False
    """Assert numerics during the run (e.g. log_probs == ref_log_probs and ppo_kl == 0 at the first step)."""
    check_weight_update_equal: bool = False
    """After each weight sync, compare engine and trainer per-tensor checksums; fail on any difference."""

    def __post_init__(self) -> None:
        check_types(self)
