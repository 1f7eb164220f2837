"""Sampler: next tokens and their logprobs from last-position logits, one torch.Generator per sequence.

Shapes: M = sequences sampling this step, V = vocabulary.

Token choice
- temperature 0: argmax (greedy). Otherwise the temperature-scaled distribution p = softmax(logits / T) is
  filtered like SGLang's sampler, each filter judged on the *unfiltered* p: top_k keeps the k most likely
  tokens, top_p keeps a token while the mass of the tokens ranked before it is <= top_p (so at least one
  survives), min_p keeps tokens with p >= min_p * max(p). A filter whose value turns it off is not applied,
  so a row never depends on which other rows are in the batch.
- The sample is an exponential race, argmax_i(p_i / E_i) with E_i ~ Exp(1) drawn from the sequence's own
  generator: it is distributed as the renormalised filtered p, and the random numbers a sequence consumes
  depend only on its own seed and step count, not on the batch (seeded sampling is batch-invariant).

Logprob returned for the chosen token (decision 7): log softmax(logits / T) in fp32, under the temperature-
scaled distribution *before* top-k / top-p / min-p filtering, because that is what the trainer recomputes
from its own logits divided by the rollout temperature. Greedy rows report log softmax(logits) (T = 1).
"""

from __future__ import annotations

import torch

from clawrl.engine.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1  # torch generators take seeds up to 2**64 - 1; stay clear of the sign bit


def sequence_seed(request_seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `request_seed` (index 0: the seed itself, if >= 0)."""
    # Large odd multiplier: sibling seeds land far from other small request seeds (seed 1 index 1 != seed 2).
    return (request_seed + index * 0x9E3779B97F4A7C15) & _SEED_MASK


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A fresh generator on `device`, seeded."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits_MV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Pick one token per row and return (token ids, logprobs) as Python lists (module docstring)."""
    logits_MV = logits_MV.float()
    num_rows = logits_MV.shape[0]
    assert len(params) == num_rows == len(generators)
    device = logits_MV.device
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    greedy_M = temperatures == 0.0
    scaled_MV = logits_MV / torch.where(greedy_M, 1.0, temperatures).unsqueeze(1)
    logprobs_MV = torch.log_softmax(scaled_MV, dim=-1)
    tokens_M = logits_MV.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=device)
        probs_RV = filtered_probs(logprobs_MV[rows].exp(), [params[i] for i in sampled_rows])
        noise_RV = torch.stack([_exponential(probs_RV.shape[1], generators[i], device) for i in sampled_rows])
        tokens_M[rows] = (probs_RV / noise_RV).argmax(dim=-1)
    chosen_M = logprobs_MV.gather(1, tokens_M.unsqueeze(1)).squeeze(1)
    return tokens_M.tolist(), chosen_M.tolist()


def filtered_probs(probs_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens that top_k / top_p / min_p remove (each judged on the unfiltered probs)."""
    vocab = probs_RV.shape[1]
    device = probs_RV.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    keep_RV = torch.ones_like(probs_RV, dtype=torch.bool)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_RV, order_RV = probs_RV.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        keep_sorted_RV = ranks < top_k.unsqueeze(1)
        mass_before_RV = sorted_RV.cumsum(dim=-1) - sorted_RV
        # Rows with top_p == 1 skip the test: rounding can push mass_before above 1.0 in the tail.
        keep_sorted_RV &= (mass_before_RV <= top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
        keep_RV = torch.zeros_like(keep_RV).scatter(1, order_RV, keep_sorted_RV)
    if bool((min_p > 0.0).any()):
        threshold_R = probs_RV.max(dim=-1).values * min_p
        keep_RV &= probs_RV >= threshold_R.unsqueeze(1)
    return probs_RV * keep_RV


def _exponential(size: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    noise = torch.empty(size, dtype=torch.float32, device=device).exponential_(generator=generator)
    # A draw of exactly 0 would turn a filtered token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)
