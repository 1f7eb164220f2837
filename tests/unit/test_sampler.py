"""Sampler and SamplingParams: greedy, temperature logprobs, top-k / top-p / min-p, seeded reproducibility."""

import math

import pytest
import torch

from clawrl.engine.sampler import filtered_probs, make_generator, sample, sequence_seed
from clawrl.engine.sampling_params import SamplingParams


def gens(*seeds):
    return [make_generator(s, "cpu") for s in seeds]


def test_greedy_takes_argmax_and_reports_temperature_one_logprob():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, logprobs = sample(logits, [SamplingParams(temperature=0.0)], gens(0))
    assert tokens == [1]
    expected = 3.0 - math.log(math.exp(1) + math.exp(3) + math.exp(2))
    assert logprobs[0] == pytest.approx(expected, abs=1e-6)


def test_logprob_is_temperature_scaled_and_unfiltered():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])
    temperature = 0.5  # p ~ exp(logits / T) = [1, 4, 25] / 30
    params = SamplingParams(temperature=temperature, top_k=1)  # top_k=1 forces token 2
    tokens, logprobs = sample(logits, [params], gens(0))
    assert tokens == [2]
    assert logprobs[0] == pytest.approx(math.log(25 / 30), abs=1e-6)  # not log(1.0) of the filtered dist


def test_filters_follow_the_unfiltered_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    keep = lambda **kw: (filtered_probs(probs, [SamplingParams(**kw)]) > 0).tolist()[0]  # noqa: E731
    assert keep() == [True, True, True]
    assert keep(top_k=2) == [True, True, False]
    assert keep(top_p=0.6) == [True, True, False]  # mass before 0.3 is 0.5 <= 0.6; before 0.2 it is 0.8
    assert keep(top_p=0.5) == [True, True, False]
    assert keep(top_p=0.4) == [True, False, False]  # the most likely token always survives
    assert keep(min_p=0.5) == [True, True, False]  # threshold 0.25
    assert keep(min_p=0.3, top_k=1) == [True, False, False]


def test_sampling_frequencies_match_probabilities():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    generator = gens(123)
    counts = [0, 0, 0]
    for _ in range(3000):
        tokens, _ = sample(logits, [SamplingParams(temperature=1.0)], generator)
        counts[tokens[0]] += 1
    assert [c / 3000 for c in counts] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)


def test_filtered_tokens_are_never_sampled():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    generator = gens(7)
    seen = {sample(logits, [SamplingParams(top_p=0.5)], generator)[0][0] for _ in range(300)}
    assert seen == {0, 1}


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
    ]
    generator_alone, generator_batched = gens(42), gens(42)
    alone = [sample(logits[:1], params[:1], generator_alone)[0][0] for _ in range(20)]
    others = gens(1, 2)
    batched = [sample(logits, params, [generator_batched[0], *others])[0][0] for _ in range(20)]
    assert alone == batched
    different = gens(43)
    assert [sample(logits[:1], params[:1], different)[0][0] for _ in range(20)] != alone


def test_sequence_seed():
    assert sequence_seed(5, 0) == 5
    assert len({sequence_seed(5, i) for i in range(8)}) == 8
    assert sequence_seed(1, 1) != sequence_seed(2, 0)
    assert 0 <= sequence_seed(-3, 0) < 2**63


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.0),
        ("n", 0),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "yes"),
    ],
)
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"sampling_params.{field} must"):
        SamplingParams(**{field: value}).validate()


def test_validate_accepts_defaults_and_a_single_stop_string():
    SamplingParams().validate()
    params = SamplingParams(stop="\n", top_k=0, temperature=0)
    params.validate()
    assert params.stop == ["\n"]
