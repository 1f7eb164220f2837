"""The overlap schedule (EngineConfig.enable_overlap_schedule) on the CPU reference runner: step t + 1 is
scheduled and launched before step t's tokens are processed, yet every request gets exactly the tokens and
logprobs of the plain schedule — with stops at different times, preemption, chunked prefill, n > 1, aborts
and a weight update while a step is in flight."""

import sys
from pathlib import Path

import pytest

from clawrl.engine.core.request import SamplingParams
from clawrl.engine.core.sequence import PENDING_TOKEN
from clawrl.models.loader import iter_safetensors

sys.path.insert(0, str(Path(__file__).parent))
from test_engine_core import PROMPTS, assert_same, make_checkpoint, make_engine, mixed_params  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_overlap"), seed=1)


def overlapped(path, **overrides):
    return make_engine(path, enable_overlap_schedule=True, **overrides)


def test_same_results_as_the_plain_schedule(ckpt):
    # mixed_params stop on EOS (some early), so sequences finish at different steps while others run on.
    plain = make_engine(ckpt).generate(PROMPTS, mixed_params())
    assert len({len(r["output_ids"]) for r in plain}) > 1
    engine = overlapped(ckpt)
    assert_same(engine.generate(PROMPTS, mixed_params()), plain)
    assert [r["finish_reason"] for r in engine.generate(PROMPTS, mixed_params())] == [
        r["finish_reason"] for r in plain
    ]
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("overrides", [dict(num_kv_blocks=24), dict(max_num_batched_tokens=8)])
def test_preemption_and_chunked_prefill(ckpt, overrides):
    params = [SamplingParams(**{**vars(p), "ignore_eos": True}) for p in mixed_params()]
    plain = make_engine(ckpt, **overrides).generate(PROMPTS, params)
    engine = overlapped(ckpt, **overrides)
    assert_same(engine.generate(PROMPTS, params), plain)
    if "num_kv_blocks" in overrides:
        assert engine.num_preemptions > 0


def test_n_samples_and_outputs_arrive_one_call_later(ckpt):
    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    plain = make_engine(ckpt).generate([PROMPTS[3]], params)
    engine = overlapped(ckpt)
    engine.add_request("g", PROMPTS[3], params)
    assert engine.step() == []  # the leader's prefill is launched; nothing is back yet
    leader = engine.scheduler.running[0]
    assert leader.output_token_ids == [PENDING_TOKEN]
    outputs = engine.step()
    assert [o.index for o in outputs] == [0]
    assert leader.output_token_ids == [*outputs[0].token_ids, PENDING_TOKEN]  # the next one is in flight
    while engine.has_unfinished_requests():
        outputs += engine.step()
    for i in range(3):
        assert [t for o in outputs if o.index == i for t in o.token_ids] == plain[i]["output_ids"]


def test_abort_while_in_flight(ckpt):
    engine = overlapped(ckpt)
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], long)
    engine.add_request("b", PROMPTS[1], long)
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    aborted = [o for o in outputs if o.request_id == "a"]
    assert [o.finish_reason for o in aborted] == [{"type": "abort"}] and aborted[0].token_ids == []
    b_tokens = [t for o in outputs if o.request_id == "b" for t in o.token_ids]
    assert PENDING_TOKEN not in b_tokens and outputs[-1].finish_reason == {"type": "length", "length": 40}
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_weight_update_drains_the_step_in_flight(ckpt):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    reference = make_engine(ckpt).generate([PROMPTS[3]], greedy)[0]["output_ids"]
    engine = overlapped(ckpt)
    engine.add_request("r", PROMPTS[3], greedy)
    outputs = engine.step() + engine.step() + engine.step()
    engine.update_weights_from_tensors(iter_safetensors(ckpt))  # same weights, new version
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.token_ids] == reference
    assert [o.weight_version for o in outputs] == ["0", "0", "0"] + ["1"] * 7
    assert engine.flush_cache()
