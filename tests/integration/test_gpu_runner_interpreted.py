"""The GPU step (gpu_runner.GpuModelRunner: batched inputs, device block tables, padded decode batches, fused
forward, Triton attention and sampler) run on CPU by the Triton interpreter, against the reference runner:
same greedy and seeded-sampled tokens, same logprobs, through prefill, chunked prefill, preemption and n > 1.

CUDA graphs need a GPU (tests/gpu/test_engine_gpu.py); everything they replay is the padded decode forward
exercised here.
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
sys.path.insert(0, str(Path(__file__).parent))
import pytest
from interpreted_triton import DEVICE, replace_tests_if_triton_was_imported_too_early  # noqa: E402  (before any triton import)
from test_engine_core import PROMPTS, make_checkpoint

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.runner.cpu_runner import CpuModelRunner
from clawrl.engine.runner.gpu_runner import GpuModelRunner, decode_batch_sizes

# The interpreter runs each kernel program in Python (~1 ms per op): a few short prompts keep this file fast.
PROMPTS = PROMPTS[:3]  # 3, 7 and 12 tokens


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_gpu_path"), seed=1)


def make_engine(path, *, gpu_runner, fused_kernels=True, **overrides):
    settings = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=256, max_running_requests=4)
    config = EngineConfig(
        model_path=str(path), device=DEVICE, enable_cuda_graph=False, **{**settings, **overrides}
    )
    engine = Engine(config)
    if not gpu_runner:  # the reference runner, also on CUDA (where the engine would pick the GPU runner)
        engine.runner = CpuModelRunner(engine.model, engine.kv_cache)
    else:
        engine.runner = GpuModelRunner(
            engine.model, engine.kv_cache, max_running_requests=config.max_running_requests,
            context_length=engine.context_length, enable_cuda_graph=False, fused_kernels=fused_kernels,
        )  # fmt: skip
    return engine


def mixed_params(max_new_tokens=4):
    return [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),  # Triton greedy
        SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.7, seed=11, ignore_eos=True
        ),  # Triton draw
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9, top_p=0.9, seed=12, ignore_eos=True),
    ]


def assert_same(results, reference):
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in reference]
    for got, want in zip(results, reference, strict=True):
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4, rel=0)


@pytest.fixture(scope="module")
def reference(ckpt):
    return make_engine(ckpt, gpu_runner=False).generate(PROMPTS, mixed_params())


def test_gpu_step_equals_reference_runner(ckpt, reference):
    engine = make_engine(ckpt, gpu_runner=True)
    assert_same(engine.generate(PROMPTS, mixed_params()), reference)
    assert len({tuple(r["output_ids"]) for r in reference}) == len(PROMPTS)


def test_unfused_gpu_step_equals_reference_runner(ckpt, reference):
    # fused_kernels=False: the model's own torch ops around the Triton attention (its `forward` protocol)
    engine = make_engine(ckpt, gpu_runner=True, fused_kernels=False)
    params = [dataclasses.replace(p, max_new_tokens=2) for p in mixed_params()]
    got = engine.generate(PROMPTS, params)
    want = [{**r, "output_ids": r["output_ids"][:2], "logprobs": r["logprobs"][:2]} for r in reference]
    assert_same(got, want)


def test_chunked_prefill_preemption_and_padding(ckpt, reference):
    # 6 blocks x 4 slots for 22 prompt + 12 new tokens, 6-token steps: chunked prompts, mixed prefill/decode
    # steps, preemption and recomputation; 3 decoding sequences run padded to the batch size 4.
    engine = make_engine(ckpt, gpu_runner=True, num_kv_blocks=6, max_num_batched_tokens=6)
    assert_same(engine.generate(PROMPTS, mixed_params()), reference)
    assert engine.num_preemptions > 0
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_n_samples_share_prompt_blocks_and_differ(ckpt):
    params = SamplingParams(n=3, max_new_tokens=3, temperature=1.0, seed=9, ignore_eos=True)
    want = make_engine(ckpt, gpu_runner=False).generate([PROMPTS[2]], params)
    got = make_engine(ckpt, gpu_runner=True).generate([PROMPTS[2]], params)
    assert_same(got, want)
    assert len({tuple(r["output_ids"]) for r in got}) == 3


def test_decode_batch_sizes():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_overlap_schedule_feeds_pending_tokens_on_the_device(ckpt, reference):
    # Step t + 1 is launched before step t's tokens reach the host: its inputs come from the device buffer
    # of sampled tokens (decode and mixed prefill steps, with preemption and chunking).
    engine = make_engine(
        ckpt, gpu_runner=True, num_kv_blocks=6, max_num_batched_tokens=6, enable_overlap_schedule=True
    )
    assert_same(engine.generate(PROMPTS, mixed_params()), reference)
    assert engine.num_preemptions > 0


def test_prompt_and_top_logprobs_and_penalties_equal_reference_runner(ckpt):
    # Chunked prefill (6-token steps) of prompts scored from position 0 / 5, top logprobs, penalties and
    # min_new_tokens next to a plain request, with the overlap schedule on (the engine steps these
    # requests without it) and one request that only scores its prompt (max_new_tokens 0).
    params = [
        SamplingParams(max_new_tokens=4, temperature=0.0, logprob_start_len=0, top_logprobs_num=2),
        SamplingParams(
            max_new_tokens=4,
            temperature=0.8,
            seed=3,
            ignore_eos=True,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            top_logprobs_num=3,
        ),  # fmt: skip
        SamplingParams(max_new_tokens=0, logprob_start_len=5, top_logprobs_num=1),
        SamplingParams(max_new_tokens=4, temperature=0.0, min_new_tokens=3, logit_bias={2: 50.0}),
    ]
    prompts = PROMPTS + [PROMPTS[1]]
    want = make_engine(ckpt, gpu_runner=False, max_num_batched_tokens=6).generate(prompts, params)
    engine = make_engine(ckpt, gpu_runner=True, max_num_batched_tokens=6, enable_overlap_schedule=True)
    got = engine.generate(prompts, params)
    assert_same(got, want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key in ("prompt_logprobs", "top_logprobs"):
            flat_g = [v for v in _flatten(g.get(key)) if v is not None]
            flat_w = [v for v in _flatten(w.get(key)) if v is not None]
            assert flat_g == pytest.approx(flat_w, abs=1e-4)
    assert len(got[0]["prompt_logprobs"]) == len(PROMPTS[0]) and got[0]["prompt_logprobs"][0] == (None, None)
    assert got[2]["output_ids"] == [] and len(got[2]["prompt_logprobs"]) == len(PROMPTS[2]) - 5
    assert got[3]["output_ids"][3] == 2 and 2 not in got[3]["output_ids"][:3]  # min_new_tokens, then the bias


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


replace_tests_if_triton_was_imported_too_early(globals(), __file__)
