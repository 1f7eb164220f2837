"""JSON for the engine's hot routes through orjson: a rollout's `/generate` answers carry every sampled
token's id, logprob and weight version, and the standard library's encoder and decoder were the largest
costs of that path (32 answers of 8 x 256 tokens with logprobs, measured on the 2-core CPU workstation on
2026-12-04: 65 ms to encode and 69 ms to decode; orjson: 3 and 12 ms).

Floats round-trip exactly (shortest representation), so the trainer compares the engine's logprobs bit for
bit. Non-finite floats become null (standard JSON has no NaN or infinity); the engine's logprobs of sampled
tokens are finite.

The compact fields of a `/generate` answer (`compact_logprobs`, asked for by the rollout's own engines'
client): parsing 2,048 logprobs written as 17-digit decimals and 2,048 weight-version strings was most of
the client's CPU per answer (8 x 256 tokens, parse and apply_output: 0.68 ms, compact 0.22 ms;
bench/generate_call_cost.py, 2-core workstation, 2026-12-07), and the rollout's last answers are parsed one
after another in its tail. So the logprobs travel as the base64 of their IEEE-754 float64 bytes,
little-endian (the exact Python floats: every bit, -inf and NaN included), and the per-token weight
versions as runs:

    pack_floats([-0.25, -1.5]) -> "AAAAAAAA0L8AAAAAAAD4vw=="      unpack_floats(text) -> [-0.25, -1.5]
    version_runs(["3", "3", "4"]) -> [["3", 2], ["4", 1]]
"""

from __future__ import annotations

import base64
import binascii
import itertools
import sys
from array import array
from typing import Any

import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _fallback(value: Any) -> Any:
    """What orjson cannot encode itself: numpy / torch scalars and arrays (their Python values)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(value: Any) -> bytes:
    """`value` as UTF-8 JSON bytes."""
    return orjson.dumps(value, default=_fallback, option=_OPTIONS)


def loads(data: bytes | str) -> Any:
    """Parse JSON (raises ValueError, as json.loads does, on bad input)."""
    return orjson.loads(data)


def pack_floats(values: list[float]) -> str:
    """Floats as the base64 of their float64 bytes, little-endian (every bit kept)."""
    packed = array("d", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_floats(text: str, *, field: str = "floats") -> list[float]:
    """pack_floats' inverse; a text that is not base64 of whole float64s is one ValueError naming `field`."""
    try:
        raw = binascii.a2b_base64(text)  # (b64decode's validate=True costs the rollout ~5 us an answer)
    except (binascii.Error, TypeError, ValueError):
        raise ValueError(f"{field} is not base64: {str(text)[:40]!r}") from None
    if len(raw) % 8:
        raise ValueError(f"{field} holds {len(raw)} bytes, not a whole number of float64 values")
    values = array("d")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def version_runs(versions: list[Any]) -> list[list[Any]]:
    """Consecutive equal values as [value, count] runs, in order."""
    if versions and versions.count(versions[0]) == len(versions):  # one version: the common case, in C
        return [[versions[0], len(versions)]]
    return [[value, len(list(run))] for value, run in itertools.groupby(versions)]
