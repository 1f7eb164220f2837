"""The engine's per-step host work, vectorised for large batches, computes what the sequences say.

- DeviceBlockTables sends only the grown tails of block tables and keeps a host mirror equal to the device.
- Every decode launch of the GPU runner (run on CPU through the Triton interpreter) stages, for each row,
  exactly the sequence's own last token, position, cache slot, block-table row, context length, pending-token
  source and sampling key, while its per-composition record (_DecodeRows) is reused across steps and rebuilt
  when a sequence leaves (abort) or the scheduler's epoch moves (preemption) — and the tokens still equal the
  reference runner's.
- The engine's fused stop check (max_output_tokens / stop_token_set) ends at the context length with the
  full rules' reason, and StepOutputs built positionally carry the right fields.
- EngineConfig.enable_overlap_schedule defaults to on for CUDA, off on CPU.
"""

import numpy as np
import pytest
import torch
from interpreted_triton import (  # before clawrl.engine.triton_*: sets TRITON_INTERPRET
    DEVICE,
    replace_tests_if_triton_was_imported_too_early,
)

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine, StepOutput
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from clawrl.engine.runner.cpu_runner import CpuModelRunner
from clawrl.engine.runner.gpu_runner import DeviceBlockTables, GpuModelRunner
from clawrl.engine.runner.sampler import sampling_keys
from clawrl.models.tiny import build_tiny_model

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_host"), vocab_size=512, seed=3)


def running_seq(seq_id, table):
    seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=[1], params=SamplingParams())
    seq.status, seq.block_table = SequenceStatus.RUNNING, table
    return seq


def test_block_tables_send_grown_tails_and_mirror_the_device():
    tables = DeviceBlockTables(4, 5, torch.device("cpu"))
    a, b = running_seq(0, [3, 7]), running_seq(1, [5])
    rows = np.array(tables.rows_for([a, b]))
    a.block_table.append(9)  # a decoding sequence grows its own list
    b.block_table.append(4)
    tables.sync_grown([a, b], rows, np.array([3, 1]))  # b's new block is not needed yet: not sent
    assert tables.device_table[rows[0], :3].tolist() == [3, 7, 9]
    assert tables.num_synced[rows].tolist() == [3, 1]
    tables.sync_grown([a, b], rows, np.array([3, 2]))
    assert tables.device_table[rows[1], :2].tolist() == [5, 4]
    a.block_table = [11]  # preempted and readmitted: a new, shorter list is sent whole
    assert tables.rows_for([a, b]) == rows.tolist()
    assert tables.device_table[rows[0], 0].item() == 11 and tables.num_synced[rows[0]] == 1
    assert (tables.host_table == tables.device_table.numpy()).all()


def make_engine(path, *, gpu_runner, **overrides):
    settings = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_running_requests=4)
    config = EngineConfig(
        model_path=str(path), device=DEVICE, enable_cuda_graph=False, **{**settings, **overrides}
    )
    engine = Engine(config)
    if gpu_runner:
        engine.runner = GpuModelRunner(
            engine.model, engine.kv_cache, max_running_requests=config.max_running_requests,
            context_length=engine.context_length, enable_cuda_graph=False,
        )  # fmt: skip
    else:  # the reference runner, also on CUDA
        engine.runner = CpuModelRunner(engine.model, engine.kv_cache)
    return engine


def expected_inputs(runner, seqs):
    """The 7 staging rows of a decode launch, computed sequence by sequence (before the launch)."""
    block_size = runner.kv_cache.block_size
    previous = {s.seq_id: i for i, s in enumerate(runner._last_seqs)}
    rows = []
    for seq in seqs:
        last = seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1]
        pos = seq.num_computed_tokens
        slot = seq.block_table[pos // block_size] * block_size + pos % block_size
        key = int(sampling_keys([seq.sampler_state], [len(seq.output_token_ids)])[0])
        source = previous[seq.seq_id] if last == PENDING_TOKEN else -1
        rows.append([last, pos, slot, None, pos + 1, source, key])
    return rows


def record_decode_launches(runner):
    """Wrap runner._decode: check each launch's staging against expected_inputs; count reused records."""
    stats = {"launches": 0, "reused": 0}
    inner = runner._decode

    def checked(batch):
        want = expected_inputs(runner, batch.seqs)
        before = runner._decode_rows
        out = inner(batch)
        stats["launches"] += 1
        stats["reused"] += runner._decode_rows is before
        staged = runner._staging_host[runner._flip].numpy()
        block_size = runner.kv_cache.block_size
        for i, (seq, row) in enumerate(zip(batch.seqs, want, strict=True)):
            got = staged[:, i].tolist()
            assert got[:3] + got[4:] == row[:3] + row[4:], (seq.seq_id, got, row)
            num_blocks = seq.num_computed_tokens // block_size + 1
            assert runner.tables.device_table[got[3], :num_blocks].tolist() == seq.block_table[:num_blocks]
        size = next(s for s in runner.batch_sizes if s >= len(batch.seqs))
        padding = staged[:, len(batch.seqs) : size]
        assert (padding[4] == 0).all() and (padding[2] == runner.kv_cache.scratch_slot).all()
        return out

    runner._decode = checked
    return stats


def params(max_new_tokens=9):
    return [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=21, ignore_eos=True),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=5, seed=22, ignore_eos=True),
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_inputs_equal_each_sequences_own_state(ckpt, overlap):
    want = make_engine(ckpt, gpu_runner=False).generate(PROMPTS, params())
    engine = make_engine(ckpt, gpu_runner=True, enable_overlap_schedule=overlap)
    stats = record_decode_launches(engine.runner)
    got = engine.generate(PROMPTS, params())
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert stats["launches"] >= 8 and stats["reused"] >= 5  # mostly reused; rebuilt as sequences finish


def test_decode_inputs_after_abort_and_preemption(ckpt):
    # 9 blocks of 4 slots for three sequences growing to 7..20 tokens: preemption moves the epoch.
    engine = make_engine(ckpt, gpu_runner=True, num_kv_blocks=9, enable_overlap_schedule=True)
    stats = record_decode_launches(engine.runner)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params(8), strict=True)):
        engine.add_request(f"q{i}", prompt, p)
    outputs = []
    for _ in range(6):
        outputs += engine.step()
    engine.abort_request("q0")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert engine.num_preemptions > 0 and stats["launches"] > stats["reused"] > 0
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finished == {"q0": {"type": "abort"}, "q1": {"type": "length", "length": 8}, "q2": finished["q2"]}
    assert finished["q2"] == {"type": "length", "length": 8}


def test_readmitted_sequences_get_their_new_block_tables(ckpt):
    # Prompts of 5 and 9 tokens, blocks of 4: after 3 decode steps both hold 4k + 1 tokens, every computed block
    # is full and cached. Preempted and readmitted, each computes only its last token: a decode batch of the
    # same two sequences as before, but with new block-table lists (the epoch moved), which must be sent.
    engine = make_engine(ckpt, gpu_runner=True, enable_overlap_schedule=False)
    stats = record_decode_launches(engine.runner)
    for i, prompt in enumerate([PROMPTS[1][:5], PROMPTS[2][:9]]):
        engine.add_request(f"p{i}", prompt, params(8)[1])
    for _ in range(4):  # prefill, then 3 decode steps
        engine.step()
    assert [s.num_tokens for s in engine.scheduler.running] == [9, 13]
    assert engine.scheduler.preempt_all() == 2
    engine.step()
    assert stats == {"launches": 4, "reused": 2}  # the first decode builds, two reuse, the readmitted rebuild
    while engine.has_unfinished_requests():
        engine.step()


def test_context_length_stop_and_output_fields(ckpt):
    engine = make_engine(ckpt, gpu_runner=False, context_length=16)
    engine.add_request("c", PROMPTS[2], SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.token_ids) for o in outputs] == [1, 1, 1, 1]  # 12 prompt + 4 = the context length
    last = outputs[-1]
    assert last.finished and last.finish_reason == {"type": "length", "length": 4}
    assert not any(o.finished for o in outputs[:-1])
    assert (last.request_id, last.index, last.weight_version, last.prompt_tokens, last.cached_tokens) == (
        "c",
        0,
        "0",
        12,
        0,
    )
    assert isinstance(last, StepOutput) and last == StepOutput(**last._asdict())


def test_overlap_schedule_defaults_to_on_for_cuda_only(tmp_path):
    path = str(tmp_path)
    assert EngineConfig(model_path=path, device="cuda").overlap_schedule
    assert EngineConfig(model_path=path, device="cuda:1").overlap_schedule
    assert not EngineConfig(model_path=path, device="cpu").overlap_schedule
    assert not EngineConfig(model_path=path, device="cuda", enable_overlap_schedule=False).overlap_schedule
    assert EngineConfig(model_path=path, device="cpu", enable_overlap_schedule=True).overlap_schedule
    with pytest.raises(ValueError, match="EngineConfig.enable_overlap_schedule .* got 'yes'"):
        EngineConfig(model_path=path, enable_overlap_schedule="yes")


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
