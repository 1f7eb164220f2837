"""Evaluation flags: datasets, interval and sampling; unset sampling values take the rollout's (validate)."""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import ConfigError, at_least, in_range, top_k_valid
from clawrl.config.fields import check_types, option


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation during training."""

    eval_interval: int | None = None
    """Evaluate every N rollouts; requires --eval-prompt-data."""
    eval_prompt_data: dict[str, str] = option(factory=dict, metavar="NAME PATH")
    """Evaluation datasets as NAME PATH pairs; each is logged as eval/<NAME>."""
    n_samples_per_eval_prompt: int = 1
    """Responses sampled per evaluation prompt."""
    eval_max_response_len: int | None = None
    """Maximum new tokens per evaluation response; default: --rollout-max-response-len."""
    eval_temperature: float | None = None
    """Evaluation sampling temperature (0: greedy); default: --rollout-temperature."""
    eval_top_p: float | None = None
    """Evaluation nucleus sampling probability; default: --rollout-top-p."""
    eval_top_k: int | None = None
    """Evaluation top-k (-1: off); default: --rollout-top-k."""

    def __post_init__(self) -> None:
        check_types(self)
        for name, path in self.eval_prompt_data.items():
            if not name or not path:
                raise ConfigError(
                    f"--eval-prompt-data needs a non-empty NAME and PATH, got {name!r} {path!r}"
                )
        at_least(self, "eval_interval", 1)
        at_least(self, "n_samples_per_eval_prompt", 1)
        at_least(self, "eval_max_response_len", 1)
        at_least(self, "eval_temperature", 0)
        in_range(self, "eval_top_p", 0, 1, open_low=True)
        top_k_valid(self, "eval_top_k")
