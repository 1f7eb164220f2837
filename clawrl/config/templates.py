"""Dump templates: `str.format` strings whose only field is `{rollout_id}` (an int for training rollouts,
"eval_N" for evals), checked once here for the debug flags and the tools that read dumps."""

from __future__ import annotations

import logging
import string

from clawrl.config.errors import ConfigError

logger = logging.getLogger(__name__)

_FIELD = "rollout_id"
_warned_templates: set[str] = set()


def template_fields(template: str) -> list[str]:
    """The replacement-field names of a format template, in order; ValueError if it is malformed."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def check_template(template: str, flag: str) -> None:
    """ConfigError naming `flag` unless `{rollout_id}` is the template's only field; a warning (once per
    template) when it has none, because then every dump overwrites the same file."""
    try:
        fields = template_fields(template)
        bad = [name for name in fields if name != _FIELD]
        # A format spec such as {rollout_id:03d} must work for train ids (ints) and eval ids ("eval_N").
        if not bad:
            template.format(rollout_id=0), template.format(rollout_id="eval_0")
    except (ValueError, TypeError, IndexError, KeyError) as err:
        raise ConfigError(f"{flag} {template!r} is not a valid template: {err}") from None
    if bad:
        raise ConfigError(
            f"{flag} {template!r}: only {{rollout_id}} may appear in braces, found {{{bad[0]}}} "
            "(write a literal brace as {{ or }})"
        )
    if not fields and template not in _warned_templates:
        _warned_templates.add(template)
        logger.warning("%s %r has no {rollout_id}: every dump overwrites %s", flag, template, template)
