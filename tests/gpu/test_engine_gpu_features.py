"""This round's engine features on a real GPU: a tiny Qwen3-MoE served with CUDA graphs (the MoE block runs
every expert on every row inside a captured graph) gives the same fp32 greedy tokens as transformers and as
eager decode; prompt log-probs of the Triton path equal a transformers forward; a Mistral checkpoint goes
through the transformers runner on CUDA.

    .venv/bin/pytest tests/gpu/test_engine_gpu_features.py      # skipped without CUDA
"""

import pytest
import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.models.tiny import build_tiny_model

NUM_GPUS = 1
pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 8, 1000, 12, 44, 9], [300, 301], [2, 4, 6, 8, 10, 12, 14, 16, 18]]


def _engine(path, **overrides):
    settings = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_running_requests=8)
    return Engine(EngineConfig(model_path=str(path), **{**settings, **overrides}))


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", vocab_size=2048)


def test_moe_with_cuda_graphs_equals_transformers_and_eager(moe):
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    graphs = _engine(moe).generate(PROMPTS, greedy)
    eager = _engine(moe, enable_cuda_graph=False).generate(PROMPTS, greedy)
    assert [r["output_ids"] for r in graphs] == [r["output_ids"] for r in eager]
    hf = _hf(moe)
    for prompt, result in zip(PROMPTS, graphs, strict=True):
        out = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12)  # fmt: skip
        assert result["output_ids"] == out[0, len(prompt) :].tolist()


def test_prompt_logprobs_on_the_triton_path_equal_a_full_forward(tmp_path):
    path = build_tiny_model(tmp_path / "dense", vocab_size=2048)
    engine = _engine(path)
    assert type(engine.runner).__name__ != "CpuModelRunner"
    score = SamplingParams(max_new_tokens=0, logprob_start_len=0)
    results = engine.generate(PROMPTS, score)
    hf = _hf(path)
    for prompt, result in zip(PROMPTS, results, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, :-1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0]
        got = [
            lp for lp, _ in result["prompt_logprobs"][1:]
        ]  # (logprob, top) per position; the first is None
        assert len(got) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(got), want.cpu(), atol=1e-4, rtol=0)


def test_mistral_runs_through_the_transformers_runner_on_cuda(tmp_path):
    path = build_tiny_model(tmp_path / "mistral", arch="mistral", vocab_size=2048)
    engine = _engine(path, model_impl="hf")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    results = engine.generate(PROMPTS, greedy)
    hf = _hf(path)
    for prompt, result in zip(PROMPTS, results, strict=True):
        out = hf.generate(
            torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=8, min_new_tokens=8
        )
        assert result["output_ids"] == out[0, len(prompt) :].tolist()
