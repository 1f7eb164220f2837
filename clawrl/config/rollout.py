"""Rollout flags: batch sizes, sampling parameters, rewards and the rollout/generate/filter plugins.

Plugin paths are `package.module.fn` or `package.module:fn` (clawrl/config/plugins.py loads them); the
signatures are slime's (docs/guide.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.config.errors import ConfigError, above, at_least, in_range, non_empty, top_k_valid
from clawrl.config.fields import check_types, option

# The two spellings of the built-in multi-turn tool generate function (clawrl/rollout/multi_turn.py).
MULTI_TURN_GENERATE_PATHS = ("clawrl.rollout.multi_turn.generate", "clawrl.rollout.multi_turn:generate")


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation of training samples and their rewards."""

    num_rollout: int | None = None
    """Rollout steps (generate, then train) to run; this or --num-epoch is required."""
    rollout_batch_size: int
    """Prompts per rollout; each gives --n-samples-per-prompt samples."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt (the group of GRPO-style baselines)."""
    rollout_max_response_len: int | None = None
    """Maximum new tokens per response (SGLang's max_new_tokens); unset (slime's default): to the context length, warned."""
    rollout_temperature: float = 1.0
    """Sampling temperature; must be > 0 (the trainer divides logits by it too)."""
    rollout_top_p: float = 1.0
    """Nucleus sampling: sample from the smallest token set with this total probability."""
    rollout_top_k: int = -1
    """Sample from the K most likely tokens (-1: off)."""
    rollout_stop: list[str] | None = None
    """Stop strings: generation ends after any of them."""
    rollout_stop_token_ids: list[int] | None = None
    """Token ids that end generation (for stop tokens that are hard to type)."""
    rollout_seed: int = 42
    """Seed for prompt shuffling and rollout sampling."""
    over_sampling_batch_size: int | None = None
    """Prompts per sampling round while dynamic sampling refills dropped groups; >= and default --rollout-batch-size."""
    partial_rollout: bool = False
    """Keep the partial responses of over-sampled requests aborted when the batch is full; the next rollout resumes them."""
    mask_offpolicy_in_partial_rollout: bool = False
    """With --partial-rollout: the tokens a resumed sample got in earlier rollouts are not trained on (loss mask 0)."""
    update_weights_interval: int = 1
    """clawrl train-async: push the trainer's weights to the engines every N rollouts (samples get up to N versions stale)."""
    max_weight_staleness: int | None = None
    """With --partial-rollout: drop resumed samples whose oldest tokens are > K weight versions behind the trainer (unset: keep all)."""
    dynamic_sampling_filter_path: str | None = option(metavar="MODULE.FN")
    """Keep-or-drop filter per prompt group (DAPO): fn(args, samples, **kw) -> bool | DynamicFilterOutput."""
    rm_type: str | None = None
    """Built-in reward: math, gsm8k, deepscaler, dapo, f1, math_verify (clawrl[math]), remote_rm (--rm-url)."""
    rm_url: str | None = option(metavar="URL")
    """Reward service for --rm-type remote_rm: POST {prompt, response, label} -> reward."""
    reward_key: str | None = None
    """Key of the reward value when the reward function returns a dict."""
    custom_rm_path: str | None = option(metavar="MODULE.FN")
    """Custom reward, replaces --rm-type: async fn(args, sample, **kw) -> float | dict."""
    custom_generate_function_path: str | None = option(metavar="MODULE.FN")
    """Custom generate step (multi-turn, tools): async fn(args, sample, sampling_params) -> Sample."""
    rollout_function_path: str | None = option(metavar="MODULE.FN")
    """Custom rollout: fn(args, rollout_id, data_source, evaluation=False) -> samples; default: clawrl's own."""
    custom_env_path: str | None = option(metavar="MODULE:NAME")
    """Tool environment for clawrl.rollout.multi_turn.generate: a class or factory, NAME(args) once per sample."""
    max_turns: int = 8
    """Model turns per sample in multi-turn tool rollouts (tool results go back to the model in between)."""
    tool_call_timeout: float = 30.0
    """Seconds one environment step (the tool calls of one model turn) may take before they fail as timeouts."""

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, "num_rollout", 0)
        for name in ("rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len"):
            at_least(self, name, 1)
        at_least(self, "over_sampling_batch_size", 1)
        at_least(self, "update_weights_interval", 1)
        at_least(self, "max_weight_staleness", 0)
        above(self, "rollout_temperature", 0)
        in_range(self, "rollout_top_p", 0, 1, open_low=True)
        top_k_valid(self, "rollout_top_k")
        at_least(self, "rollout_stop_token_ids", 0)
        non_empty(self, "rollout_stop")
        for name in (
            "rm_type",
            "rm_url",
            "custom_rm_path",
            "custom_generate_function_path",
            "custom_env_path",
        ):
            non_empty(self, name)
        at_least(self, "max_turns", 1)
        above(self, "tool_call_timeout", 0)
        self._check_multi_turn()

    def _check_multi_turn(self) -> None:
        """The built-in multi-turn generate function needs an environment, and an environment needs a
        generate function that uses it (it would be ignored by the default one)."""
        gen = self.custom_generate_function_path
        if gen in MULTI_TURN_GENERATE_PATHS and self.custom_env_path is None:
            raise ConfigError(
                f"--custom-generate-function-path {gen} needs --custom-env-path MODULE:NAME (the tool "
                "environment; docs/multi_turn.md)"
            )
        if self.custom_env_path is not None and gen is None:
            raise ConfigError(
                f"--custom-env-path {self.custom_env_path} is only used by a generate function that runs tools: "
                f"pass --custom-generate-function-path {MULTI_TURN_GENERATE_PATHS[0]}"
            )
