"""HostOffload: storages go to host buffers and are freed; onload restores every bit, views included."""

import pytest
import torch

from clawrl.trainer.offload import HostOffload


def test_offload_frees_storages_and_onload_restores_bits_and_views():
    base = torch.randn(10, generator=torch.Generator().manual_seed(0))
    view = base[3:7]  # shares base's storage: moved once, restored for both
    other = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    before = (base.clone(), other.clone())
    host = HostOffload()
    moved = host.offload([base, view, other])
    assert moved == 10 * 4 + 6 * 8
    assert host.is_offloaded
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    host.onload()
    assert not host.is_offloaded
    assert torch.equal(base, before[0]) and torch.equal(other, before[1])
    assert torch.equal(view, before[0][3:7]) and view.untyped_storage().data_ptr() == base.data_ptr()
    base.add_(1)  # still one storage after the round trip
    assert torch.equal(view, before[0][3:7] + 1)


def test_offload_again_moves_the_same_storages():
    t = torch.ones(4)
    host = HostOffload()
    host.offload([t])
    host.onload()
    assert host._host == [None]  # CPU: the host copy is dropped once the bytes are back
    t.mul_(3)
    assert host.offload_again() == 16 and t.untyped_storage().nbytes() == 0
    host.onload()
    assert torch.equal(t, torch.full((4,), 3.0))


def test_misuse_is_an_error():
    host = HostOffload()
    with pytest.raises(RuntimeError, match="onload\\(\\) called without a preceding offload\\(\\)"):
        host.onload()
    t = torch.ones(2)
    host.offload([t])
    with pytest.raises(RuntimeError, match="offload\\(\\) called twice"):
        host.offload([t])
    host.onload()
    shared = torch.ones(3)
    shared.numpy()  # storage now shared with numpy: cannot be resized
    with pytest.raises(RuntimeError, match="1 of 2 storages are not resizable"):
        HostOffload().offload([t, shared])
    assert t.untyped_storage().nbytes() == 8  # nothing was touched


@pytest.mark.gpu
def test_cuda_round_trip_through_pinned_memory():
    t = torch.randn(1000, device="cuda")
    want = t.clone()
    allocated_before = torch.cuda.memory_allocated()
    host = HostOffload()
    host.offload([t])
    buffer = host._host[0]
    assert buffer.is_pinned()
    assert torch.cuda.memory_allocated() <= allocated_before - 4000
    host.onload()
    assert torch.equal(t, want)
    host.offload_again()
    assert host._host[0] is buffer  # pinned buffers are slow to allocate: kept for the next offload
    host.onload()
    assert torch.equal(t, want)
