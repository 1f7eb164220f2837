"""Training checkpoints: model + optimizer (torch.distributed.checkpoint), schedule, RNG, counters.

Layout (slime's, so tools that look for it find it):

    <save>/latest_checkpointed_iteration.txt     "3" (written last: a checkpoint without it is incomplete)
    <save>/iter_0000003/dcp/                      model and optimizer, sharded, loadable at any world size
                                                  (LoRA: the adapters and their optimizer state only;
                                                  meta.json's "lora" names the settings and base model)
    <save>/iter_0000003/meta.json                 rollout_id, next_rollout_id, world size, schedule, extra state
    <save>/iter_0000003/rng_rank{r}.pt            each rank's torch (and CUDA) RNG state
    <save>/critic/                                ppo only: the critic's checkpoints, the same layout
                                                  (saved before the policy's, so the policy's tracker
                                                  is written last and vouches for both)

`iteration` = rollout_id + 1. Everything is tensors and plain containers: `torch.load(weights_only=True)`.
meta.json's `extra.job` holds the job config of the run that saved it (`clawrl train` records it).

Reading a checkpoint's weights needs no process group and no model (`clawrl convert-checkpoint`):

    path = find_iteration_dir("ckpt")            # latest; or find_iteration_dir("ckpt", iteration=3)
    state, meta = read_model_state(path)         # {HF name: full CPU tensor}, meta.json
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from clawrl.models.lora import LoraSpec
from clawrl.trainer.fsdp import reshard_all
from clawrl.trainer.weights import architecture_mismatch

TRACKER = "latest_checkpointed_iteration.txt"
CRITIC_SUBDIR = "critic"


def critic_root(root: str | Path) -> Path:
    """The critic's checkpoint directory (ppo) under a --save / --load directory."""
    return Path(root) / CRITIC_SUBDIR


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the path."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    """The iteration recorded in the tracker file, or None when `root` holds no complete checkpoint."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def save_checkpoint(
    root, rollout_id: int, model, optimizer, meta: dict[str, Any], *, trainable_only: bool = False
) -> Path:
    """Collective: every rank calls it. Returns the iteration directory. `trainable_only` (LoRA) saves the
    parameters that train (the adapters) and their optimizer state, not the frozen base weights."""
    path = iteration_dir(root, rollout_id + 1)
    reshard_all(model)
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    rank = dist.get_rank()
    torch.save(_rng_state(), path / f"rng_rank{rank}.pt")
    if rank == 0:
        full_meta = {"rollout_id": rollout_id, "next_rollout_id": rollout_id + 1, **meta}
        full_meta["world_size"] = dist.get_world_size()
        (path / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True) + "\n")
    dist.barrier()
    if rank == 0:
        tmp = Path(root) / (TRACKER + ".tmp")
        tmp.write_text(f"{rollout_id + 1}\n")
        os.replace(tmp, Path(root) / TRACKER)  # atomic: a crash never leaves a half-written tracker
    dist.barrier()
    return path


def load_checkpoint(
    root, model, optimizer, *, trainable_only: bool = False, check_meta=None
) -> dict[str, Any] | None:
    """Collective. Restores model, optimizer and RNG from the latest checkpoint; returns its meta (or None).
    `trainable_only` (LoRA): the checkpoint holds only the trainable parameters, the rest stay as built.
    `check_meta(meta, path)` may raise CheckpointError before anything is read (e.g. other LoRA settings)."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{path}: the tracker names iteration {iteration} but meta.json is missing")
    if check_meta is not None:
        check_meta(json.loads((path / "meta.json").read_text()), path)
    reshard_all(model)
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)
    _check_fits(path / "dcp", model_sd)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    except Exception as e:  # DCP raises a bare CheckpointException listing every rank's failure
        raise CheckpointError(f"{path / 'dcp'}: cannot load into this model: {e}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(trainable_only))  # fmt: skip
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if not rng_file.is_file():  # another world size: ranks beyond the saved ones take rank 0's stream
        rng_file = path / "rng_rank0.pt"
    _set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / "meta.json").read_text())


def check_lora_meta(saved: dict[str, Any] | None, spec: LoraSpec | None, path: Path) -> None:
    """CheckpointError naming `path` and the flags when the adapters of a checkpoint (meta.json's "lora")
    are not this run's (`spec`, None without --lora-rank): a LoRA checkpoint resumed without --lora-rank,
    a full one with it, or another rank or other target modules."""
    if saved is None and spec is None:
        return
    if saved is None:
        raise CheckpointError(
            f"{path}: a full-model checkpoint, but this run trains LoRA adapters (--lora-rank {spec.rank}); "
            "resume it without --lora-rank"
        )
    if spec is None:
        raise CheckpointError(
            f"{path}: holds LoRA adapters (rank {saved['rank']}) and no base weights; resume it with "
            f"--lora-rank {saved['rank']} --target-modules {','.join(saved['target_modules'])}"
        )
    theirs = (int(saved["rank"]), tuple(saved["target_modules"]))
    if theirs != (spec.rank, spec.target_modules):
        raise CheckpointError(
            f"{path}: its adapters have --lora-rank {theirs[0]} --target-modules {','.join(theirs[1])}, "
            f"this run --lora-rank {spec.rank} --target-modules {','.join(spec.target_modules)}"
        )


def _state_dicts(model, optimizer, trainable_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        # ignore_frozen_params drops each frozen parameter under its first name only: a tied LM head
        # (the embedding under a second name) would stay. Keep exactly the names that train.
        names = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {n: t for n, t in model_sd.items() if n in names}
    return model_sd, optim_sd


def _options(trainable_only: bool) -> StateDictOptions:
    # Loading a trainable-only state must not demand the frozen parameters: strict off for them alone
    # (_check_fits has already compared the names and shapes of what is there).
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _saved_metadata(dcp_dir: Path) -> dict[str, Any]:
    """{key: tensor metadata} of a DCP directory; CheckpointError naming it when unreadable."""
    try:
        return dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    except Exception as e:  # a missing or truncated .metadata file
        raise CheckpointError(
            f"{dcp_dir}: not a readable torch.distributed.checkpoint directory ({e})"
        ) from e


def _check_fits(dcp_dir: Path, model_sd: dict[str, Any]) -> None:
    """One CheckpointError naming `dcp_dir` when its model tensors are not this model's (names and full
    shapes), before DCP would fail on every rank with a long per-rank report."""
    saved = _saved_metadata(dcp_dir)
    prefix = "model."
    found = {
        k[len(prefix) :]: tuple(v.size)
        for k, v in saved.items()
        if k.startswith(prefix) and hasattr(v, "size")
    }
    expected = {name: tuple(t.shape) for name, t in model_sd.items()}
    problem = architecture_mismatch(expected, found)
    if problem:
        raise CheckpointError(f"{dcp_dir}: the checkpoint does not fit the model being trained: {problem}")


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def find_iteration_dir(path: str | Path, *, iteration: int | None = None) -> Path:
    """The iteration directory of a --save directory (the latest, or `iteration`), or `path` itself when it
    is one. CheckpointError, naming the path, when there is no such checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if _is_iteration_dir(path):
        if iteration is not None and path.name != iteration_dir(path.parent, iteration).name:
            raise CheckpointError(f"{path}: is the checkpoint of another iteration than {iteration}")
        return path
    if iteration is None:
        iteration = latest_iteration(path)
        if iteration is None:
            raise CheckpointError(
                f"{path}: not a clawrl checkpoint directory (no {TRACKER} and no iter_*/dcp with meta.json)"
            )
    found = iteration_dir(path, iteration)
    if not _is_iteration_dir(found):
        saved = sorted(int(d.name[5:]) for d in path.glob("iter_*") if _is_iteration_dir(d))
        raise CheckpointError(f"{path}: no checkpoint of iteration {iteration} (saved iterations: {saved})")
    return found


def _is_iteration_dir(path: Path) -> bool:
    return (path / "dcp").is_dir() and (path / "meta.json").is_file()


def read_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An iteration directory's model tensors (full, on CPU, in the saved dtype, under the trainer's
    parameter names) and its meta.json, read in this process alone: no process group, no model."""
    path = Path(path)
    dcp_dir = path / "dcp"
    saved = _saved_metadata(dcp_dir)
    prefix = "model."
    model_sd = {
        key[len(prefix) :]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    if not model_sd:
        raise CheckpointError(f"{dcp_dir}: holds no model tensors (is it a clawrl --save checkpoint?)")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model_sd}, checkpoint_id=str(dcp_dir), no_dist=True)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'meta.json'}: not valid JSON ({e})") from None
    return model_sd, meta
