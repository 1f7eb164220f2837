"""Logging flags: run name, output directory, W&B and TensorBoard (component "logging")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clawrl.config.errors import check, non_empty
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics and experiment tracking."""

    use_wandb: bool = False
    """Log metrics to Weights & Biases."""
    wandb_project: str | None = None
    """W&B project."""
    wandb_group: str | None = None
    """W&B group."""
    wandb_key: str | None = None
    """W&B API key (else the environment's login)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode (offline needs no network); default: WANDB_MODE or online."""
    use_tensorboard: bool = False
    """Also write metrics as TensorBoard events."""
    output_dir: str | None = option(metavar="DIR")
    """Directory for metrics.jsonl, logs and the report; default: outputs/<run name>."""
    run_name: str | None = None
    """Name of the run; default: run-<YYYYmmdd-HHMMSS>."""
    progress_interval: str = option(default="30", metavar="SECONDS|off")
    """Rollout progress bar off a terminal: a line at most every SECONDS (0: each poll, ~1 s), or off."""

    def __post_init__(self) -> None:
        check_types(self)
        non_empty(self, "output_dir")
        check(self, "run_name", lambda v: v != "" and "/" not in v, "must be non-empty without '/'")
        check(self, "progress_interval", _is_interval, "must be a number of seconds >= 0 or 'off'")

    @property
    def progress_interval_s(self) -> float | None:
        """--progress-interval in seconds; None when it is "off"."""
        raw = self.progress_interval.strip().lower()
        return None if raw == "off" else float(raw)


def _is_interval(value: str) -> bool:
    raw = value.strip().lower()
    if raw == "off":
        return True
    try:
        return float(raw) >= 0
    except ValueError:
        return False
