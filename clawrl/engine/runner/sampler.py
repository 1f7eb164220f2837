"""Sampler: next tokens and their logprobs from last-position logits, with counter-based (hash) noise.

Shapes: M = sequences sampling this step, V = vocabulary.

Token choice
- temperature 0: argmax (greedy; ties to the lowest id). Otherwise the temperature-scaled distribution
  p = softmax(logits / T) is filtered like SGLang's sampler, each filter judged on the *unfiltered* p: top_k
  keeps the k most likely tokens, top_p keeps a token while the mass of the tokens ranked before it is
  <= top_p (so at least one survives), min_p keeps tokens with p >= min_p * max(p). A filter whose value turns
  it off is not applied, so a row never depends on which other rows are in the batch.
- The sample is a Gumbel-max draw, argmax_i(logits_i / T + g_i) over the kept tokens, which is distributed as
  the renormalised filtered p. The noise g_i = -log(-log(u_i)) comes from a counter-based hash, not from a
  generator's stream: u_i = hash(row key, i), row key = hash(sequence seed, number of tokens the sequence
  has generated so far). So a seeded sequence draws the same noise whatever else is in the batch, after a
  preemption, and on any device (CPU and the GPU kernel in triton_ops.py compute the same bits; the tokens
  then agree wherever the logits do). Nothing per sequence is stored but its seed.

  hash = lowbias32 (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16, mod 2^32);
  row key = h(h(h(seed_lo) ^ seed_hi) ^ step); u_i = ((h(key ^ i) >> 8) | 1) / 2^24, in (0, 1) exactly.

Logprob returned for the chosen token: log softmax(logits / T) in fp32, under the temperature-
scaled distribution *before* top-k / top-p / min-p filtering, because that is what the trainer recomputes
from its own logits divided by the rollout temperature. Greedy rows report log softmax(logits) (T = 1).

On CUDA (`fused=True`) greedy and plain-temperature rows are handled by the Triton sampler
(`triton_ops.sample_rows`: one program per vocabulary slice of a row, then a per-row merge; the token does
not depend on the slicing); rows with top-k / top-p / min-p go through the torch code below. The GPU runner
calls `sample_planned` with a `SamplingPlan` built once per batch composition and keys from `step_keys`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from clawrl.engine.core.request import SamplingParams

_SEED_MASK = (1 << 63) - 1
_M32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B


def sequence_seed(request_seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `request_seed` (index 0: the seed itself, if >= 0)."""
    # Large odd multiplier: sibling seeds land far from other small request seeds (seed 1 index 1 != seed 2).
    return (request_seed + index * 0x9E3779B97F4A7C15) & _SEED_MASK


def _mix32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 of a uint32 array, in place (uint32 products wrap mod 2^32, as the hash wants)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_MUL_A)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_MUL_B)
    x ^= x >> np.uint32(16)
    return x


def sampling_keys(seeds: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """Row keys (32-bit values in int64) from each sequence's seed and its count of generated tokens."""
    return step_keys(seed_keys(seeds), steps)


def seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """The part of each row key that depends on the seed only, h(h(seed_lo) ^ seed_hi), uint32. The GPU
    runner keeps it per batch composition and only mixes in the step each step (`step_keys`)."""
    seed = np.array(seeds, dtype=np.uint64)
    key = _mix32_numpy((seed & np.uint64(_M32)).astype(np.uint32))
    key ^= (seed >> np.uint64(32)).astype(np.uint32)
    return _mix32_numpy(key)


def step_keys(seed_keys_R: np.ndarray, steps: Sequence[int] | np.ndarray) -> np.ndarray:
    """Row keys (32-bit values in int64): `seed_keys_R` mixed with each row's count of generated tokens."""
    key = np.asarray(steps).astype(np.uint32)  # the step mod 2^32, like the original & 0xFFFFFFFF
    key ^= seed_keys_R
    return _mix32_numpy(key).astype(np.int64)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 x < 2^32, without int64 overflow (16-bit halves of the constant)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def gumbel_noise(keys_R: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [R, V] fp32 of rows with hash keys `keys_R` (int64) — the kernel's exact bits."""
    token_ids = torch.arange(vocab, dtype=torch.int64, device=keys_R.device)
    bits = _mix32_torch(keys_R.unsqueeze(1) ^ token_ids.unsqueeze(0))
    uniform = ((bits >> 8) | 1).to(torch.float32) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(uniform))


def sample(
    logits_MV: torch.Tensor,
    params: list[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
    *,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row (module docstring): (token ids int64 [M], logprobs fp32 [M]) on logits' device.

    `seeds` are the sequences' seeds, `steps` how many tokens each has generated so far. `fused` runs the
    greedy and plain-temperature rows through the Triton kernel (CUDA, or the Triton interpreter in tests).
    """
    num_rows, vocab = logits_MV.shape
    assert len(params) == num_rows == len(seeds) == len(steps)
    device = logits_MV.device
    keys_M = host_to_device(torch.from_numpy(sampling_keys(seeds, steps)), device)
    if not fused:
        temperatures_M = host_to_device(
            torch.tensor([p.temperature for p in params], dtype=torch.float32), device
        )
        return _sample_torch(logits_MV, params, temperatures_M, keys_M)
    return sample_planned(logits_MV, plan_sampling(params, vocab, device), keys_M)


@dataclass(kw_only=True, eq=False)
class SamplingPlan:
    """How each row of a batch is sampled on the fused path. It depends on the rows' parameters only, so the
    GPU runner builds it once per batch composition and reuses it while the same sequences decode."""

    temperatures_M: torch.Tensor
    """fp32 [M] temperatures, on the logits' device."""
    greedy_rows: torch.Tensor | None
    """Rows (int64, device) sampled greedily by the Triton kernel; None when there are none."""
    plain_rows: torch.Tensor | None
    """Rows with plain temperature sampling (Triton kernel); None when there are none."""
    filtered_rows: torch.Tensor | None
    """Rows with top-k / top-p / min-p (torch path); None when there are none."""
    filtered_params: list[SamplingParams]
    """The parameters of `filtered_rows`, in order (kept on the host: reading the rows back would sync)."""
    host_rules: bool = False
    """Some row has logit rules or reports top logprobs (`shape_logits`, base.record_top_logprobs)."""


def plan_sampling(params: list[SamplingParams], vocab: int, device: torch.device) -> SamplingPlan:
    """Group the rows by how they are sampled and move their temperatures to `device`."""
    num_rows = len(params)
    groups: dict[str, list[int]] = {"greedy": [], "plain": [], "filtered": []}
    host_rules = False
    for i, p in enumerate(params):  # inlined _row_kind: this loop runs over the whole batch
        host_rules = host_rules or p.top_logprobs_num > 0 or p.shapes_logits
        if p.temperature == 0.0:
            groups["greedy"].append(i)
        elif 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0:
            groups["filtered"].append(i)
        else:
            groups["plain"].append(i)
    rows = {kind: _index(found, num_rows, device) if found else None for kind, found in groups.items()}
    return SamplingPlan(
        greedy_rows=rows["greedy"], plain_rows=rows["plain"], filtered_rows=rows["filtered"],
        filtered_params=[params[i] for i in groups["filtered"]], host_rules=host_rules,
        temperatures_M=host_to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), device),
    )  # fmt: skip


def sample_planned(
    logits_MV: torch.Tensor,
    plan: SamplingPlan,
    keys_M: torch.Tensor,
    *,
    tokens_M: torch.Tensor | None = None,
    logprobs_M: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused path of `sample` with the rows already grouped: (tokens int64 [M], logprobs fp32 [M]),
    written into `tokens_M` / `logprobs_M` when given (contiguous device buffers of M entries)."""
    from clawrl.engine.runner import triton_ops  # imports Triton: only on the fused path

    num_rows = logits_MV.shape[0]
    device = logits_MV.device
    if tokens_M is None:
        tokens_M = torch.empty(num_rows, dtype=torch.int64, device=device)
    if logprobs_M is None:
        logprobs_M = torch.empty(num_rows, dtype=torch.float32, device=device)
    temperatures_M = plan.temperatures_M
    for rows, is_sampled in ((plan.greedy_rows, False), (plan.plain_rows, True)):
        if rows is not None:
            triton_ops.sample_rows(
                logits_MV, rows, temperatures_M, keys_M, tokens_M, logprobs_M, sample=is_sampled
            )
    if plan.filtered_rows is not None:
        rows = plan.filtered_rows
        tokens, logprobs = _sample_torch(
            logits_MV[rows], plan.filtered_params, temperatures_M[rows], keys_M[rows]
        )
        tokens_M[rows], logprobs_M[rows] = tokens, logprobs
    return tokens_M, logprobs_M


def _row_kind(p: SamplingParams, vocab: int) -> str:
    if p.temperature == 0.0:
        return "greedy"
    if 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0:
        return "filtered"
    return "plain"


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without waiting for the GPU. A copy from pageable memory waits for all the work
    queued on the stream (CUDA stages it synchronously), which would stall the overlap schedule; from pinned
    memory it is only queued. pin_memory() takes the buffer from PyTorch's caching host allocator, which keeps
    it until the copy has run. The GPU runner uploads its host-built inputs through this too."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor:
    # All rows: arange is built on the device without a host-to-device copy of a Python list.
    if len(rows) == num_rows:
        return torch.arange(num_rows, device=device)
    return host_to_device(torch.tensor(rows, dtype=torch.int64), device)


def _sample_torch(
    logits_MV: torch.Tensor, params: list[SamplingParams], temperatures_M: torch.Tensor, keys_M: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference implementation (CPU path, and filtered rows on CUDA)."""
    logits_MV = logits_MV.float()
    greedy_M = temperatures_M == 0.0
    scaled_MV = logits_MV / torch.where(greedy_M, 1.0, temperatures_M).unsqueeze(1)
    logprobs_MV = torch.log_softmax(scaled_MV, dim=-1)
    tokens_M = logits_MV.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if sampled_rows:
        rows = host_to_device(torch.tensor(sampled_rows), logits_MV.device)
        scores_RV = scaled_MV[rows] + gumbel_noise(keys_M[rows], logits_MV.shape[1])
        sampled_params = [params[i] for i in sampled_rows]
        if any(_row_kind(p, logits_MV.shape[1]) == "filtered" for p in sampled_params):
            keep_RV = filter_mask(logprobs_MV[rows].exp(), sampled_params)
            scores_RV = scores_RV.masked_fill(~keep_RV, float("-inf"))
        tokens_M[rows] = scores_RV.argmax(dim=-1)
    chosen_M = logprobs_MV.gather(1, tokens_M.unsqueeze(1)).squeeze(1)
    return tokens_M, chosen_M


def filter_mask(probs_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Bool [R, V]: the tokens top_k / top_p / min_p keep (each judged on the unfiltered probs)."""
    vocab = probs_RV.shape[1]
    device = probs_RV.device
    top_k = host_to_device(torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]), device)
    top_p = host_to_device(torch.tensor([p.top_p for p in params], dtype=torch.float32), device)
    min_p = host_to_device(torch.tensor([p.min_p for p in params], dtype=torch.float32), device)
    keep_RV = torch.ones_like(probs_RV, dtype=torch.bool)
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        sorted_RV, order_RV = probs_RV.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        keep_sorted_RV = ranks < top_k.unsqueeze(1)
        mass_before_RV = sorted_RV.cumsum(dim=-1) - sorted_RV
        # Rows with top_p == 1 skip the test: rounding can push mass_before above 1.0 in the tail.
        keep_sorted_RV &= (mass_before_RV <= top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
        keep_RV = torch.zeros_like(keep_RV).scatter(1, order_RV, keep_sorted_RV)
    if any(p.min_p > 0.0 for p in params):
        threshold_R = probs_RV.max(dim=-1).values * min_p
        keep_RV &= probs_RV >= threshold_R.unsqueeze(1)
    return keep_RV


def filtered_probs(probs_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens that top_k / top_p / min_p remove (each judged on the unfiltered probs)."""
    return probs_RV * filter_mask(probs_RV, params)


# ---------------------------------------------------------------------------------------------------
# logit rules (penalties, logit_bias, min_new_tokens) and reported alternatives


def shape_logits(logits_MV: torch.Tensor, seqs: Sequence[Any]) -> torch.Tensor:
    """The logits the rows sample from once their requests' logit rules are applied; `logits_MV` itself
    when no row has any (default requests pay one flag test per row). Row i belongs to `seqs[i]`. In order:

    1. repetition_penalty r (HF / SGLang): each token in prompt + output, logit / r if > 0 else logit * r;
    2. frequency / presence penalty (OpenAI): logit - frequency * count - presence * (count > 0), count =
       times the token was generated so far;
    3. logit_bias: added;
    4. min_new_tokens: while fewer tokens were generated, EOS and stop tokens get -inf (none with ignore_eos).
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.shapes_logits]
    if not rows:
        return logits_MV
    shaped_MV = logits_MV.clone()
    for i in rows:
        shaped_MV[i] = _shape_row(logits_MV[i].float(), seqs[i]).to(logits_MV.dtype)
    return shaped_MV


def _shape_row(logits_V: torch.Tensor, seq: Any) -> torch.Tensor:
    params, device, vocab = seq.params, logits_V.device, logits_V.shape[0]
    output = [t for t in seq.output_token_ids if 0 <= t < vocab]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(output)), dtype=torch.int64, device=device)
        values = logits_V[seen]
        penalty = params.repetition_penalty
        logits_V[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts_V = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).to(device)
        logits_V -= params.frequency_penalty * counts_V + params.presence_penalty * (counts_V > 0)
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if t < vocab], dtype=torch.int64, device=device)
        bias = torch.tensor([params.logit_bias[t] for t in ids.tolist()], dtype=torch.float32, device=device)
        logits_V[ids] += bias
    if len(seq.output_token_ids) < params.min_new_tokens and seq.stop_token_set:
        logits_V[torch.tensor(sorted(t for t in seq.stop_token_set if t < vocab), device=device)] = -math.inf
    return logits_V


def top_logprobs(logits_RV: torch.Tensor, temperatures: Sequence[float], k: int) -> list[list[list]]:
    """Per row, its k most likely tokens as [logprob, token id] pairs (most likely first), under the same
    distribution as the sampled token's logprob: log softmax(logits / T), T = 1 for greedy rows."""
    scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32)
    logprobs_RV = torch.log_softmax(logits_RV.float() / scale.to(logits_RV.device).unsqueeze(1), dim=-1)
    values, ids = logprobs_RV.topk(min(k, logprobs_RV.shape[1]), dim=-1)
    return [
        [[v, t] for v, t in zip(vs, ts, strict=True)]
        for vs, ts in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def prompt_logprobs(logits_RV: torch.Tensor, targets: list[int], k: int) -> tuple[list[float], list | None]:
    """Logprob of each row's target token under the model's own distribution (log softmax of the logits, no
    temperature: what a teacher's score is), and the rows' top-k pairs when k > 0."""
    logprobs_RV = torch.log_softmax(logits_RV.float(), dim=-1)
    target_R = torch.tensor(targets, dtype=torch.int64, device=logits_RV.device)
    chosen = logprobs_RV.gather(1, target_R.unsqueeze(1)).squeeze(1).tolist()
    return chosen, (top_logprobs(logits_RV, [1.0] * len(targets), k) if k > 0 else None)
