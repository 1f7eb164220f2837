"""The one weight-loading path: HF-named tensors -> model parameters, through per-parameter loader hooks.

Every parameter carries `param.weight_loader(param, loaded, shard_id=None)`. A plain parameter copies the
tensor after a shape check; a packed one (`qkv_proj`, `gate_up_proj` of a fused model) copies it into the
rows of its shard (`"q"`, `"k"`, `"v"` or `0`, `1`). `load_weights` maps HF names onto the model (packing,
tied LM head) and is used both to load a checkpoint directory and for live weight updates in the engine:

    load_weights(model, iter_safetensors(model_dir))            # whole checkpoint: every parameter required
    load_weights(engine_model, bucket, strict=False)            # one bucket of a weight sync

A checkpoint that does not fit the model (another architecture, other sizes) is one ValueError naming the
tensor, the parameter, the file when known, and both shapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some old checkpoints saved; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

ShardId = str | int | None


class WeightShapeError(ValueError):
    """A loaded tensor's shape differs from the (slice of the) parameter it is copied into."""

    def __init__(self, expected: torch.Size, got: torch.Size):
        super().__init__(f"expected shape {tuple(expected)}, got {tuple(got)}")
        self.expected, self.got = tuple(expected), tuple(got)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Copy `loaded` into `param` (any dtype/device), after checking the shape."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not packed, but shard_id={shard_id!r} was given")
    _copy_checked(param.data, loaded)


class PackedWeightLoader:
    """Loader of a packed parameter: shard `shard_id` occupies rows [start, start + size) of dim 0."""

    def __init__(self, shard_offsets: Mapping[str | int, tuple[int, int]]):
        self.shard_offsets = dict(shard_offsets)
        """shard id -> (first row, number of rows) inside the packed parameter."""

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"packed parameter has shards {list(self.shard_offsets)}, got shard_id={shard_id!r}"
            )
        start, size = self.shard_offsets[shard_id]
        _copy_checked(param.data.narrow(0, start, size), loaded)


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise WeightShapeError(target.shape, loaded.shape)
    with torch.no_grad():
        target.copy_(loaded)


def load_weights(
    model: nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
    files: Mapping[str, str] | None = None,
) -> set[str]:
    """Load HF-named tensors into `model`; return the names of the model parameters that were written.

    strict=True (a whole checkpoint) also requires every parameter (every shard of a packed one) to be
    loaded. `files` maps tensor name -> file it came from, for error messages.
    """
    params = dict(model.named_parameters())
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)
    expected = _expected_shards(params)
    loaded: set[tuple[str, ShardId]] = set()
    for name, tensor in named_tensors:
        where = (files or {}).get(name, "checkpoint")
        target = _resolve(name, params, getattr(model, "packed_modules", {}))
        if target is None:
            # A tied model's lm_head.weight is an alias of the embedding: accepted and ignored.
            if name in aliases or name.endswith(_IGNORED_SUFFIXES):
                continue
            raise ValueError(f"{where}: tensor {name!r} matches no parameter of {_describe(model)}")
        param_name, shard_id = target
        param = params[param_name]
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
        except WeightShapeError as e:
            shard = "" if shard_id is None else f" (shard {shard_id!r})"
            raise ValueError(
                f"{where}: tensor {name!r} has shape {e.got}, but parameter {param_name!r}{shard} of "
                f"{_describe(model)} expects {e.expected}"
            ) from None
        loaded.add(target)
    if strict:
        _check_complete(model, expected - loaded, files)
    return {param_name for param_name, _ in loaded}


def _resolve(name: str, params: Mapping[str, nn.Parameter], packed_modules) -> tuple[str, ShardId] | None:
    """HF tensor name -> (model parameter name, shard id), or None if the model has no such parameter."""
    if name in params:
        return name, None
    parts = name.rsplit(".", 2)
    if len(parts) != 3:
        return None
    prefix, module, attr = parts
    for packed, members in packed_modules.items():
        for member, shard_id in members:
            candidate = f"{prefix}.{packed}.{attr}"
            if member == module and candidate in params:
                return candidate, shard_id
    return None


def _expected_shards(params: Mapping[str, nn.Parameter]) -> set[tuple[str, ShardId]]:
    expected = set()
    for name, param in params.items():
        loader = getattr(param, "weight_loader", None)
        shard_ids = loader.shard_offsets if isinstance(loader, PackedWeightLoader) else [None]
        expected.update((name, shard_id) for shard_id in shard_ids)
    return expected


def _check_complete(model: nn.Module, missing: set[tuple[str, ShardId]], files) -> None:
    if not missing:
        return
    names = sorted(f"{n}" if s is None else f"{n} (shard {s!r})" for n, s in missing)
    where = str(Path(next(iter(files.values()))).parent) if files else "the checkpoint"
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    raise ValueError(f"{where}: no tensor for parameter(s) of {_describe(model)}: {shown}")


def _describe(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    arch = f" (arch={args.arch!r})" if args is not None and hasattr(args, "arch") else ""
    return f"the {type(model).__name__}{arch} model"


def safetensors_weight_map(model_dir: str | Path) -> dict[str, str]:
    """Tensor name -> path of the safetensors file holding it (single file or sharded with an index)."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index_path}: not a safetensors index with a 'weight_map' ({e})") from None
        mapping = {name: str(model_dir / file) for name, file in weight_map.items()}
        for path in sorted(set(mapping.values())):
            if not Path(path).is_file():
                raise ValueError(f"{index_path}: lists shard {Path(path).name!r}, which does not exist")
        return mapping
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt", device="cpu") as f:
            return {name: str(single) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise ValueError(
        f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)"
    )


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of a HF checkpoint directory, one file at a time."""
    by_file: dict[str, list[str]] = {}
    for name, path in safetensors_weight_map(model_dir).items():
        by_file.setdefault(path, []).append(name)
    for path in sorted(by_file):
        with safe_open(path, framework="pt", device="cpu") as f:
            available = set(f.keys())  # noqa: SIM118
            for name in by_file[path]:
                if name not in available:
                    raise ValueError(
                        f"{path}: the index lists tensor {name!r}, but the file does not hold it"
                    )
                yield name, f.get_tensor(name)
