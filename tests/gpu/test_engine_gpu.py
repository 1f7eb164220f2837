"""The engine's GPU path on a real GPU: CUDA-graph decode equals eager decode bit for bit, fp32 greedy tokens
equal transformers', bf16 logprobs stay close to transformers', the compiled Triton decode kernel and
sampler match their torch references, and memory release / resume keeps the addresses and the graphs.

    .venv/bin/pytest tests/gpu/test_engine_gpu.py      # skipped without CUDA
"""

import sys
from pathlib import Path

import pytest
import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams

NUM_GPUS = 1
pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))
from test_engine_core import PROMPTS, make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_gpu"), seed=1)


def make_engine(path, **overrides):
    settings = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=512, max_running_requests=8)
    return Engine(EngineConfig(model_path=str(path), **{**settings, **overrides}))


def params(max_new_tokens=24):
    return [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
    ]


def test_cuda_graph_decode_equals_eager_decode(ckpt):
    # 4 prompts decode as a batch of exactly 4, a captured size: both modes run the same kernels on the same
    # shapes, so tokens and logprobs must be identical.
    prompts = PROMPTS[:4]
    graphs = make_engine(ckpt).generate(prompts, params())
    eager = make_engine(ckpt, enable_cuda_graph=False).generate(prompts, params())
    assert [r["output_ids"] for r in graphs] == [r["output_ids"] for r in eager]
    assert [r["logprobs"] for r in graphs] == [r["logprobs"] for r in eager]
    unfused = make_engine(ckpt, enable_cuda_graph=False, fused_kernels=False).generate(prompts, params())
    assert [r["output_ids"][:4] for r in unfused] == [r["output_ids"][:4] for r in eager]


def test_fp32_greedy_equals_transformers(ckpt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)  # both stop at EOS, like test_engine_core
    results = make_engine(ckpt, dtype="float32").generate(PROMPTS, greedy)
    for prompt, result in zip(PROMPTS, results, strict=True):
        out = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=16)
        assert result["output_ids"] == out[0, len(prompt) :].tolist()


def test_torch_attention_backend_runs_the_reference_path_on_cuda(ckpt):
    # --attention-backend torch (crash debugging): the reference runner on the GPU, no Triton, no graphs;
    # fp32 greedy tokens equal the Triton path's.
    from clawrl.engine.runner.cpu_runner import CpuModelRunner

    engine = make_engine(ckpt, dtype="float32", attention_backend="torch")
    assert type(engine.runner) is CpuModelRunner
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    reference = engine.generate(PROMPTS, greedy)
    triton = make_engine(ckpt, dtype="float32").generate(PROMPTS, greedy)
    assert [r["output_ids"] for r in reference] == [r["output_ids"] for r in triton]


def test_bf16_logprobs_close_to_a_full_forward(ckpt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    for prompt, result in zip(PROMPTS, make_engine(ckpt).generate(PROMPTS, sampled), strict=True):
        full = torch.tensor([prompt + result["output_ids"]], device="cuda")
        with torch.no_grad():
            logits = hf(full).logits[0, len(prompt) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(
            1, torch.tensor(result["output_ids"], device="cuda")[:, None]
        )
        assert torch.tensor(result["logprobs"]) == pytest.approx(want.squeeze(1).cpu(), abs=0.1)


def test_seeded_sampling_is_batch_independent_on_gpu(ckpt):
    engine = make_engine(ckpt)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    alone = engine.generate([PROMPTS[2]], sampled)[0]["output_ids"]
    batched = engine.generate(PROMPTS[:4], [params()[0], params()[1], sampled, params()[3]])[2]["output_ids"]
    assert batched == alone


def test_release_and_resume_keep_addresses_and_graphs(ckpt):
    # Weights and KV cache live in StableBuffers: a release unmaps their memory (the driver's free memory
    # grows by at least their size), a resume maps new memory at the same addresses, so the captured graphs
    # are replayed as they are (same graph objects) and the outputs are unchanged (weights restored from
    # the pinned host copy, the default).
    engine = make_engine(ckpt, num_kv_blocks=4096)
    assert engine.keeps_addresses
    graphs = dict(engine.runner._graphs)
    addresses = [p.data_ptr() for p in engine.model.parameters()] + [engine.kv_cache.k[0].data_ptr()]
    before = engine.generate(PROMPTS[:2], params()[:1] * 2)
    free_before = torch.cuda.mem_get_info()[0]
    engine.release_memory_occupation()
    freed = torch.cuda.mem_get_info()[0] - free_before
    assert freed >= engine.kv_cache.nbytes + engine._weights_buffer.nbytes - (4 << 20)
    engine.resume_memory_occupation()
    assert [p.data_ptr() for p in engine.model.parameters()] + [engine.kv_cache.k[0].data_ptr()] == addresses
    assert engine.generate(PROMPTS[:2], params()[:1] * 2) == before
    assert engine.runner._graphs.keys() == graphs.keys()
    assert all(engine.runner._graphs[size][0] is graphs[size][0] for size in graphs)


def test_weights_released_without_backup_need_an_update(ckpt):
    # weights_cpu_backup=False (colocated training): no host copy; the engine refuses requests until a
    # weight update lands, and touching the released weights is refused instead of faulting the device.
    from clawrl.engine.core.request import RequestError
    from clawrl.models.loader import iter_safetensors

    engine = make_engine(ckpt, weights_cpu_backup=False)
    before = engine.generate(PROMPTS[:2], params()[:1] * 2)
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match="weights are released"):
        engine.update_weights_from_tensors(iter_safetensors(str(ckpt)))
    engine.resume_memory_occupation()
    with pytest.raises(RequestError, match="no weight update has landed"):
        engine.generate(PROMPTS[:2], params()[:1] * 2)
    engine.update_weights_from_tensors(iter_safetensors(str(ckpt)), weight_version="2")
    assert engine.generate(PROMPTS[:2], params()[:1] * 2) == [dict(r, weight_version="2") for r in before]


def test_triton_kernels_match_references_on_gpu():
    from clawrl.engine.runner.sampler import sample
    from clawrl.engine.runner.triton_attention import paged_attention_reference, paged_decode_attention

    generator = torch.Generator().manual_seed(0)
    ctx = [1, 15, 16, 17, 150, 208]  # at most the 13 table columns x 16 tokens
    k_cache = torch.randn(80, 16, 2, 64, generator=generator).to("cuda", torch.bfloat16)
    v_cache = torch.randn(80, 16, 2, 64, generator=generator).to("cuda", torch.bfloat16)
    tables = torch.randperm(80, generator=generator)[: 6 * 13].view(6, 13).to("cuda", torch.int32)
    q = torch.randn(6, 14, 64, generator=generator).to("cuda", torch.bfloat16)
    want = paged_attention_reference(q, k_cache, v_cache, tables, list(range(7)), ctx, 0.125)
    for splits in (1, 8):
        got = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(ctx, device="cuda"), 0.125,
                                     num_splits=splits)  # fmt: skip
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    logits = (torch.randn(32, 151936, generator=generator) * 3).to("cuda", torch.bfloat16)
    rows = [SamplingParams(temperature=[0.0, 1.0][i % 2]) for i in range(32)]
    fused = sample(logits, rows, list(range(32)), [5] * 32, fused=True)
    reference = sample(logits, rows, list(range(32)), [5] * 32, fused=False)
    assert (fused[0] == reference[0]).float().mean() >= 0.97  # ulp-level differences may flip a near-tie
    torch.testing.assert_close(fused[1], reference[1], atol=1e-3, rtol=0)


def test_overlap_schedule_gives_the_plain_schedules_tokens(ckpt):
    # Same batches step for step (all sequences run to max_new_tokens), so identical numbers on the GPU too.
    prompts = PROMPTS[:4]
    plain = make_engine(ckpt, enable_overlap_schedule=False).generate(prompts, params())
    overlapped = make_engine(ckpt, enable_overlap_schedule=True).generate(prompts, params())
    assert [r["output_ids"] for r in overlapped] == [r["output_ids"] for r in plain]
    assert [r["logprobs"] for r in overlapped] == [r["logprobs"] for r in plain]


def test_runner_counts_the_steps_device_span_and_the_hosts_wait(ckpt):
    # The CUDA runner's counters behind perf/engine_gpu_time and perf/engine_gpu_wait_time: every collected
    # step adds its device span (positive, and no longer than the wall time of the whole generation) and the
    # host's wait for it (non-negative).
    import time

    engine = make_engine(ckpt)
    timing = engine.runner.timing
    assert (timing.gpu_s, timing.wait_s) == (0.0, 0.0)
    started = time.perf_counter()
    engine.generate(PROMPTS[:4], params(max_new_tokens=32))
    wall = time.perf_counter() - started
    assert 0 < timing.gpu_s < wall
    assert 0 <= timing.wait_s < wall


def _compiled_variants(*kernels) -> int:
    """Compiled variants of Triton JIT kernels, over devices (a JITFunction's per-device kernel cache)."""
    return sum(len(entry[0]) for kernel in kernels for entry in kernel.device_caches.values())


def test_new_prompt_lengths_compile_no_new_prefill_kernels(ckpt):
    # A rollout with other prompts must not compile kernels inside the engine's step: once one prefill of
    # each kind (with and without sampling) has run, batches of new lengths and counts reuse the variants.
    from clawrl.engine.runner.triton_attention import _prefill_kernel
    from clawrl.engine.runner.triton_ops import (
        _rotary_cache_kernel,
        _sample_merge_kernel,
        _sample_partial_kernel,
    )

    kernels = (_prefill_kernel, _rotary_cache_kernel, _sample_partial_kernel, _sample_merge_kernel)
    engine = make_engine(ckpt, max_running_requests=16)
    sampled = SamplingParams(max_new_tokens=2, temperature=1.0, seed=5, ignore_eos=True)
    engine.generate([[5, 6, 7], [8, 9]], [sampled, sampled])  # warm-up
    engine.flush_cache()
    before = _compiled_variants(*kernels)
    generator = torch.Generator().manual_seed(0)
    for num_prompts in (1, 3, 5, 7, 11, 16):
        lengths = torch.randint(1, 40, (num_prompts,), generator=generator).tolist()
        prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in lengths]
        engine.generate(prompts, [sampled] * num_prompts)
        engine.flush_cache()
    assert _compiled_variants(*kernels) == before
