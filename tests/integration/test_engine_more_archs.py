"""The engine on architectures beyond the dense Qwen/Llama family (fp32, CPU): native Qwen3-MoE / Qwen2-MoE
through the reference runner, and Mistral / Gemma through the transformers runner (runner/hf_runner.py).

Checkpoints come from `build_tiny_model` with weights redrawn at std 0.25, so that greedy decoding does not
just repeat the last token (a comparison that would pass trivially). The reference is transformers'
`generate` (greedy) and its forward on the full sequence.

Run: .venv/bin/pytest tests/integration/test_engine_more_archs.py -x -q
"""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.runner.cpu_runner import CpuModelRunner
from clawrl.engine.runner.hf_runner import HFModelRunner, hf_model_args
from clawrl.models.tiny import build_tiny_model

VOCAB = 512
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 20)]
NEW_TOKENS = 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


def make_checkpoint(path, arch, seed=1):
    build_tiny_model(path, arch=arch, vocab_size=VOCAB, seed=seed)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if tensor.dim() == 2:
            weights[name] = torch.randn(tensor.shape, generator=generator) * 0.25
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def make_engine(path, **overrides):
    settings = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=256, max_running_requests=16)
    return Engine(EngineConfig(model_path=str(path), **{**settings, **overrides}))


def greedy(**kw):
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, **kw)


def hf_greedy(path, prompts):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS) for p in prompts]
    return [out[0, len(p) :].tolist() for p, out in zip(prompts, outs, strict=True)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.mark.parametrize(
    "arch, runner", [("qwen3_moe", CpuModelRunner), ("qwen2_moe", CpuModelRunner), ("gemma", HFModelRunner)]
)
def test_greedy_matches_transformers_generate(tmp_path, arch, runner):
    path = make_checkpoint(tmp_path / arch, arch)
    engine = make_engine(path)
    assert type(engine.runner) is runner
    got = [r["output_ids"] for r in engine.generate(PROMPTS, greedy(ignore_eos=True))]
    assert got == hf_greedy(path, PROMPTS)
    assert len({tuple(g) for g in got}) == len(PROMPTS)  # the model does not just repeat


def test_mistral_greedy_and_logprobs_match_transformers(mistral):
    engine = make_engine(mistral)
    assert type(engine.runner) is HFModelRunner
    assert engine.kv_cache.device.type == "meta"  # blocks are counted, not allocated
    got = engine.generate(PROMPTS, greedy(ignore_eos=True))
    assert [r["output_ids"] for r in got] == hf_greedy(mistral, PROMPTS)
    # Sampled at T = 0.7: each token's logprob is log_softmax(logits / 0.7) of a full-sequence forward.
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, seed=3))
    model = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, sampled, strict=True):
        output = result["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]
        assert result["logprobs"] == pytest.approx(want.tolist(), abs=1e-5, rel=0)


def test_hf_runner_recomputes_what_its_caches_lack(mistral):
    """A prefix-cache hit (blocks the runner's per-sequence caches never held), preemption for lack of
    blocks, and n > 1 all give the tokens of a plain run."""
    reference = [r["output_ids"] for r in make_engine(mistral).generate(PROMPTS, greedy(ignore_eos=True))]
    engine = make_engine(mistral)
    engine.generate(PROMPTS[-1:], greedy(ignore_eos=True))
    again = engine.generate(PROMPTS[-1:], greedy(ignore_eos=True))[0]
    assert again["cached_tokens"] == 16  # 4 blocks from the prefix cache (the last token is always computed)
    assert again["output_ids"] == reference[-1]
    small = make_engine(mistral, num_kv_blocks=14)  # 56 slots for 32 prompt + 36 new tokens
    assert [r["output_ids"] for r in small.generate(PROMPTS, greedy(ignore_eos=True))] == reference
    assert small.num_preemptions > 0
    samples = engine.generate(PROMPTS[:1], greedy(ignore_eos=True, n=2))
    assert [r["output_ids"] for r in samples] == [reference[0], reference[0]]


def test_hf_runner_weight_update_from_disk(mistral, tmp_path):
    other = make_checkpoint(tmp_path / "other", "mistral", seed=2)
    want = [r["output_ids"] for r in make_engine(other).generate(PROMPTS, greedy(ignore_eos=True))]
    engine = make_engine(mistral)
    before = [r["output_ids"] for r in engine.generate(PROMPTS, greedy(ignore_eos=True))]
    assert before != want
    assert engine.update_weights_from_disk(str(other)) == "1"
    assert [r["output_ids"] for r in engine.generate(PROMPTS, greedy(ignore_eos=True))] == want
    # Mid-generation: the running sequence is retracted and continues with the new weights from its
    # prompt + the tokens it already has (its cache of the old weights must not be reused).
    engine = make_engine(mistral)
    engine.add_request("r", PROMPTS[1], greedy(ignore_eos=True))
    tokens = [t for _ in range(4) for out in engine.step() for t in out.token_ids]
    assert len(tokens) == 4
    engine.update_weights_from_disk(str(other))
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.token_ids]
    prefix = PROMPTS[1] + tokens[:4]
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    rest = model.generate(torch.tensor([prefix]), do_sample=False, max_new_tokens=NEW_TOKENS - 4)
    assert tokens[4:] == rest[0, len(prefix) :].tolist()


def test_model_impl_hf_serves_a_native_architecture_with_the_same_tokens(tmp_path):
    path = make_checkpoint(tmp_path / "qwen3", "qwen3")
    native = make_engine(path)
    hf = make_engine(path, model_impl="hf")
    assert type(native.runner) is CpuModelRunner and type(hf.runner) is HFModelRunner
    params = greedy(ignore_eos=True)
    assert [r["output_ids"] for r in hf.generate(PROMPTS, params)] == [
        r["output_ids"] for r in native.generate(PROMPTS, params)
    ]


def test_unsupported_architecture_names_what_is_supported(mistral, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(mistral, odd)
    (odd / "config.json").write_text(json.dumps({**json.loads((odd / "config.json").read_text()),
                                                 "model_type": "no_such_model"}))  # fmt: skip
    with pytest.raises(ValueError) as error:
        make_engine(odd)
    message = str(error.value)
    assert "model_type 'no_such_model' is not supported by the engine" in message
    assert "qwen2, qwen3, llama, qwen3_moe, qwen2_moe" in message
    assert "causal-LM model types (mistral, gemma" in message
    with pytest.raises(ValueError, match="model_impl must be 'auto', 'native' or 'hf', got 'fast'"):
        EngineConfig(model_path=str(mistral), model_impl="fast")
    args = hf_model_args(mistral)
    assert (args.arch, args.num_layers, args.num_kv_heads, args.head_dim) == ("mistral", 2, 2, 16)
