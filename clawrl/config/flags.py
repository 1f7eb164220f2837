"""The job's flag table, assembled from the component dataclasses, and `parse_job_args`.

Each JobConfig component becomes one argparse group titled with the component's name ("rollout", "train",
...); each field one flag named after it (`rollout_batch_size` -> `--rollout-batch-size`) whose help is the
field's docstring. Types come from the annotations (clawrl/config/fields.py). Flag defaults are
argparse.SUPPRESS, so the namespace holds only the flags given and the dataclass defaults stay the one source
of defaults.

    job = parse_job_args(["--rollout-batch-size", "8", "--num-rollout", "10"])   # parsed and validated
"""

from __future__ import annotations

import argparse
from typing import Any

from clawrl.config.errors import ConfigError
from clawrl.config.fields import FieldSpec, field_specs
from clawrl.config.job import JobConfig, build_component
from clawrl.config.validate import validate

_METAVARS = {int: "N", float: "X", str: "STR"}

USAGE = "%(prog)s --rollout-batch-size N (--num-rollout N | --num-epoch N) [FLAG ...]"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one argument group per JobConfig component, one flag per field."""
    for component, cls in JobConfig.components():
        group = parser.add_argument_group(component, (cls.__doc__ or "").strip())
        for spec in field_specs(cls):
            _add_flag(group, spec)


def _add_flag(group: Any, spec: FieldSpec) -> None:
    kwargs: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": _help(spec)}
    if spec.base is bool:
        if spec.optional:
            action = argparse.BooleanOptionalAction
        elif spec.default is True:
            assert spec.flag.startswith("--disable-"), f"{spec.name}: a True default needs a --disable- flag"
            action = "store_false"
        else:
            action = "store_true"
        group.add_argument(spec.flag, action=action, **kwargs)
        return
    if spec.choices is not None:
        kwargs["choices"] = spec.choices
    else:
        kwargs["metavar"] = spec.metavar or _METAVARS[spec.base]
    if spec.base is dict:
        # NAME PATH [NAME PATH ...]: argparse shows a 2-tuple metavar as "A [B ...]" for nargs="+".
        kwargs.update(type=str, nargs="+", metavar=(kwargs["metavar"], kwargs["metavar"]))
    else:
        kwargs["type"] = spec.base
    if spec.is_list:
        kwargs["nargs"] = "+"
    group.add_argument(spec.flag, required=spec.required, **kwargs)


def _help(spec: FieldSpec) -> str:
    text = spec.help.replace("%", "%%")
    if spec.required:
        return text + " (required)"
    # Boolean flags are switches (their help says what giving them does); `0 == False`, so test the type.
    if spec.base is not bool and spec.default is not None and spec.default not in ({}, []):
        text += f" (default: {str(spec.default).replace('%', '%%')})"
    return text


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors raise ConfigError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)


def build_job_parser(prog: str = "clawrl train") -> argparse.ArgumentParser:
    """A standalone parser for the job's flags; parse errors raise ConfigError."""
    parser = _RaisingParser(prog=prog, usage=USAGE, allow_abbrev=False)
    add_job_arguments(parser)
    return parser


def job_from_namespace(namespace: argparse.Namespace) -> JobConfig:
    """The JobConfig of a namespace parsed with add_job_arguments (not yet validated); other keys are ignored."""
    given = vars(namespace)
    parts = {}
    for component, cls in JobConfig.components():
        values = {}
        for spec in field_specs(cls):
            if spec.name in given:
                value = given[spec.name]
                values[spec.name] = _pairs(spec, value) if spec.base is dict else value
        parts[component] = build_component(cls, values, component)
    return JobConfig(**parts)


def _pairs(spec: FieldSpec, values: list[str]) -> dict[str, str]:
    """NAME VALUE NAME VALUE ... -> {NAME: VALUE}, in the order given."""
    if len(values) % 2:
        raise ConfigError(
            f"{spec.flag} takes NAME PATH pairs, got an odd number of values: {' '.join(values)}"
        )
    pairs: dict[str, str] = {}
    for name, value in zip(values[::2], values[1::2], strict=True):
        if name in pairs:
            raise ConfigError(f"{spec.flag} names {name!r} twice")
        pairs[name] = value
    return pairs


def parse_job_args(argv: list[str]) -> JobConfig:
    """Parse and validate the job's flags; every user mistake is one ConfigError."""
    return validate(job_from_namespace(build_job_parser().parse_args(argv)))
