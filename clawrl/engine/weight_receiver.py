"""The engine's end of weight sync (clawrl/weight_sync/): receive buckets, load them, flip the version.

    receiver = WeightReceiver(engine)                       # engine: the core (clawrl.engine.core.engine.Engine)
    receiver.update_from_tensor(body)                       # POST /update_weights_from_tensor (colocated)
                                                            #   -> {..., "open_s", "load_s"}: engine-side time
    receiver.init_group(body)                               # POST /init_weights_update_group (any thread)
    receiver.update_from_distributed(body)                  # POST /update_weights_from_distributed
    receiver.destroy_group(body)                            # POST /destroy_weights_update_group
    receiver.checksums()                                    # GET  /weights_checksum

The methods that touch the model (update_*, checksums) must run where the core runs: the server calls them
through `AsyncEngine.run_in_engine_thread`, between steps. `init_group` only forms a process group and
blocks until every rank has joined, so the server runs it in a worker thread. Bodies are plain dicts (the
same JSON the HTTP routes take); a malformed one raises ValueError naming the field (HTTP 400).

A bucket is loaded through `Engine.load_weight_bucket` (the model's own weight loaders: packed q/k/v and
gate/up rows, tied LM head) without changing the version; the message with "finish": true ends the sync:
`Engine.set_weight_version` flips the version and flushes the prefix cache.

`/update_weights_from_distributed` has two wire layouts, chosen by the body's `load_format`:
- "flattened_bucket" (clawrl's own sender): one broadcast per dtype group of the bucket (flat.py), the
  version flips at the message with "finish": true.
- absent / null (SGLang's: what an SGLang v0.5 server expects and slime sends): one broadcast per tensor, in
  the order of `names`; each message may carry `weight_version` (taken at once, prefix cache flushed) and
  `flush_cache` (default true). This module imports neither
FastAPI nor pydantic, so benchmarks can drive it directly where those are not installed.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import torch

from clawrl.stall_points import stall_point
from clawrl.weight_sync.checksum import tensor_checksum
from clawrl.weight_sync.flat import FlatGroup, parse_dtype, plan_flat_groups, unflatten
from clawrl.weight_sync.wire import (
    BACKENDS,
    broadcast_from_rank0,
    create_group,
    open_cuda_ipc,
    open_shared_memory,
)
from clawrl.weight_sync.wire import HANDLE_KINDS as TRANSPORTS

SGLANG_GROUP_NAME = "weight_update_group"
"""SGLang's default `group_name` of the weight-update routes."""
FLAT_LOAD_FORMAT = "flattened_bucket"
"""`load_format` of clawrl's own broadcast sender: one flat tensor per dtype group of a bucket."""


class WeightReceiver:
    """Weight-sync state of one engine: its process groups, and the receive/load/flip steps."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._groups: dict[str, tuple[Any, str, float]] = {}  # name -> (group, backend, timeout_s)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------- colocated

    def update_from_tensor(self, body: dict) -> dict:
        """Load one bucket passed by handle (and/or finish the sync). Engine thread only."""
        transport = _field(body, "transport", str, "shared_memory")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        groups = _plan(body)
        handles = _field(body, "handles", list, [])
        if len(handles) != len(groups):
            raise ValueError(f"handles: {len(handles)} given, the bucket has {len(groups)} dtype groups")
        started = time.perf_counter()
        flats = [self._open(transport, handle, group) for handle, group in zip(handles, groups, strict=True)]
        opened = time.perf_counter()
        num_tensors = self._load(groups, flats)
        del flats  # unmap before acknowledging: the sender unlinks / frees right after
        timing = {"open_s": opened - started, "load_s": time.perf_counter() - opened}
        return {**self._maybe_finish(body, num_tensors), **timing}

    def _open(self, transport: str, handle: Any, group: FlatGroup) -> torch.Tensor:
        if transport == "shared_memory":
            return open_shared_memory(handle, group)
        if not torch.cuda.is_available():
            raise ValueError("transport cuda_ipc: this engine has no CUDA device")
        return open_cuda_ipc(handle, group, self.engine.device)

    # ------------------------------------------------------------------------------------- broadcast

    def init_group(self, body: dict) -> dict:
        """Join the trainer's broadcast group; blocks until all ranks joined (call from a worker thread)."""
        name = _field(body, "group_name", str, SGLANG_GROUP_NAME)
        backend = _field(body, "backend", str, "nccl" if self.engine.device.type == "cuda" else "gloo")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise ValueError(f"backend nccl needs a CUDA engine; this engine runs on {self.engine.device}")
        rank = _field(body, "rank_offset", int)
        world_size = _field(body, "world_size", int)
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset must be in [1, world_size={world_size}), got {rank}")
        timeout_s = float(_field(body, "timeout_s", (int, float), 120.0))
        with self._lock:
            if name in self._groups:
                raise ValueError(f"group_name {name!r}: this engine is already in that group")
        group = create_group(
            backend=backend, rank=rank, world_size=world_size, group_name=name, timeout_s=timeout_s,
            master_address=_field(body, "master_address", str), master_port=_field(body, "master_port", int),
            device=self.engine.device if backend == "nccl" else None,
        )  # fmt: skip
        with self._lock:
            self._groups[name] = (group, backend, timeout_s)
        return {"success": True, "message": f"joined weight-update group {name!r} as rank {rank}",
                "group_name": name, "rank": rank, "world_size": world_size}  # fmt: skip

    def update_from_distributed(self, body: dict) -> dict:
        """Receive one bucket by broadcast from rank 0 and load it (and/or finish). Engine thread only."""
        name = _field(body, "group_name", str, SGLANG_GROUP_NAME)
        with self._lock:
            if name not in self._groups:
                raise ValueError(
                    f"group_name {name!r}: no such weight-update group (init_weights_update_group first)"
                )
            group, backend, timeout_s = self._groups[name]
        device = self.engine.device if backend == "nccl" else torch.device("cpu")
        load_format = body.get("load_format")
        if load_format is None:
            return self._update_per_tensor(body, group, device, timeout_s)
        if load_format != FLAT_LOAD_FORMAT:
            raise ValueError(f"load_format must be {FLAT_LOAD_FORMAT!r} or absent, got {load_format!r}")
        groups = _plan(body)
        started = time.perf_counter()
        flats = []
        for flat_group in groups:
            flat = torch.empty(flat_group.numel, dtype=flat_group.torch_dtype, device=device)
            broadcast_from_rank0(group, flat, timeout_s)
            flats.append(flat)
        received = time.perf_counter()
        num_tensors = self._load(groups, flats)
        timing = {"open_s": received - started, "load_s": time.perf_counter() - received}
        return {**self._maybe_finish(body, num_tensors), **timing}

    def _update_per_tensor(self, body: dict, group: Any, device: torch.device, timeout_s: float) -> dict:
        """SGLang's layout: one broadcast per tensor in `names` order, then load; `weight_version` is taken
        at once (with a prefix-cache flush), else `flush_cache` (default true) flushes."""
        names, dtypes, shapes = (_field(body, key, list, []) for key in ("names", "dtypes", "shapes"))
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes, shapes: {len(names)}, {len(dtypes)}, {len(shapes)} entries (must be equal)"
            )
        started = time.perf_counter()
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            dtype = parse_dtype(str(dtype).removeprefix("torch."))  # slime sends "bfloat16"; accept "torch.x"
            tensor = torch.empty([int(d) for d in shape], dtype=dtype, device=device)
            broadcast_from_rank0(group, tensor, timeout_s)
            received.append((str(name), tensor))
        loaded = time.perf_counter()
        if received:
            self.engine.load_weight_bucket(received)
        version = body.get("weight_version")
        if version is not None:
            self.engine.set_weight_version(str(version))
        elif _field(body, "flush_cache", bool, True):
            self.engine.flush_cache()
        return {"success": True, "message": f"{len(received)} tensors updated", "num_tensors": len(received),
                "finished": False, "weight_version": str(self.engine.weight_version),
                "open_s": loaded - started, "load_s": time.perf_counter() - loaded}  # fmt: skip

    def destroy_group(self, body: dict) -> dict:
        name = _field(body, "group_name", str, SGLANG_GROUP_NAME)
        with self._lock:
            entry = self._groups.pop(name, None)
        if entry is not None and hasattr(entry[0], "shutdown"):
            entry[0].shutdown()
        return {"success": True, "message": f"group {name!r} destroyed", "destroyed": entry is not None}

    def close(self) -> None:
        for name in list(self._groups):
            self.destroy_group({"group_name": name})

    # ------------------------------------------------------------------------------------- shared steps

    def checksums(self) -> dict:
        """{weight_version, checksums: {HF name: sha256}} of the engine's weights. Engine thread only."""
        from clawrl.models.hf_io import hf_state_dict

        self.engine.check_weights_resident("weight checksums")
        tp = getattr(self.engine, "tp", None)  # tensor parallel: the full tensors, gathered from every rank
        tensors = (
            tp.full_hf_tensors(self.engine.model) if tp is not None else hf_state_dict(self.engine.model)
        )
        sums = {name: tensor_checksum(t) for name, t in tensors.items()}
        return {"weight_version": str(self.engine.weight_version), "checksums": sums}

    def _load(self, groups: list[FlatGroup], flats: list[torch.Tensor]) -> int:
        stall_point("engine.update_weights")
        if not groups:
            return 0
        named = itertools.chain.from_iterable(unflatten(g, f) for g, f in zip(groups, flats, strict=True))
        self.engine.load_weight_bucket(named)
        if self.engine.device.type == "cuda" or any(f.is_cuda for f in flats):
            # The copies are queued on this thread's stream; the sender may free its buffer once we answer.
            torch.cuda.current_stream(self.engine.device).synchronize()
        return sum(len(g.names) for g in groups)

    def _maybe_finish(self, body: dict, num_tensors: int) -> dict:
        finish = _field(body, "finish", bool, False)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, (str, int)):
            raise ValueError(f"weight_version must be a string, got {version!r}")
        if finish:
            self.engine.set_weight_version(None if version is None else str(version))
        return {"success": True, "message": f"{num_tensors} tensors updated", "num_tensors": num_tensors,
                "finished": finish,
                "weight_version": str(self.engine.weight_version)}  # fmt: skip


def _plan(body: dict) -> list[FlatGroup]:
    return plan_flat_groups(_field(body, "names", list, []), _field(body, "dtypes", list, []),
                            _field(body, "shapes", list, []))  # fmt: skip


_MISSING = object()


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """body[name], type-checked; ValueError naming the field (bools are not ints here)."""
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    value = body.get(name, default)
    if value is _MISSING or value is None and default is _MISSING:
        raise ValueError(f"{name} is required")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value
