"""Process-group setup for the trainer: gloo on CPU, NCCL on GPU, always with a deadline.

A trainer rank is one process (a Ray actor, or a plain process in tests). Every collective inherits the
process group's timeout, so a peer that died turns into an error instead of an endless wait
(ARCHITECTURE decision 10).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for the rendezvous of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device_type: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the trainer's default process group (a no-op if this process already has one)."""
    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {}
    if device_type == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    if world_size == 1 and device_type == "cpu":
        # Nobody to meet: an in-process store instead of a TCP one. The port free_port() found may be taken
        # by another process (an engine's server starting at the same moment) before the store binds it.
        # (CUDA keeps the TCP store until NCCL with an in-process store has run on a GPU here.)
        kwargs["store"] = dist.HashStore()
    else:
        kwargs["init_method"] = f"tcp://{master_addr}:{master_port}"
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned (identity without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
