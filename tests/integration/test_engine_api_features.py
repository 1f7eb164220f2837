"""Engine features beyond plain sampling, on the CPU engine core with a tiny fp32 model, each against an
expectation computed by hand from transformers' own forward of the same checkpoint: prompt (input-token)
logprobs and scoring with max_new_tokens=0, top logprobs, repetition / frequency / presence penalties,
min_new_tokens, stop token ids, and n > 1 sharing the prompt's KV blocks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.models.tiny import build_tiny_model

PROMPT = list(range(10, 33))  # 23 tokens: 5 full blocks of 4 and a partial one
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-features")
    # Tied embeddings: plain greedy decoding repeats the last token, so the penalties visibly change it.
    return str(build_tiny_model(root / "m", vocab_size=2048, hidden_size=64, num_layers=2))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir: str, **config) -> Engine:
    # A 5-token budget splits the prompt into chunks, so prompt logprobs are gathered across steps.
    settings = {"block_size": 4, "max_num_batched_tokens": 5, **config}
    return Engine(EngineConfig(model_path=model_dir, device="cpu", dtype="float32", **settings))


@torch.inference_mode()
def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log softmax of transformers' logits at every position [len(ids), V]."""
    return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_equal_a_manual_forward_and_score_with_zero_new_tokens(model_dir, hf_model):
    engine = _engine(model_dir)
    expected = _hf_logprobs(hf_model, PROMPT)
    want = [expected[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))]
    (scored,) = engine.generate(
        [PROMPT], SamplingParams(max_new_tokens=0, logprob_start_len=0, top_logprobs_num=3)
    )
    assert scored["output_ids"] == [] and scored["finish_reason"] == {"type": "length", "length": 0}
    got = scored["prompt_logprobs"]
    assert got[0] == (None, None)  # nothing predicts the first prompt token
    assert [lp for lp, _ in got[1:]] == pytest.approx(want, abs=1e-5)
    for p in (1, 9, 22):
        values, ids = expected[p - 1].topk(3)
        assert [t for _, t in got[p][1]] == ids.tolist()
        assert [lp for lp, _ in got[p][1]] == pytest.approx(values.tolist(), abs=1e-5)
    # From position 13 on, after the prompt's blocks went to the prefix cache: the scheduler takes only the
    # blocks before position 12 (whose hidden state scores 13) from the cache and computes the rest.
    (later,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=2, logprob_start_len=13, **GREEDY))
    assert later["cached_tokens"] == 12
    assert [lp for lp, _ in later["prompt_logprobs"]] == pytest.approx(want[12:], abs=1e-5)
    assert len(later["output_ids"]) == 2


def test_top_logprobs_of_output_tokens(model_dir, hf_model):
    engine = _engine(model_dir)
    (out,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=3, top_logprobs_num=2, **GREEDY))
    full = _hf_logprobs(hf_model, PROMPT + out["output_ids"])
    for i, (token, logprob, top) in enumerate(
        zip(out["output_ids"], out["logprobs"], out["top_logprobs"], strict=True)
    ):
        values, ids = full[len(PROMPT) - 1 + i].topk(2)
        assert top[0] == [pytest.approx(logprob), token]  # greedy: the chosen token is the most likely one
        assert [t for _, t in top] == ids.tolist()
        assert [lp for lp, _ in top] == pytest.approx(values.tolist(), abs=1e-5)


def _manual_greedy(
    hf_model, prompt: list[int], steps: int, *, rep: float, freq: float, pres: float
) -> list[int]:
    """Greedy decoding with the penalties applied by hand to transformers' logits."""
    out: list[int] = []
    for _ in range(steps):
        logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].float().detach()
        for token in set(prompt + out):
            logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
        for token in set(out):
            logits[token] -= freq * out.count(token) + pres
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("rep,freq,pres", [(1.8, 0.0, 0.0), (1.0, 1.5, 0.7), (1.3, 0.4, 0.2)])
def test_penalties_match_a_hand_applied_greedy_decode(model_dir, hf_model, rep, freq, pres):
    engine = _engine(model_dir, max_num_batched_tokens=64)
    params = SamplingParams(max_new_tokens=8, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                            **GREEDY)  # fmt: skip
    (out,) = engine.generate([PROMPT[:6]], params)
    assert out["output_ids"] == _manual_greedy(hf_model, PROMPT[:6], 8, rep=rep, freq=freq, pres=pres)
    (plain,) = engine.generate([PROMPT[:6]], SamplingParams(max_new_tokens=8, **GREEDY))
    assert out["output_ids"] != plain["output_ids"]  # the penalties changed the decode


def test_min_new_tokens_and_stop_token_ids(model_dir):
    engine = _engine(model_dir, max_num_batched_tokens=64)
    eos = min(engine.eos_token_ids)
    push_eos = {"temperature": 0.0, "logit_bias": {eos: 100.0}}
    (plain,) = engine.generate([PROMPT[:6]], SamplingParams(max_new_tokens=10, **push_eos))
    assert plain["output_ids"] == [eos] and plain["finish_reason"] == {"type": "stop", "matched": eos}
    # EOS is masked for the first 3 tokens; the 4th is EOS again (the bias makes it the argmax).
    (held,) = engine.generate([PROMPT[:6]], SamplingParams(max_new_tokens=10, min_new_tokens=3, **push_eos))
    assert len(held["output_ids"]) == 4 and eos not in held["output_ids"][:3] and held["output_ids"][3] == eos
    assert held["finish_reason"] == {"type": "stop", "matched": eos}
    # A stop token id the bias forces ends the sequence on it, also under min_new_tokens once reached.
    stop = 77
    params = SamplingParams(
        max_new_tokens=10, temperature=0.0, logit_bias={stop: 100.0}, stop_token_ids=[stop]
    )
    (stopped,) = engine.generate([PROMPT[:6]], params)
    assert stopped["output_ids"] == [stop] and stopped["finish_reason"] == {"type": "stop", "matched": stop}
    params.min_new_tokens = 2
    (late,) = engine.generate([PROMPT[:6]], params)
    assert late["output_ids"][-1] == stop and len(late["output_ids"]) == 3
    assert late["finish_reason"] == {"type": "stop", "matched": stop}


def test_n_samples_share_the_prompt_blocks(model_dir):
    engine = _engine(model_dir, max_num_batched_tokens=256, enable_prefix_caching=False)
    manager = engine.scheduler.block_manager
    free_before = manager.num_free_blocks
    engine.add_request("r", PROMPT, SamplingParams(n=4, max_new_tokens=4, **GREEDY))
    seqs = list(engine._requests["r"])
    while any(s.num_computed_tokens < len(PROMPT) for s in seqs):
        engine.step()
    # 23 prompt tokens in blocks of 4: 5 full blocks, held once, and one partial block per sample.
    tables = [s.block_table for s in seqs]
    assert all(table[:5] == tables[0][:5] for table in tables)
    assert len({table[5] for table in tables}) == 4
    assert free_before - manager.num_free_blocks == 5 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert manager.num_free_blocks == free_before
