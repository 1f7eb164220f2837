"""Rollout and train-data dump files: the formats behind `--save-debug-rollout-data`,
`--load-debug-rollout-data`, `--save-debug-train-data` and `--dump-details`, and what the `clawrl debug`
tools read.

    path = save_rollout_dump(dump_path("dumps/{rollout_id}.pt", 3), rollout_id=3, samples=samples, meta=meta)
    dump = load_rollout_dump(path)            # RolloutDump: rollout_id, samples (Sample), meta, source_format
    kept = subsample(dump.samples, 0.5)       # the first and the last halves of int(len * 0.5) samples

Safety: every file is a `torch.save` of plain containers (dict, list, str, int, float, bool, None) and
tensors, and every file is read back with `torch.load(weights_only=True)` only. That loader refuses
pickled classes and `__reduce__` hooks before running any of them, so opening a dump someone else wrote
cannot execute code. Writes go to a temporary file in the same directory, then `os.replace`, so a crash
never leaves a half-written dump behind.

A rollout dump (format_version 1):
    {"format_version": 1, "kind": "clawrl-rollout-data", "rollout_id": 3 | "eval_3",
     "samples": [Sample.to_dict(), ...],
     "weight_version": str | None, "weight_versions": [str], "sampling_params": {...},
     "tokenizer": name or path, "config_hash": 16 hex, "kind": ..., "metrics": {name: float} (optional),
     "datasets": {eval dataset name: [sample positions]} (evals only)}
slime's dumps, `{"rollout_id": id, "samples": [slime Sample dicts]}`, load too (source_format "slime");
keys clawrl's Sample does not declare are kept as the sample's extras.

A train dump (format_version 1, written by the training loop) holds one record per trained sample; see
`load_train_dump`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from clawrl.data.sample import Sample

logger = logging.getLogger(__name__)

ROLLOUT_FORMAT_VERSION = 1
ROLLOUT_KIND = "clawrl-rollout-data"
TRAIN_FORMAT_VERSION = 1
TRAIN_KIND = "clawrl-train-data"


class DumpError(ValueError):
    """A dump file that cannot be used: unreadable, unsafe, of an unknown layout or inconsistent."""


# ---------------------------------------------------------------------------------------------------
# templates


def dump_path(template: str, rollout_id: int | str) -> Path:
    """The file of one rollout: `template.format(rollout_id=rollout_id)` (evals pass "eval_N")."""
    return Path(template.format(rollout_id=rollout_id))


# ---------------------------------------------------------------------------------------------------
# writing


def save_rollout_dump(path, *, rollout_id: int | str, samples: list[Sample], meta: dict) -> Path:
    """Write one rollout's (or eval's) samples and `meta` (weight versions, sampling params, tokenizer,
    config hash, optional metrics / datasets) to `path`; returns the path."""
    reserved = {"format_version", "rollout_id", "samples"} & set(meta)
    assert not reserved, f"meta must not override {sorted(reserved)}"
    payload = {
        "format_version": ROLLOUT_FORMAT_VERSION,
        **{k: v for k, v in meta.items() if k != "kind"},
        "kind": ROLLOUT_KIND,
        "rollout_id": rollout_id,
        "samples": [sample.to_dict() for sample in samples],
    }
    # The eval/train split travels as "category" so that "kind" always names the file type.
    if "kind" in meta:
        payload["category"] = meta["kind"]
    return _save_atomic(Path(path), payload)


def save_train_dump(path, payload: dict) -> Path:
    """Write a train dump (the payload the training loop builds) to `path`; returns the path."""
    return _save_atomic(Path(path), payload)


def _save_atomic(path: Path, payload: dict) -> Path:
    plain = _to_plain(payload, "payload")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(plain, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _to_plain(value: Any, where: str) -> Any:
    """`value` as containers `torch.load(weights_only=True)` accepts; numpy values become Python/tensors.
    Anything else is a ValueError naming where it sits, instead of a dump that cannot be read back."""
    if value is None or isinstance(value, (str, bool, int, float, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {_plain_key(k, where): _to_plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    module = type(value).__module__
    if module == "numpy":
        item = getattr(value, "item", None)
        if getattr(value, "ndim", 0) == 0 and item is not None:
            return item()
        return torch.from_numpy(value.copy())
    raise ValueError(
        f"cannot dump {where}: {type(value).__qualname__} is not a plain value "
        "(str, int, float, bool, None, list, dict, tensor)"
    )


def _plain_key(key: Any, where: str) -> Any:
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    raise ValueError(f"cannot dump {where}: dict key {key!r} is a {type(key).__qualname__}")


# ---------------------------------------------------------------------------------------------------
# reading


@dataclass(kw_only=True)
class RolloutDump:
    """One rollout dump read back."""

    rollout_id: int | str
    """The rollout id (an int for training rollouts, "eval_N" for evals)."""
    samples: list[Sample]
    """The samples, in the order they were dumped."""
    meta: dict[str, Any]
    """Everything else in the file: weight versions, sampling params, tokenizer, metrics, datasets, ..."""
    source_format: Literal["clawrl", "slime"]
    """Who wrote it: clawrl (with format_version and meta) or slime ({"rollout_id", "samples"} only)."""
    path: Path
    """The file it was read from."""

    @property
    def category(self) -> str:
        """ "eval" or "train"."""
        recorded = self.meta.get("category")
        if recorded in ("train", "eval"):
            return recorded
        return "eval" if str(self.rollout_id).startswith("eval_") else "train"


def load_rollout_dump(path) -> RolloutDump:
    """Read a clawrl or slime rollout dump, safely; DumpError naming the file (and the sample and field)
    when it is unsafe, of an unknown layout or inconsistent; FileNotFoundError when it does not exist."""
    path = Path(path)
    data = _load_plain(path)
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise DumpError(f"{path}: not a rollout dump (expected a dict with a 'samples' list)")
    if "kind" in data or "format_version" in data:
        _check_version(path, data, ROLLOUT_KIND, ROLLOUT_FORMAT_VERSION)
        source: Literal["clawrl", "slime"] = "clawrl"
    else:
        source = "slime"
    if "rollout_id" not in data:
        raise DumpError(f"{path}: rollout dump without 'rollout_id'")
    samples = [_read_sample(path, i, raw) for i, raw in enumerate(data["samples"])]
    meta = {k: v for k, v in data.items() if k not in ("samples", "rollout_id", "format_version", "kind")}
    return RolloutDump(
        rollout_id=data["rollout_id"], samples=samples, meta=meta, source_format=source, path=path
    )


def load_train_dump(path) -> dict:
    """Read a train dump, safely (see the module docstring); the payload dict as written."""
    path = Path(path)
    data = _load_plain(path)
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise DumpError(f"{path}: not a train dump (expected a dict with a 'samples' list)")
    _check_version(path, data, TRAIN_KIND, TRAIN_FORMAT_VERSION)
    return data


def _load_plain(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dump file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise DumpError(
            f"{path}: refused: the file holds pickled Python objects, not only plain values and tensors "
            f"(nothing in it was run; {_blocked_reason(err)})"
        ) from None
    except Exception as err:  # the unpickler fails on garbage with anything from KeyError to EOFError
        raise DumpError(f"{path}: not a readable torch file ({type(err).__name__}: {err})") from None


def _blocked_reason(err: Exception) -> str:
    """The line of torch's long weights-only message that names the blocked object."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or [type(err).__name__])[0].rstrip(".")


def _check_version(path: Path, data: dict, kind: str, version: int) -> None:
    if data.get("kind") != kind:
        raise DumpError(f"{path}: kind is {data.get('kind')!r}, expected {kind!r}")
    found = data.get("format_version")
    if not isinstance(found, int) or not 1 <= found <= version:
        raise DumpError(
            f"{path}: format_version {found!r} is not one this clawrl reads (1..{version}); "
            "was it written by a newer clawrl?"
        )


def _read_sample(path: Path, i: int, raw: Any) -> Sample:
    if not isinstance(raw, dict):
        raise DumpError(f"{path}: sample {i} is a {type(raw).__name__}, expected a dict")
    try:
        sample = Sample.from_dict(raw)
    except (TypeError, ValueError) as err:
        raise DumpError(f"{path}: sample {i}: {err}") from None
    problem = _sample_problem(sample)
    if problem:
        raise DumpError(f"{path}: sample {i} (index {sample.index}): {problem}")
    return sample


def _sample_problem(sample: Sample) -> str | None:
    """What makes a sample unusable for replay, or None."""
    if not isinstance(sample.tokens, list) or not all(isinstance(t, int) for t in sample.tokens):
        return "tokens must be a list of token ids"
    n = sample.response_length
    if not isinstance(n, int) or not 0 <= n <= len(sample.tokens):
        return f"response_length {n!r} is not between 0 and the {len(sample.tokens)} tokens"
    for name in ("loss_mask", "rollout_log_probs"):
        values = getattr(sample, name)
        if values is not None and len(values) != n:
            return f"{name} has {len(values)} entries, response_length is {n}"
    return None


# ---------------------------------------------------------------------------------------------------
# replay helpers


def subsample(items: list, ratio: float) -> list:
    """Keep n = int(len(items) * ratio) items: the first ceil(n/2) and the last floor(n/2).

    Unlike slime's `items[:n//2] + items[-n//2:]`, an odd n keeps exactly n items and a ratio so small
    that n is 0 keeps nothing (slime's `items[-0:]` is the whole list); the caller decides whether an
    empty result is an error. Ratio 1.0 keeps every item once.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"subsample ratio must be in (0, 1], got {ratio!r}")
    n = int(len(items) * ratio)
    head, tail = n - n // 2, n // 2
    return list(items[:head]) + (list(items[len(items) - tail :]) if tail else [])


def config_hash(job_dict: dict) -> str:
    """First 16 hex digits of the sha256 of the config's canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(job_dict, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
