"""Introspection of component config dataclasses: one FieldSpec per field, and the type check.

A component config is a `@dataclass(kw_only=True)` whose field names are slime's argparse dest names and
whose attribute docstrings (a string literal right after each field) are the `--help` text. `field_specs(cls)`
reads both once (types with `typing.get_type_hints`, docstrings by parsing the class source with `ast`) and
caches them. The flag table (clawrl/config/flags.py) and `check_types`, which every `__post_init__` calls
first, both work from these specs.

Supported annotations: int, float, str, bool, `Literal[...]` (choices), `list[int]` / `list[str]` (nargs +),
`dict[str, str]` (NAME VALUE pairs on the command line), each optionally `| None` (None = unset). A
`bool | None` field becomes a `--x/--no-x` flag whose None means "not given", so `validate` can tell
defaults from choices.

Per-field options go in `dataclasses.field(metadata=...)`, most easily through `option()`:
  flag     the option string when it is not `--<dest with - for _>`: slime's `--disable-x` flags store False
           into a field `x` that defaults to True; the docstring of such a field describes the flag.
  metavar  the placeholder shown in --help (default: N for int, X for float, STR for str).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Literal

from clawrl.config.errors import ConfigError, flag_of

_TYPE_WORDS = {int: "an int", float: "a number", str: "a string", bool: "true or false"}


@dataclasses.dataclass(kw_only=True, frozen=True)
class FieldSpec:
    """What the flag table needs to know about one config field."""

    name: str
    """Field name, which is slime's argparse dest."""
    flag: str
    """Option string on the command line, e.g. `--rollout-batch-size`."""
    help: str
    """The field's one-line attribute docstring."""
    base: type
    """int, float, str, bool or dict, after removing `| None`, `list[...]` and `Literal[...]`."""
    optional: bool
    """True when None is allowed (the flag may stay unset)."""
    is_list: bool
    """True for `list[int]` / `list[str]` fields (one or more values)."""
    choices: tuple[Any, ...] | None
    """Allowed values of a `Literal[...]` field; None for any value of `base`."""
    default: Any
    """Default value (built from default_factory if there is one); dataclasses.MISSING when required."""
    metavar: str | None
    """Placeholder in --help, from the field's metadata; None for the type's default."""

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def option(
    default: Any = None, *, factory: Any = None, flag: str | None = None, metavar: str | None = None
) -> Any:
    """A dataclass field with flag-table metadata (see the module docstring)."""
    metadata = {key: value for key, value in (("flag", flag), ("metavar", metavar)) if value is not None}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """One FieldSpec per field of the config dataclass `cls`, in declaration order (cached)."""
    hints = typing.get_type_hints(cls, include_extras=False)
    docs = field_docstrings(cls)
    specs = []
    for f in dataclasses.fields(cls):
        assert f.name in docs, f"{cls.__name__}.{f.name} has no attribute docstring"
        base, optional, is_list, choices = _type_parts(hints[f.name])
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        spec = FieldSpec(
            name=f.name,
            flag=f.metadata.get("flag", flag_of(f.name)),
            help=docs[f.name],
            base=base,
            optional=optional,
            is_list=is_list,
            choices=choices,
            default=default,
            metavar=f.metadata.get("metavar"),
        )
        specs.append(spec)
    return tuple(specs)


@functools.cache
def field_docstrings(cls: type) -> dict[str, str]:
    """{field name: the string literal right after it} from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef), cls
    docs = {}
    body = class_def.body
    for stmt, after in zip(body, body[1:], strict=False):  # each statement with the next
        is_field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if is_field and is_doc and isinstance(after.value.value, str):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_parts(annotation: Any) -> tuple[type, bool, bool, tuple[Any, ...] | None]:
    """(base, optional, is_list, choices) of a field annotation."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        assert len(members) == 1, f"unsupported union {annotation}"
        annotation, optional = members[0], True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), optional, False, choices
    if origin is list:
        (item,) = typing.get_args(annotation)
        assert item in (int, float, str), f"unsupported list item type {item}"
        return item, optional, True, None
    if origin is dict:
        assert typing.get_args(annotation) == (str, str), f"unsupported dict {annotation}"
        return dict, optional, False, None
    assert annotation in _TYPE_WORDS, f"unsupported field type {annotation}"
    return annotation, optional, False, None


def check_types(cfg: Any) -> None:
    """Check every field of `cfg` against its annotation, in place; ints given for floats become floats.

    Configs built from a dict (a checkpoint, a run header) or from Python get the same checks as flags.
    """
    for spec in field_specs(type(cfg)):
        setattr(cfg, spec.name, _checked(spec, getattr(cfg, spec.name)))


def _checked(spec: FieldSpec, value: Any) -> Any:
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(f"{spec.flag} must be set, got None")
    if spec.is_list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{spec.flag} must be a list of {spec.base.__name__}, got {value!r}")
        return [_checked_scalar(spec, item) for item in value]
    if spec.base is dict:
        if not isinstance(value, dict) or not all(isinstance(x, str) for kv in value.items() for x in kv):
            raise ConfigError(f"{spec.flag} must map names (strings) to strings, got {value!r}")
        return dict(value)
    return _checked_scalar(spec, value)


def _checked_scalar(spec: FieldSpec, value: Any) -> Any:
    if spec.base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    # bool is an int subclass; True is not a valid count.
    if not isinstance(value, spec.base) or (spec.base is not bool and isinstance(value, bool)):
        raise ConfigError(f"{spec.flag} must be {_TYPE_WORDS[spec.base]}, got {value!r}")
    if spec.choices is not None and value not in spec.choices:
        allowed = ", ".join(str(c) for c in spec.choices)
        raise ConfigError(f"{spec.flag} must be one of {allowed}, got {value!r}")
    return value
