"""The seams of weight sync: the transport registry, the plan's choice of transport, one sync on a rank that
does not send, the engine side's import closure (no trainer-side sender, nothing of the trainer), and a
shared-memory segment that the engine must not re-create.

    .venv/bin/pytest tests/unit/test_weight_sync_seams.py -q
"""

import os
import subprocess
import sys
from multiprocessing import shared_memory

import pytest
import torch

from clawrl.cluster.placement import PlacementPlan
from clawrl.weight_sync import SENDERS, make_sender
from clawrl.weight_sync.base import WeightSender
from clawrl.weight_sync.cycle import Transport, push_weights
from clawrl.weight_sync.flat import plan_flat_groups
from clawrl.weight_sync.wire import SHM_DIR, new_segment_name, open_shared_memory

SENDER_MODULES = ("clawrl.weight_sync.colocated", "clawrl.weight_sync.broadcast", "clawrl.weight_sync.cycle")


def loaded_after_import(module: str) -> list[str]:
    """clawrl modules a fresh interpreter has loaded after `import module`."""
    code = f"import sys, {module}; print('\\n'.join(m for m in sys.modules if m.startswith('clawrl')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import {module} failed:\n{out.stderr[-3000:]}"
    return out.stdout.split()


@pytest.mark.parametrize("module", ["clawrl.engine.weight_receiver", "clawrl.engine.http.app"])
def test_the_engine_side_loads_no_sender_and_nothing_of_the_trainer(module):
    loaded = loaded_after_import(module)
    assert module in loaded and "clawrl.weight_sync.wire" in loaded and "clawrl.weight_sync.flat" in loaded
    assert [m for m in loaded if m in SENDER_MODULES or m.startswith("clawrl.trainer")] == []


def test_registry_names_each_transport_and_builds_its_sender():
    from clawrl.weight_sync.broadcast import BroadcastSender
    from clawrl.weight_sync.colocated import ColocatedSender
    from clawrl.weight_sync.sglang import SglangDistributedSender

    assert {name: load() for name, load in SENDERS.items()} == {
        "colocated": ColocatedSender,
        "broadcast": BroadcastSender,
        "sglang_distributed": SglangDistributedSender,
    }
    sender = make_sender("colocated", timeout_s=7.5, max_inflight=3)  # no engine_urls: not connected yet
    assert isinstance(sender, ColocatedSender) and isinstance(sender, WeightSender)
    assert (sender.timeout_s, sender.max_inflight, sender.urls) == (7.5, 3, [])
    with pytest.raises(
        ValueError,
        match=r"transport must be one of \('colocated', 'broadcast', 'sglang_distributed'\), got 'nccl'",
    ):
        make_sender("nccl")
    with pytest.raises(ValueError, match="got 'shared_memory'"):
        Transport(kind="shared_memory", engine_urls=["http://127.0.0.1:1"])


@pytest.mark.parametrize(
    ("mode", "transport"), [("cpu", "colocated"), ("colocate", "colocated"), ("split", "broadcast")]
)
def test_the_placement_plan_chooses_the_transport(mode, transport):
    plan = PlacementPlan(mode=mode, num_gpus=2, trainer_slots=[0], engine_slots=[1])
    assert plan.weight_transport == transport
    assert Transport(kind=plan.weight_transport, engine_urls=("http://e:1",)).engine_urls == ["http://e:1"]


def test_a_rank_without_transport_gathers_every_bucket_and_joins_the_checksum_collective():
    # ranks > 0 only take part in the gathers: every bucket is consumed, nothing is sent
    buckets = [
        [("a", torch.zeros(3, 4)), ("b", torch.zeros(5, dtype=torch.bfloat16))],  # 48 + 10 bytes
        [("c", torch.zeros(2, dtype=torch.int64))],  # 16 bytes
    ]
    consumed, calls = [], []

    def gathered():
        for bucket in buckets:
            consumed.append(bucket[0][0])
            yield bucket

    metrics = push_weights(None, gathered(), "4", checksums=lambda: calls.append(1) or {"a": "x"})
    assert consumed == ["a", "c"] and calls == [1]
    assert metrics["perf/update_weights_bytes"] == 74.0
    assert sorted(metrics) == [
        "perf/check_weight_update_time",
        "perf/update_weights_bytes",
        "perf/update_weights_gather_time",
        "perf/update_weights_time",
    ]
    assert 0 <= metrics["perf/update_weights_gather_time"] <= metrics["perf/update_weights_time"]
    assert "perf/check_weight_update_time" not in push_weights(None, iter(buckets), "5")


def test_the_engine_never_creates_a_segment_the_sender_already_freed():
    # after a failed sync the sender unlinks buckets still in flight; an engine opening one late must fail,
    # not re-create it empty (a zero-filled file left in /dev/shm, and zeros loaded as weights)
    group = plan_flat_groups(["w"], ["float32"], [[4]])[0]
    name = new_segment_name()
    with pytest.raises(ValueError, match=f"handles: cannot map shared-memory segment {name}"):
        open_shared_memory({"name": name, "nbytes": 16}, group)
    assert not os.path.exists(f"{SHM_DIR}/{name}")
    segment = shared_memory.SharedMemory(name=name, create=True, size=16)
    try:
        segment.buf[:16] = torch.arange(4, dtype=torch.float32).numpy().tobytes()
        assert open_shared_memory({"name": name, "nbytes": 16}, group).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        segment.close()
        segment.unlink()
