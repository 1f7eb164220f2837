"""The sampler's logit rules (penalties, logit_bias, min_new_tokens) and reported top logprobs, against
hand-computed numbers on crafted logits; with no rule the logits are passed through untouched."""

import math

import pytest
import torch

from clawrl.engine.core.request import RequestError, SamplingParams
from clawrl.engine.core.sequence import Sequence
from clawrl.engine.runner.sampler import prompt_logprobs, sample, shape_logits, top_logprobs

LOGITS = [2.0, -1.0, 0.5, 3.0, -0.5]


def _seq(params: SamplingParams, prompt: list[int], output: list[int], stop_tokens=frozenset()) -> Sequence:
    seq = Sequence(
        seq_id=0, request_id="r", prompt_token_ids=prompt, params=params, output_token_ids=list(output)
    )
    seq.stop_token_set = frozenset(stop_tokens)
    return seq


def _shaped(params: SamplingParams, prompt, output, stop_tokens=frozenset()) -> list[float]:
    return shape_logits(torch.tensor([LOGITS]), [_seq(params, prompt, output, stop_tokens)])[0].tolist()


def test_no_rule_passes_the_logits_through_untouched():
    logits = torch.tensor([LOGITS, LOGITS])
    seqs = [_seq(SamplingParams(), [0], [1]), _seq(SamplingParams(temperature=0.0, top_k=2), [3], [])]
    assert shape_logits(logits, seqs) is logits


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Token 0 (prompt, 2.0 > 0) -> 2.0 / 2; token 1 (output, -1.0 <= 0) -> -1.0 * 2; others unchanged.
    assert _shaped(SamplingParams(repetition_penalty=2.0), [0], [1]) == [1.0, -2.0, 0.5, 3.0, -0.5]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    # Output [2, 2, 3]: token 2 -> 0.5 - 0.5*2 - 0.25 = -0.75; token 3 -> 3.0 - 0.5*1 - 0.25 = 2.25.
    # Token 0 is only in the prompt: untouched.
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    assert _shaped(params, [0], [2, 2, 3]) == [2.0, -1.0, -0.75, 2.25, -0.5]


def test_logit_bias_is_added():
    assert _shaped(SamplingParams(logit_bias={4: 10.0, 0: -100.0}), [1], []) == [-98.0, -1.0, 0.5, 3.0, 9.5]


def test_min_new_tokens_masks_stop_tokens_until_reached():
    params = SamplingParams(min_new_tokens=2)
    assert _shaped(params, [1], [0], stop_tokens={3}) == [2.0, -1.0, 0.5, -math.inf, -0.5]
    assert _shaped(params, [1], [0, 0], stop_tokens={3}) == LOGITS  # 2 generated: EOS allowed again


def test_rules_compose_in_order_and_change_the_greedy_token():
    # Greedy picks token 3 (3.0); repetition 2 -> 1.5, then presence 2 -> -0.5: token 0 (2.0) wins.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=2.0)
    seq = _seq(params, [1], [3])
    shaped = shape_logits(torch.tensor([LOGITS]), [seq])
    assert shaped[0].tolist() == [2.0, -2.0, 0.5, -0.5, -0.5]
    tokens, logprobs = sample(shaped, [params], [0], [1])
    assert tokens.tolist() == [0]
    assert logprobs[0].item() == pytest.approx(2.0 - math.log(sum(math.exp(v) for v in shaped[0].tolist())))


def test_top_logprobs_are_the_temperature_scaled_distribution():
    # logits ln 1, ln 2, ln 4 at T = 1: p = 1/7, 2/7, 4/7. At T = 0.5 the logits double: p ∝ 1, 4, 16.
    logits = torch.tensor([[0.0, math.log(2), math.log(4)]] * 2)
    (first, second) = top_logprobs(logits, [1.0, 0.5], 2)
    assert [t for _, t in first] == [2, 1] and [t for _, t in second] == [2, 1]
    assert [lp for lp, _ in first] == pytest.approx([math.log(4 / 7), math.log(2 / 7)], abs=1e-6)
    assert [lp for lp, _ in second] == pytest.approx([math.log(16 / 21), math.log(4 / 21)], abs=1e-6)
    chosen, tops = prompt_logprobs(logits[:1], [0], 1)
    assert chosen == pytest.approx([math.log(1 / 7)], abs=1e-6) and tops[0][0][1] == 2


def test_bad_values_name_the_field():
    with pytest.raises(
        RequestError, match=r"sampling_params.repetition_penalty must be > 0 \(1 = off\), got 0"
    ):
        SamplingParams(repetition_penalty=0).validate()
    with pytest.raises(RequestError, match=r"presence_penalty must be in \[-2, 2\], got 3"):
        SamplingParams(presence_penalty=3).validate()
    with pytest.raises(
        RequestError, match=r"logit_bias must hold biases in \[-100, 100\], got 200 for token 5"
    ):
        SamplingParams(logit_bias={5: 200}).validate()
