"""Engine core on a real tiny model (fp32, CPU): parity with transformers, batching invariance, preemption,
chunked prefill, logprobs, seeds, n > 1 block sharing, prefix cache, stop rules, abort, weight updates.

The checkpoints come from `clawrl.models.tiny.build_tiny_model`, with weights redrawn at std 0.25: at the
builder's init scale a 2-layer random model just repeats its last input token, which would make token
comparisons pass trivially.
"""

import dataclasses
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
from clawrl.engine.core.sequence import IncrementalDetokenizer
from clawrl.models.loader import iter_safetensors
from clawrl.models.tiny import build_tiny_model

VOCAB = 512
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 7, 12, 20, 30)]


def make_checkpoint(path, seed):
    build_tiny_model(
        path, vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=seed
    )
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if tensor.dim() == 2:
            weights[name] = torch.randn(tensor.shape, generator=generator) * 0.25
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_a"), seed=1)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_b"), seed=2)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def make_engine(path, **overrides):
    settings = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=256, max_running_requests=16)
    return Engine(EngineConfig(model_path=str(path), **{**settings, **overrides}))


@pytest.fixture(scope="module")
def engine(ckpt):
    return make_engine(ckpt)


def greedy(max_new_tokens=12, **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)


def ids(results):
    return [r["output_ids"] for r in results]


def test_greedy_matches_transformers_generate(engine, hf_model):
    results = engine.generate(PROMPTS, greedy(max_new_tokens=16))
    for prompt, result in zip(PROMPTS, results, strict=True):
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
        assert result["output_ids"] == out[0, len(prompt) :].tolist()
    assert len({tuple(r) for r in ids(results)}) == len(PROMPTS)  # the model does not just repeat


def mixed_params():
    return [
        greedy(),
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=11),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=12),
        SamplingParams(max_new_tokens=12, temperature=1.2, top_k=20, min_p=0.01, seed=13),
        SamplingParams(max_new_tokens=12, temperature=0.8, seed=14),
    ]


def assert_same(results, reference, logprob_tol=1e-5):
    # Not bitwise: MKL's fp32 GEMM gives a row different roundings for different row counts (GEMV at 1 row,
    # other kernels / thread splits above), so a sequence's logits move by ~1e-6 with the batch around it.
    assert ids(results) == ids(reference)
    for got, want in zip(results, reference, strict=True):
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=logprob_tol, rel=0)


def test_batched_equals_one_at_a_time(ckpt):
    engine = make_engine(ckpt, enable_prefix_caching=False)
    batched = engine.generate(PROMPTS, mixed_params())
    alone = [engine.generate([p], params)[0] for p, params in zip(PROMPTS, mixed_params(), strict=True)]
    assert_same(batched, alone)


def test_preemption_recomputes_and_keeps_tokens(ckpt, engine):
    params = [dataclasses.replace(p, ignore_eos=True) for p in mixed_params()]  # all 12 tokens long
    reference = engine.generate(PROMPTS, params)
    # 24 blocks x 4 = 96 slots for 72 prompt + 60 new tokens: sequences must be preempted and recomputed.
    small = make_engine(ckpt, num_kv_blocks=24)
    results = small.generate(PROMPTS, params)
    assert small.num_preemptions > 0
    assert_same(results, reference)
    assert small.scheduler.block_manager.num_used_blocks == 0


def test_chunked_prefill_gives_identical_results(ckpt, engine):
    reference = engine.generate(PROMPTS[-1:], greedy())
    chunked = make_engine(ckpt, max_num_batched_tokens=8)
    chunked.add_request("long", PROMPTS[-1], greedy())
    assert chunked.step() == []  # 8 of 30 prompt tokens computed: nothing sampled yet
    assert chunked.scheduler.running[0].num_computed_tokens == 8
    outputs = []
    while chunked.has_unfinished_requests():
        outputs += chunked.step()
    assert [t for o in outputs for t in o.token_ids] == reference[0]["output_ids"]
    assert [lp for o in outputs for lp in o.logprobs] == pytest.approx(reference[0]["logprobs"], abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_sequence_forward(engine, hf_model, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=50, seed=5, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    greedy_ids = ids(engine.generate(PROMPTS, greedy(ignore_eos=True)))
    assert ids(results) != greedy_ids  # really sampled
    for prompt, result in zip(PROMPTS, results, strict=True):
        full = torch.tensor([prompt + result["output_ids"]])
        with torch.no_grad():
            logits = hf_model(full).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits / temperature, dim=-1)
        expected = expected.gather(1, torch.tensor(result["output_ids"]).unsqueeze(1)).squeeze(1)
        assert torch.tensor(result["logprobs"]) == pytest.approx(expected, abs=1e-5, rel=0)


def test_seeded_sampling_is_reproducible_alone_and_batched(engine):
    prompt = PROMPTS[2]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234)
    first = engine.generate([prompt], params)[0]["output_ids"]
    assert engine.generate([prompt], params)[0]["output_ids"] == first
    other_seed = SamplingParams(max_new_tokens=12, temperature=1.0, seed=4321)
    assert engine.generate([prompt], other_seed)[0]["output_ids"] != first
    batch = [PROMPTS[0], prompt, PROMPTS[4]]
    batched = engine.generate(batch, [other_seed, params, SamplingParams(max_new_tokens=5, temperature=0.5)])
    assert batched[1]["output_ids"] == first


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_prompt_blocks(ckpt, prefix_caching):
    engine = make_engine(ckpt, enable_prefix_caching=prefix_caching)
    prompt = PROMPTS[3][:18]  # blocks of 4: four full blocks shareable, the 5th (2 tokens) per sample
    engine.add_request("group", prompt, SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=9))
    first = engine.step()
    assert [o.index for o in first] == [0]  # samples 1..3 wait for sample 0's prompt
    second = engine.step()
    assert sorted(o.index for o in second) == [0, 1, 2, 3]
    leader = engine.scheduler.running[0]
    manager = engine.scheduler.block_manager
    assert [manager.ref_count(b) for b in leader.block_table[:4]] == [4, 4, 4, 4]
    assert manager.num_used_blocks == 4 + 4  # 4 shared + one partial block each; 20 without sharing
    assert [o.cached_tokens for o in second if o.index > 0] == [16, 16, 16]
    outputs = first + second
    while engine.has_unfinished_requests():
        outputs += engine.step()
    samples = [[t for o in outputs if o.index == i for t in o.token_ids] for i in range(4)]
    assert len({tuple(s) for s in samples}) == 4 and all(len(s) == 8 for s in samples)
    assert manager.num_used_blocks == 0


def test_prefix_cache_hit_and_no_hit_after_weight_update(ckpt):
    engine = make_engine(ckpt)
    prompt = PROMPTS[4]  # 30 tokens: 7 full blocks before the block of the last token
    first = engine.generate([prompt], greedy())[0]
    again = engine.generate([prompt], greedy())[0]
    assert (first["cached_tokens"], again["cached_tokens"]) == (0, 28)
    assert again["output_ids"] == first["output_ids"]
    assert again["logprobs"] == pytest.approx(first["logprobs"], abs=1e-5)
    same_weights = list(iter_safetensors(ckpt))
    assert engine.update_weights_from_tensors(same_weights) == "1"
    after = engine.generate([prompt], greedy())[0]
    assert after["cached_tokens"] == 0 and after["weight_version"] == "1"
    assert after["output_ids"] == first["output_ids"]


def first_new_token_index(tokens, start=2):
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_eos_and_ignore_eos(ckpt, engine, tmp_path):
    reference = engine.generate([PROMPTS[1]], greedy(max_new_tokens=16, ignore_eos=True))[0]["output_ids"]
    i = first_new_token_index(reference)
    stop = engine.generate([PROMPTS[1]], greedy(max_new_tokens=16, stop_token_ids=[reference[i]]))[0]
    assert stop["output_ids"] == reference[: i + 1]
    assert stop["finish_reason"] == {"type": "stop", "matched": reference[i]}
    ignored = engine.generate(
        [PROMPTS[1]], greedy(max_new_tokens=16, stop_token_ids=[reference[i]], ignore_eos=True)
    )
    assert ignored[0]["output_ids"] == reference  # SGLang: ignore_eos also ignores stop_token_ids
    assert ignored[0]["finish_reason"] == {"type": "length", "length": 16}
    # A checkpoint whose generation_config lists that token as EOS stops on it unless ignore_eos.
    eos_dir = tmp_path / "eos"
    shutil.copytree(ckpt, eos_dir)
    config = json.loads((eos_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [reference[i]]
    (eos_dir / "generation_config.json").write_text(json.dumps(config))
    eos_engine = make_engine(eos_dir)
    assert eos_engine.generate([PROMPTS[1]], greedy(max_new_tokens=16))[0]["output_ids"] == reference[: i + 1]
    assert (
        eos_engine.generate([PROMPTS[1]], greedy(max_new_tokens=16, ignore_eos=True))[0]["output_ids"]
        == reference
    )


def test_stop_strings(engine):
    reference = engine.generate([PROMPTS[2]], greedy(max_new_tokens=16, ignore_eos=True))[0]["output_ids"]
    decode = engine.tokenizer.decode
    for i in range(2, len(reference)):
        before, text = decode(reference[:i]), decode(reference[: i + 1])
        added = text[len(before) :]
        # (Early tokens may be lone UTF-8 bytes shown as U+FFFD; the detokenizer must wait them out.)
        if text.startswith(before) and added.strip() and "\ufffd" not in added and added not in before:
            break
    else:
        pytest.fail("no usable stop string in the reference output")
    result = engine.generate([PROMPTS[2]], greedy(max_new_tokens=16, ignore_eos=True, stop=[added]))[0]
    assert result["output_ids"] == reference[: i + 1]
    assert result["finish_reason"] == {"type": "stop", "matched": added}


def test_max_new_tokens_and_zero(engine):
    result = engine.generate([PROMPTS[0]], greedy(max_new_tokens=5, ignore_eos=True))[0]
    assert len(result["output_ids"]) == 5 and result["finish_reason"] == {"type": "length", "length": 5}
    zero = engine.generate([PROMPTS[0]], greedy(max_new_tokens=0))[0]
    assert zero["output_ids"] == [] and zero["finish_reason"] == {"type": "length", "length": 0}


def test_abort_running_and_waiting_requests(ckpt):
    engine = make_engine(ckpt, max_running_requests=1)
    engine.add_request("a", PROMPTS[0], greedy(max_new_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], greedy(max_new_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("b")  # still waiting behind "a"
    engine.abort_request("a")  # running
    engine.abort_request("unknown")
    outputs = engine.step()
    assert {(o.request_id, o.finished, tuple(o.token_ids)) for o in outputs} == {
        ("a", True, ()),
        ("b", True, ()),
    }
    assert all(o.finish_reason == {"type": "abort"} for o in outputs)
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_used_blocks == 0


def test_weight_updates_change_outputs_and_bump_version(ckpt, other_ckpt):
    engine = make_engine(ckpt)
    original = ids(engine.generate(PROMPTS, greedy()))
    other = ids(make_engine(other_ckpt).generate(PROMPTS, greedy()))
    assert other != original
    assert engine.update_weights_from_tensors(iter_safetensors(other_ckpt)) == "1"
    assert ids(engine.generate(PROMPTS, greedy())) == other
    assert engine.update_weights_from_disk(str(ckpt)) == "2"
    results = engine.generate(PROMPTS, greedy())
    assert ids(results) == original and {r["weight_version"] for r in results} == {"2"}
    assert engine.update_weights_from_disk(str(other_ckpt), weight_version="step-7") == "step-7"
    assert ids(engine.generate(PROMPTS, greedy())) == other
    with pytest.raises(ValueError, match="no model.safetensors"):
        engine.update_weights_from_disk(str(ckpt / "missing"))
    wider = build_tiny_model(
        ckpt.parent / "wider", vocab_size=VOCAB, hidden_size=96, num_heads=4, num_kv_heads=2
    )
    with pytest.raises(ValueError, match="hidden_size=96, but the served model has hidden_size=64"):
        engine.update_weights_from_disk(str(wider))
    assert engine.weight_version == "step-7"


def test_weight_update_retracts_running_sequences(ckpt, engine):
    reference = engine.generate([PROMPTS[3]], greedy(max_new_tokens=10, ignore_eos=True))[0]["output_ids"]
    running = make_engine(ckpt)
    running.add_request("r", PROMPTS[3], greedy(max_new_tokens=10, ignore_eos=True))
    outputs = running.step() + running.step()
    running.update_weights_from_tensors(iter_safetensors(ckpt))  # same weights, new version
    while running.has_unfinished_requests():
        outputs += running.step()
    assert [t for o in outputs for t in o.token_ids] == reference
    assert [o.weight_version for o in outputs] == ["0", "0"] + ["1"] * 8


def test_release_and_resume_memory(ckpt, engine):
    reference = ids(engine.generate(PROMPTS[:2], greedy()))
    fresh = make_engine(ckpt)
    fresh.release_memory_occupation()
    assert not fresh.kv_cache.is_allocated
    fresh.add_request("x", PROMPTS[0], greedy())
    with pytest.raises(RuntimeError, match="released"):
        fresh.step()
    fresh.abort_request("x")
    fresh.step()
    fresh.resume_memory_occupation(["kv_cache", "weights"])
    assert ids(fresh.generate(PROMPTS[:2], greedy())) == reference
    with pytest.raises(ValueError, match="memory tags"):
        fresh.release_memory_occupation(["cuda_graph_typo"])


def test_bad_requests_raise_naming_the_problem(ckpt):
    engine = make_engine(ckpt, num_kv_blocks=8, context_length=40)
    with pytest.raises(ValueError, match="prompt has 40 tokens; the model's context is 40"):
        engine.add_request("long", list(range(3, 43)), greedy())
    with pytest.raises(
        ValueError, match=r"prompt_token_ids\[1\] = 512 is outside the vocabulary \(size 512\)"
    ):
        engine.add_request("vocab", [1, 512], greedy())
    with pytest.raises(ValueError, match="max_new_tokens=30 with a 5-token prompt needs 35 KV-cache slots"):
        engine.add_request("big", [3] * 5, greedy(max_new_tokens=30))
    with pytest.raises(ValueError, match="sampling_params.top_p"):
        engine.add_request("p", [3], SamplingParams(top_p=2.0))
    engine.add_request("dup", [3, 4], greedy())
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", [3, 4], greedy())


def test_context_length_beyond_the_model_is_refused(ckpt):
    with pytest.raises(ValueError, match="context_length=4096 exceeds max_position_embeddings=2048"):
        make_engine(ckpt, context_length=4096)


def test_incremental_detokenizer_handles_split_characters(engine):
    text = "Tom has 3 apples. Größe → ✓ done, then more"
    token_ids = engine.tokenizer.encode(text)
    split = [t for t in token_ids if "\ufffd" in engine.tokenizer.decode([t])]
    assert split, "the text should contain characters spread over several byte tokens"
    detokenizer = IncrementalDetokenizer(
        engine.tokenizer, [5, 6], skip_special_tokens=True, stop=["✓ d", "zzz"]
    )
    matched_at = [i for i, t in enumerate(token_ids) if detokenizer.append(t) is not None]
    assert detokenizer.text == engine.tokenizer.decode(token_ids)
    first = next(i for i in range(len(token_ids)) if "✓ d" in engine.tokenizer.decode(token_ids[: i + 1]))
    assert matched_at == [first]  # reported once, on the token that completes the stop string
