"""Trainer memory features (1 rank, in-process, CPU): offload/onload for --colocate keeps every bit of the
training state and frees its storages; activation checkpointing changes nothing numerically.

On CPU `offload()` runs the same mechanism as on GPU (storages copied to host buffers and resized to 0
bytes), only without pinned memory, so what is checked here is what the GPU path does.
"""

from __future__ import annotations

import pytest
import torch
from trainer_reference import full_weights, make_batch, make_job, running_actor, tiny_checkpoint

from clawrl.trainer.weights import local_tensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("policy"), seed=0)


def _train_metrics(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _optimizer_state(actor) -> list[torch.Tensor]:
    return [local_tensor(v).clone() for st in actor.optimizer.state.values() for v in st.values()]


def _storage_bytes(actor) -> list[int]:
    params = [local_tensor(p).untyped_storage().nbytes() for p in actor.model.parameters()]
    states = [local_tensor(v).untyped_storage().nbytes() for st in actor.optimizer.state.values()
              for v in st.values()]  # fmt: skip
    return params + states + [s.untyped_storage().nbytes() for s in actor.ref_bank.shards]


def test_offload_onload_keeps_the_state_and_the_training(policy, tmp_path):
    job = make_job(policy, train=dict(lr=1e-3), save=str(tmp_path / "ckpt"))
    first, second = make_batch(0), make_batch(1)
    with running_actor(job) as actor:
        actor.train(first)
        weights, state, checksums = full_weights(actor), _optimizer_state(actor), actor.checksums()
        assert actor.offload() >= 3 * sum(w.numel() * 4 for w in weights.values())  # params, m, v (+ ref)
        assert actor.is_offloaded and set(_storage_bytes(actor)) == {0}
        assert actor.offload() == 0  # already offloaded: nothing more to move

        # Reads work while offloaded (parameters come back for the gather, then leave again).
        assert actor.checksums() == checksums
        buckets = [pair for bucket in actor.weight_buckets() for pair in bucket]
        assert all(torch.equal(t, weights[n]) for n, t in buckets) and len(buckets) == len(weights)
        actor.save(0)
        assert actor.is_offloaded and set(_storage_bytes(actor)) == {0}
        with pytest.raises(RuntimeError, match="call onload\\(\\) first"):
            actor.train(second)

        actor.onload()
        actor.onload()  # a no-op when not offloaded (the loop onloads before the first train)
        assert not actor.is_offloaded and 0 not in _storage_bytes(actor)
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(actor), state, strict=True))
        offloaded_run = _train_metrics(actor.train(second))
        offloaded_weights = full_weights(actor)

    with running_actor(make_job(policy, train=dict(lr=1e-3))) as actor:
        actor.train(first)
        assert _train_metrics(actor.train(second)) == offloaded_run
        for name, w in full_weights(actor).items():
            assert torch.equal(w, offloaded_weights[name]), name

    # The checkpoint written while offloaded holds the state after the first rollout.
    with running_actor(make_job(policy, train=dict(lr=1e-3), load=str(tmp_path / "ckpt"))) as actor:
        for name, w in full_weights(actor).items():
            assert torch.equal(w, weights[name]), name
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(actor), state, strict=True))


def test_offload_keeping_the_weights_for_the_sync_then_the_weights(policy):
    # The colocated loop's two stages: after train(), all but the weights leave (the sync reads them on the
    # device); after the sync, the weights. The weights' storages stay untouched by the first stage, the
    # buckets read them without a copy back, and onload restores every bit.
    job = make_job(policy, train=dict(lr=1e-3))
    with running_actor(job) as actor:
        actor.train(make_batch(0))
        weights, state = full_weights(actor), _optimizer_state(actor)
        param_ptrs = [local_tensor(p).data_ptr() for p in actor.master.parameters()]
        state_bytes = sum(v.numel() * v.element_size() for v in state)
        assert actor.offload(keep_weights=True) >= state_bytes
        assert actor.is_offloaded and not actor._host["params"].is_offloaded
        assert all(local_tensor(p).untyped_storage().nbytes() > 0 for p in actor.master.parameters())
        assert [local_tensor(p).data_ptr() for p in actor.master.parameters()] == param_ptrs
        buckets = [pair for bucket in actor.weight_buckets() for pair in bucket]
        assert all(torch.equal(t, weights[n]) for n, t in buckets) and len(buckets) == len(weights)
        assert not actor._host["params"].is_offloaded  # reading them moved nothing
        weight_bytes = sum(local_tensor(p).untyped_storage().nbytes() for p in actor.master.parameters())
        assert actor.offload() >= weight_bytes  # the second stage: the weights only
        assert set(_storage_bytes(actor)) == {0} and actor.offload() == 0
        actor.onload()
        assert all(torch.equal(w, weights[n]) for n, w in full_weights(actor).items())
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(actor), state, strict=True))


def test_activation_checkpointing_is_bitwise_neutral(policy):
    batch = make_batch(4)
    results = []
    for checkpointing in (False, True):
        with running_actor(make_job(policy, gradient_checkpointing=checkpointing)) as actor:
            metrics = _train_metrics(actor.train(batch))
            results.append((metrics, full_weights(actor)))
    (plain, plain_weights), (recomputed, recomputed_weights) = results
    assert recomputed == plain
    assert all(torch.equal(recomputed_weights[n], w) for n, w in plain_weights.items())


def test_onload_if_room_onloads_only_when_the_device_has_room(policy, monkeypatch):
    # The colocated loop onloads while the engines generate, if the GPU has room for the state beside them.
    # The room is the driver's count of free memory (a GPU's; on CPU there is none to run out of), so here
    # the count is set: too little keeps every storage offloaded, enough onloads bit for bit.
    import clawrl.trainer.actor as actor_module

    with running_actor(make_job(policy, train=dict(lr=1e-3))) as actor:
        actor.train(make_batch(0))
        weights, state = full_weights(actor), _optimizer_state(actor)
        assert actor.onload_nbytes() == 0 and actor.onload_if_room(0.05)  # not offloaded: nothing to do
        moved = actor.offload()
        assert actor.onload_nbytes() >= moved  # the offloaded bytes, plus any compute copies rebuilt
        need, total = actor.onload_nbytes(), 100 * actor.onload_nbytes()
        seen = []

        def memory(free):
            return lambda device: seen.append(device) or (free, total)

        monkeypatch.setattr(actor_module, "device_memory", memory(need + 5 * need - 1))  # 5%: 5 * need
        assert not actor.onload_if_room(0.05) and actor.is_offloaded and set(_storage_bytes(actor)) == {0}
        assert seen == [actor.device]
        monkeypatch.setattr(actor_module, "device_memory", memory(need + 5 * need))
        assert actor.onload_if_room(0.05) and not actor.is_offloaded
        assert all(torch.equal(w, weights[n]) for n, w in full_weights(actor).items())
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(actor), state, strict=True))
        monkeypatch.undo()
        actor.offload()
        assert actor.onload_if_room(0.05) and not actor.is_offloaded  # CPU: no device memory count


def test_offload_after_step_keeps_the_state_only_while_it_fits_beside_the_engines(policy, monkeypatch):
    # A colocated trainer that onloaded beside generating engines keeps its state after the step if it grew
    # by no more than the room spare then (the first step creates the optimizer state); the gradients go
    # either way, the state stays bit for bit, and the next step trains as without any of this.
    import clawrl.trainer.actor as actor_module

    reserved = {"now": 1000}
    monkeypatch.setattr(actor_module, "device_memory", lambda device: (600 + 50, 1000))  # spare: 650 - 50
    monkeypatch.setattr(actor_module, "device_reserved", lambda device: reserved["now"])
    runs = []
    for growth, kept in ((600, True), (601, False), (None, False)):
        reserved["now"] = 1000
        with running_actor(make_job(policy, train=dict(lr=1e-3))) as actor:
            if growth is not None:
                assert actor.onload_if_room(0.05)  # not offloaded: it measures the room only
            actor.train(make_batch(0))
            weights, state = full_weights(actor), _optimizer_state(actor)
            assert any(p.grad is not None for p in actor.master.parameters())
            reserved["now"] = 1000 + (growth or 0)
            assert actor.offload_after_step() is kept
            assert all(p.grad is None for p in [*actor.master.parameters(), *actor.model.parameters()])
            assert actor.is_offloaded is not kept
            assert not actor._host["params"].is_offloaded  # offloaded or not, the weights stay for the sync
            assert actor.offload_after_step() is False  # the room is measured once per onload
            actor.onload()
            assert all(torch.equal(w, weights[n]) for n, w in full_weights(actor).items())
            assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(actor), state, strict=True))
            runs.append((_train_metrics(actor.train(make_batch(1))), full_weights(actor)))
    for metrics, weights in runs[1:]:
        assert metrics == runs[0][0]
        assert all(torch.equal(w, runs[0][1][n]) for n, w in weights.items())
