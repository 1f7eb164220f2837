"""Weight sync from trainer rank 0 to the engines: the interface (base.py), one module per transport, the
wire format both ends share (flat.py, wire.py) and one sync from start to end (cycle.py).

    from clawrl.weight_sync import make_sender, verify_engine_weights
    sender = make_sender("colocated", engine_urls=urls)        # a transport by name (SENDERS)

The transports register in SENDERS below. Their classes are imported when first asked for: the engine's
receiver imports this package (for flat.py and wire.py) and must not load the trainer-side senders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clawrl.weight_sync.base import WeightSender, WeightSyncError
from clawrl.weight_sync.checksum import WeightMismatchError, tensor_checksum, verify_engine_weights


def _colocated() -> type[WeightSender]:
    from clawrl.weight_sync.colocated import ColocatedSender

    return ColocatedSender


def _broadcast() -> type[WeightSender]:
    from clawrl.weight_sync.broadcast import BroadcastSender

    return BroadcastSender


def _sglang_distributed() -> type[WeightSender]:
    from clawrl.weight_sync.sglang import SglangDistributedSender

    return SglangDistributedSender


SENDERS: dict[str, Callable[[], type[WeightSender]]] = {
    "colocated": _colocated,
    "broadcast": _broadcast,
    "sglang_distributed": _sglang_distributed,
}
"""Transport name -> a function returning its sender class. "colocated": shared memory (CPU) or CUDA IPC
(GPU), trainer and engine on one machine/GPU; "broadcast": a gloo/NCCL group with engines on GPUs of
their own (split placement); "sglang_distributed": the broadcast in SGLang's own payloads, for engines
clawrl did not start (--rollout-external-engine-addrs). Which one a run uses is decided by its placement
plan (and --rollout-external-engine-addrs)."""


def make_sender(kind: str, **kwargs: Any) -> WeightSender:
    """A sender of transport `kind` (a SENDERS name); kwargs go to its constructor (engine_urls connects)."""
    if kind not in SENDERS:
        raise ValueError(f"weight sync transport must be one of {tuple(SENDERS)}, got {kind!r}")
    return SENDERS[kind]()(**kwargs)


__all__ = [
    "SENDERS",
    "WeightMismatchError",
    "WeightSender",
    "WeightSyncError",
    "make_sender",
    "tensor_checksum",
    "verify_engine_weights",
]
