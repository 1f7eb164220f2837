"""The metrics.jsonl format: one JSON object per logged step, and its reader.

    {"step": 3, "time": 1767225600.123, "rollout/raw_reward": 0.42, "train/ppo_kl": 0.0, ...}

`step` is the 0-based rollout id (slime's `rollout_id`), `time` the unix time of the log call. Every other
key is a metric name (docs/architecture.md) with a number as value.

Non-finite floats: strict JSON has no NaN or infinity, so they are written as the strings "NaN",
"Infinity" and "-Infinity" (the spellings of JavaScript and of Python's own non-strict json). The file
stays valid JSON for every tool (jq, pandas, browsers), nothing is lost (null would merge NaN and inf),
and `read_metrics` turns those three strings back into floats, so a write/read round trip is exact.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
RESERVED_KEYS = ("step", "time")
_NON_FINITE_TO_STR = {math.inf: "Infinity", -math.inf: "-Infinity"}
_STR_TO_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsFileError(ValueError):
    """A metrics.jsonl / config.json that is missing, empty or malformed; the message names file[:line]."""


def encode_value(value: float | int) -> float | int | str:
    """A metric value as written to JSON: NaN and +-inf become strings (see the module docstring)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE_TO_STR[value]
    return value


def decode_value(value: Any) -> Any:
    """Inverse of encode_value; any other value is returned unchanged."""
    if isinstance(value, str):
        return _STR_TO_NON_FINITE.get(value, value)
    return value


def encode_line(step: int, time_s: float, metrics: Mapping[str, float | int]) -> str:
    """One metrics.jsonl line (without the newline)."""
    record: dict[str, Any] = {"step": step, "time": round(time_s, 3)}
    record.update((key, encode_value(value)) for key, value in metrics.items())
    return json.dumps(record, allow_nan=False)


def parse_lines(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (blank lines skipped); MetricsFileError names file:line of a bad one."""
    return [record for _, record in iter_lines(path)]


def iter_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(raw line, decoded record) for each non-blank line of a metrics.jsonl, checking each as it goes."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield line, _parse_record(line, f"{path}:{number}")


def _parse_record(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MetricsFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise MetricsFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise MetricsFileError(f"{where}: 'step' must be an integer, got {step!r}")
    return {key: decode_value(value) for key, value in record.items()}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a file, or a run's output directory holding one), in file order.

    Raises MetricsFileError when the file is missing, holds no record, or has a malformed line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise MetricsFileError(f"metrics file {path} does not exist")
    records = parse_lines(path)
    if not records:
        raise MetricsFileError(f"metrics file {path} is empty: no step was logged")
    return records


def read_run_info(output_dir: str | Path) -> dict[str, Any] | None:
    """The contents of <output_dir>/config.json ({"run_name", "time", "config"}), or None when absent."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise MetricsFileError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(info, dict):
        raise MetricsFileError(f"{path}: expected a JSON object, got {type(info).__name__}")
    return info
