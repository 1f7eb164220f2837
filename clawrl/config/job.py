"""JobConfig: one training job's configuration, composed of one config per component.

    job.rollout.rollout_batch_size      # typed access, by component
    job.to_dict() / JobConfig.from_dict # plain types: checkpoints, run headers
    job.to_namespace()                  # flat argparse.Namespace with slime's dest names, for user plugins

Field names are unique across components, so the flat namespace loses nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from clawrl.config.algo import AlgoConfig
from clawrl.config.ci import CIConfig
from clawrl.config.data import DataConfig
from clawrl.config.debug import DebugConfig
from clawrl.config.engine import EngineFlagsConfig
from clawrl.config.errors import ConfigError
from clawrl.config.eval import EvalConfig
from clawrl.config.fault import FaultConfig
from clawrl.config.fields import field_specs
from clawrl.config.logs import LoggingConfig
from clawrl.config.model import ModelConfig
from clawrl.config.resources import ResourcesConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.train import TrainConfig


@dataclass(kw_only=True)
class JobConfig:
    """Everything a training job is configured with; the field order is the order of the --help groups."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model weights, reference model and checkpoints."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt dataset."""
    rollout: RolloutConfig
    """Generation of training samples and their rewards (required: --rollout-batch-size has no default)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation during training."""
    engine: EngineFlagsConfig = field(default_factory=EngineFlagsConfig)
    """Inference engines started by the job."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Policy optimisation."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """RL algorithm."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """GPUs and placement."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and experiment tracking."""
    ci: CIConfig = field(default_factory=CIConfig)
    """Checks for CI runs."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault tolerance and deadlines."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Debugging: the two half-runs, rollout and train-data dumps, replay."""

    @staticmethod
    def components() -> tuple[tuple[str, type], ...]:
        """(component name, config class) pairs in declaration order."""
        return _components()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{component: {field: value}} with only plain types (numbers, strings, lists, dicts, None)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name, _ in self.components()}

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> JobConfig:
        """Inverse of to_dict; missing fields take their defaults, unknown ones are an error."""
        known = dict(cls.components())
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown config component(s) {unknown}; known: {list(known)}")
        parts = {name: build_component(known[name], values[name], name) for name in values}
        if "rollout" not in parts:
            raise ConfigError("the config has no 'rollout' component (--rollout-batch-size is required)")
        return cls(**parts)

    def to_namespace(self) -> argparse.Namespace:
        """A flat namespace with every slime dest name, as slime's plugins receive `args`.

        `eval_prompt_data` is slime's flat list [name, path, name, path, ...] (None when empty).
        """
        namespace = argparse.Namespace()
        for name, _ in self.components():
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                setattr(namespace, key, value)
        pairs = self.eval.eval_prompt_data.items()
        namespace.eval_prompt_data = [item for pair in pairs for item in pair] or None
        return namespace


def build_component(cls: type, values: dict[str, Any], component: str) -> Any:
    """cls(**values) with unknown and missing required fields reported as ConfigError."""
    if not isinstance(values, dict):
        raise ConfigError(f"config component {component!r} must be a dict, got {values!r}")
    specs = {spec.name: spec for spec in field_specs(cls)}
    unknown = sorted(set(values) - set(specs))
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown} in config component {component!r}")
    for spec in specs.values():
        if spec.required and spec.name not in values:
            raise ConfigError(f"{spec.flag} is required")
    return cls(**values)


@functools.cache
def _components() -> tuple[tuple[str, type], ...]:
    hints = typing.get_type_hints(JobConfig)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(JobConfig))
