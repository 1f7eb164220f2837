"""The world-size-1 fast path (clawrl/trainer/single_rank.py) against FSDP2 at one rank, on CPU in fp32 and bf16.

The same tiny model, batch and seed through both wrappings: losses, gradients and updated weights must agree
(bit for bit where the arithmetic is the same; the gradient norm to its last bits), and checkpoints, offload and
weight export must behave alike. bf16 compute runs on CPU here (slow kernels, same semantics as on GPU).

    .venv/bin/pytest tests/unit/test_trainer_single_rank.py -q
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from clawrl.models.attention import VarlenAttention
from clawrl.models.hf_io import load_model
from clawrl.models.lora import LoraSpec, apply_lora
from clawrl.trainer import checkpoint as ckpt
from clawrl.trainer.distributed import free_port, init_distributed
from clawrl.trainer.fsdp import FsdpModel, build_mesh
from clawrl.trainer.offload import HostOffload
from clawrl.trainer.optim import build_adamw, clip_grad_norm
from clawrl.trainer.single_rank import SingleRankModel, wrap_for_training
from clawrl.trainer.weights import iter_full_tensors, iter_weight_buckets

VOCAB = 320
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """FSDP2 and DCP need a (one-rank gloo) process group; the fast path runs inside the same one."""
    owned = not dist.is_initialized()
    init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device_type="cpu"
    )
    yield
    if owned:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from clawrl.models.tiny import build_tiny_model

    # Tied embeddings: the LM head's and the embedding's gradients meet in one parameter.
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", vocab_size=VOCAB))


def wrapped_model(model_dir, path: str, dtype: torch.dtype, *, lora: LoraSpec | None = None):
    """(wrapped module, AdamW on its master) for `path` "fast" or "fsdp", compute dtype `dtype`."""
    torch.manual_seed(0)
    model = load_model(model_dir, fused=False, device="cpu", dtype=torch.float32)
    if lora is not None:
        apply_lora(model, lora)
    wrapped = wrap_for_training(model, build_mesh("cpu", 1), compute_dtype=dtype, single_rank=path == "fast",
                                activation_checkpointing=False)  # fmt: skip
    optimizer = build_adamw(wrapped.master.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    return wrapped, optimizer


def micro_batches(seed: int) -> list[tuple[torch.Tensor, list[int]]]:
    """Two packed micro-batches (token ids [N], segment lengths)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lengths in ([7, 12, 5], [16, 9]):
        out.append((torch.randint(0, VOCAB, (sum(lengths),), generator=gen), lengths))
    return out


def train_step(wrapped, optimizer, mbs, *, clip: float = 0.0):
    """One optimizer step over `mbs` the way TrainActor takes it; returns (losses, fp32 grads by name, norm)."""
    wrapped.zero_grad(optimizer)
    losses = []
    for index, (ids, lengths) in enumerate(mbs):
        wrapped.before_backward(is_last=index == len(mbs) - 1)
        positions = torch.cat([torch.arange(n) for n in lengths])
        hidden = wrapped.compute(ids, positions, VarlenAttention.from_lengths(lengths))
        logits = (hidden @ wrapped.compute.lm_head.weight.t()).float()
        loss = F.cross_entropy(logits[:-1], ids[1:], reduction="sum") / 64
        loss.backward()
        wrapped.after_backward(is_first=index == 0)
        losses.append(loss.item())
    grads = {n: _full(p.grad).clone() for n, p in wrapped.master.named_parameters() if p.grad is not None}
    norm = clip_grad_norm(wrapped.master, clip, "test gradient norm")
    optimizer.step()
    wrapped.after_step()
    return losses, grads, norm


def master_weights(wrapped) -> dict[str, torch.Tensor]:
    return {n: _full(p.detach()).clone() for n, p in wrapped.master.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_steps_equal_fsdp2_bit_for_bit(model_dir, dtype):
    fast, fast_opt = wrapped_model(model_dir, "fast", DTYPES[dtype])
    fsdp, fsdp_opt = wrapped_model(model_dir, "fsdp", DTYPES[dtype])
    assert isinstance(fast, SingleRankModel) and isinstance(fsdp, FsdpModel)
    assert fast.aliased == (dtype == "fp32")
    for seed in (1, 2):  # the second step runs on the refreshed compute copies of the first step's update
        fast_losses, fast_grads, fast_norm = train_step(fast, fast_opt, micro_batches(seed))
        fsdp_losses, fsdp_grads, fsdp_norm = train_step(fsdp, fsdp_opt, micro_batches(seed))
        assert fast_losses == fsdp_losses
        assert all(g.dtype == torch.float32 for g in fast_grads.values())
        assert_same(fast_grads, fsdp_grads)  # bf16 grads per micro-batch, summed in fp32, in the same order
        assert fast_norm == pytest.approx(fsdp_norm, rel=1e-6)  # FSDP2's norm goes through DTensor
        assert_same(master_weights(fast), master_weights(fsdp))
    moved = master_weights(fast)["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(moved, dict(load_model(model_dir, fused=False).named_parameters())[
        "model.layers.0.mlp.up_proj.weight"])  # fmt: skip


def test_clipped_step_equals_fsdp2_to_the_norms_last_bits(model_dir):
    fast, fast_opt = wrapped_model(model_dir, "fast", torch.bfloat16)
    fsdp, fsdp_opt = wrapped_model(model_dir, "fsdp", torch.bfloat16)
    _, _, norm = train_step(fast, fast_opt, micro_batches(3), clip=0.05)
    train_step(fsdp, fsdp_opt, micro_batches(3), clip=0.05)
    assert norm > 0.05  # the clip did scale the gradients
    a, b = master_weights(fast), master_weights(fsdp)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
    # what the engine receives (bf16) is the same but for an odd rounding-boundary case
    differ = sum(int((a[n].bfloat16() != b[n].bfloat16()).sum()) for n in a)
    assert differ <= 1e-4 * sum(t.numel() for t in a.values())


def test_bf16_layout_flat_buffers_tied_weight_and_persistent_grads(model_dir):
    fast, optimizer = wrapped_model(model_dir, "fast", torch.bfloat16)
    compute, master = fast.compute, fast.master
    assert compute is not master
    assert {p.dtype for p in compute.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert compute.lm_head.weight is compute.model.embed_tokens.weight  # the tie survives the copy
    assert compute.model.rotary_emb.cos_cache is master.model.rotary_emb.cos_cache  # buffers shared, fp32
    storages = {p.untyped_storage().data_ptr() for p in compute.parameters()}
    assert len(storages) == 1  # one flat bf16 buffer: refreshing it is one cast
    for c, m in zip(compute.parameters(), master.parameters(), strict=True):
        assert torch.equal(c, m.bfloat16())
    train_step(fast, optimizer, micro_batches(1))
    pointers = [p.grad.data_ptr() for p in [*compute.parameters(), *master.parameters()]]
    train_step(fast, optimizer, micro_batches(2))
    # autograd accumulated into the same buffers again: no gradient allocation per step
    assert [p.grad.data_ptr() for p in [*compute.parameters(), *master.parameters()]] == pointers
    for c, m in zip(compute.parameters(), master.parameters(), strict=True):
        assert torch.equal(c, m.bfloat16())  # the update reached the compute copies


@pytest.mark.parametrize("dtype", DTYPES)
def test_offload_round_trip_frees_the_copies_and_restores_every_bit(model_dir, dtype):
    fast, optimizer = wrapped_model(model_dir, "fast", DTYPES[dtype])
    train_step(fast, optimizer, micro_batches(1))
    before = master_weights(fast)
    compute_before = {n: p.detach().clone() for n, p in fast.compute.named_parameters()}
    params, optim = HostOffload(), HostOffload()
    optimizer.zero_grad(set_to_none=True)
    fast.release()
    moved = params.offload(fast.offload_tensors())
    optim.offload([v for st in optimizer.state.values() for v in st.values()])
    master_bytes = sum(p.numel() * 4 for p in fast.master.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in fast.master.buffers())
    assert moved == master_bytes + buffer_bytes  # the bf16 copies are rebuilt, not moved
    assert all(p.untyped_storage().nbytes() == 0 for p in fast.compute.parameters())
    assert all(p.grad is None for p in [*fast.compute.parameters(), *fast.master.parameters()])
    params.onload()
    optim.onload()
    fast.restore()
    assert_same(master_weights(fast), before)
    assert_same({n: p.detach() for n, p in fast.compute.named_parameters()}, compute_before)
    # and training goes on exactly as without the round trip
    twin, twin_opt = wrapped_model(model_dir, "fast", DTYPES[dtype])
    train_step(twin, twin_opt, micro_batches(1))
    assert train_step(fast, optimizer, micro_batches(2))[0] == train_step(twin, twin_opt, micro_batches(2))[0]
    assert_same(master_weights(fast), master_weights(twin))


@pytest.mark.parametrize("first, second", [("fast", "fast"), ("fast", "fsdp"), ("fsdp", "fast")])
def test_checkpoint_round_trip_across_paths(model_dir, tmp_path, first, second):
    saver, saver_opt = wrapped_model(model_dir, first, torch.bfloat16)
    train_step(saver, saver_opt, micro_batches(1))
    ckpt.save_checkpoint(tmp_path, 0, saver.master, saver_opt, {"schedule": {}})
    loader, loader_opt = wrapped_model(model_dir, second, torch.bfloat16)
    ckpt.load_checkpoint(tmp_path, loader.master, loader_opt)
    loader.after_load()
    assert_same(master_weights(loader), master_weights(saver))
    # the optimizer state came along: the next step is the same on both
    assert (
        train_step(loader, loader_opt, micro_batches(2))[0]
        == train_step(saver, saver_opt, micro_batches(2))[0]
    )
    assert_same(master_weights(loader), master_weights(saver))


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_buckets_equal_fsdp2(model_dir, dtype):
    fast, fast_opt = wrapped_model(model_dir, "fast", DTYPES[dtype])
    fsdp, fsdp_opt = wrapped_model(model_dir, "fsdp", DTYPES[dtype])
    train_step(fast, fast_opt, micro_batches(1))
    train_step(fsdp, fsdp_opt, micro_batches(1))
    for export_dtype in (torch.bfloat16, torch.float32):
        buckets = [
            [
                [(n, t) for n, t in b]
                for b in iter_weight_buckets(iter_full_tensors(w.master, export_dtype), 40_000)
            ]
            for w in (fast, fsdp)
        ]
        assert [[n for n, _ in b] for b in buckets[0]] == [[n for n, _ in b] for b in buckets[1]]
        assert len(buckets[0]) > 1
        for (n, a), (_, b) in zip(sum(buckets[0], []), sum(buckets[1], []), strict=True):
            assert a.dtype == export_dtype and torch.equal(a, b), n
            assert a.untyped_storage().data_ptr() != fast.master.get_parameter(n).untyped_storage().data_ptr()


def test_lora_bf16_step_equals_fsdp2_and_merged_export(model_dir):
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "up_proj"))
    fast, fast_opt = wrapped_model(model_dir, "fast", torch.bfloat16, lora=spec)
    fsdp, fsdp_opt = wrapped_model(model_dir, "fsdp", torch.bfloat16, lora=spec)
    frozen = [p for p in fast.compute.parameters() if not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in fast.master.parameters()} == {torch.float32}  # the base keeps its fp32 master
    for seed in (1, 2):
        fast_losses, fast_grads, _ = train_step(fast, fast_opt, micro_batches(seed))
        fsdp_losses, fsdp_grads, _ = train_step(fsdp, fsdp_opt, micro_batches(seed))
        assert fast_losses == fsdp_losses
        assert_same(fast_grads, fsdp_grads)
        assert all(".lora_" in n for n in fast_grads)
    merged = [dict(iter_full_tensors(w.master, torch.float32)) for w in (fast, fsdp)]
    assert_same(*merged)
