"""The seam between the engine core and the model: the `ModelRunner` protocol and the `StepHandle` it returns.

The core (core/engine.py) hands a runner one `ScheduledBatch` per step and gets back, for every sequence
that samples in that step, its next token and that token's logprob. Two runners implement the protocol:

- `CpuModelRunner` (cpu_runner.py): the reference path — plain torch, one attention call per sequence; runs
  on CPU, and on CUDA with `attention_backend="torch"` (the first thing to try when a kernel crashes);
- `GpuModelRunner` (gpu_runner.py): the CUDA path — batched inputs, Triton paged attention, fused kernels,
  CUDA-graph decode — computing the same steps.

`launch` / `collect` split a step so the core can schedule step t + 1 while the device still computes step t
(the overlap schedule); `run` is both at once.

Both runners also report, for requests that ask (core/engine.py then steps without the overlap schedule),
what goes beyond the sampled token: `record_prompt_logprobs` (the prompt's token logprobs, chunk by chunk,
from the hidden states the prefill computes anyway; only rows that score a prompt token go through the LM
head) and `record_top_logprobs` (the most likely alternatives at each sampled position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from clawrl.engine.runner.sampler import prompt_logprobs, sample, shape_logits, top_logprobs

if TYPE_CHECKING:
    from clawrl.engine.core.scheduler import ScheduledBatch
    from clawrl.engine.core.sequence import Sequence


@dataclass(kw_only=True, eq=False)
class StepHandle:
    """A launched step: its sampling sequences and (once collected) their tokens and logprobs."""

    seqs: list[Sequence]
    """Sequences that sample in this step, in row order."""
    tokens: list[int] | None = None
    """Sampled token ids (reference runner: known at launch)."""
    logprobs: list[float] | None = None
    """Their logprobs (reference runner: known at launch)."""
    host_tokens: torch.Tensor | None = None
    """GPU runner: pinned int64 host buffer receiving the sampled token ids."""
    host_logprobs: torch.Tensor | None = None
    """GPU runner: pinned fp32 host buffer receiving their logprobs."""
    event: torch.cuda.Event | None = None
    """GPU runner: recorded after the device-to-host copies into the host buffers."""
    started: torch.cuda.Event | None = None
    """GPU runner: recorded before the step's first kernel (with `event`, the step's span on the device)."""


@dataclass(kw_only=True)
class DeviceTiming:
    """What a runner's collected steps cost on the device and in waiting for it (cumulative)."""

    wait_s: float = 0.0
    """Host seconds blocked until a launched step's results were on the host."""
    gpu_s: float = 0.0
    """Device seconds from each step's first queued work to its last (gaps inside a step included)."""


class ModelRunner(Protocol):
    """Runs scheduled steps of a CausalLM over the paged KV cache and samples the next tokens."""

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Compute the step; returns (sampling sequences, their next tokens, those tokens' logprobs)."""
        ...

    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Start the step. A sequence whose last output token is PENDING_TOKEN gets, on the device, the token
        this runner sampled for it in the previous launch (overlap schedule)."""
        ...

    def collect(self, handle: StepHandle) -> tuple[list[Sequence], list[int], list[float]]:
        """Wait for a launched step; returns what `run` returns."""
        ...

    def capture_cuda_graphs(self) -> None:
        """Compile kernels and capture decode graphs now (a no-op without CUDA graphs)."""
        ...

    def invalidate_cuda_graphs(self) -> None:
        """Drop captured graphs: the KV cache or the weights are about to move (recaptured when needed)."""
        ...


def prompt_logprob_rows(batch: ScheduledBatch) -> tuple[list[int], list[int], list[tuple[Sequence, int]]]:
    """Rows of the step's flat token axis whose logits score a prompt token still to be reported, those
    tokens, and (sequence, how many rows) in order. Row q (a token at position q) predicts position q + 1."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Sequence, int]] = []
    offset = 0
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        recorded = seq.prompt_logprobs
        if recorded is not None:
            start = seq.num_computed_tokens
            first = seq.params.logprob_start_len + len(recorded)  # next prompt position to score
            last = min(start + num_new, seq.num_prompt_tokens - 1)
            # The scheduler never serves the row scoring `first` from the prefix cache (Scheduler._admit).
            assert first > start or first > last, f"prompt logprob of position {first} skipped"
            positions = range(first, last + 1)
            rows += [offset + p - 1 - start for p in positions]
            targets += seq.prompt_token_ids[first : last + 1]
            owners.append((seq, len(positions)))
        offset += num_new
    return rows, targets, owners


def record_prompt_logprobs(model: torch.nn.Module, batch: ScheduledBatch, hidden_ND: torch.Tensor) -> None:
    """Append the prompt logprobs this step's chunks yield to their sequences' `prompt_logprobs`."""
    rows, targets, owners = prompt_logprob_rows(batch)
    if not rows:
        return
    row_index = torch.tensor(rows, dtype=torch.int64, device=hidden_ND.device)
    logits_RV = model.compute_logits(hidden_ND[row_index])
    k = max(seq.params.top_logprobs_num for seq, _ in owners)
    chosen, tops = prompt_logprobs(logits_RV, targets, k)
    at = 0
    for seq, count in owners:
        width = seq.params.top_logprobs_num
        for j in range(at, at + count):
            seq.prompt_logprobs.append((chosen[j], tops[j][:width] if width else None))
        at += count


def record_top_logprobs(seqs: list[Sequence], logits_MV: torch.Tensor) -> None:
    """Set `step_top_logprobs` of the sampling rows whose request asks for top_logprobs_num > 0."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.top_logprobs_num > 0]
    if not rows:
        return
    row_index = torch.tensor(rows, dtype=torch.int64, device=logits_MV.device)
    k = max(seqs[i].params.top_logprobs_num for i in rows)
    tops = top_logprobs(logits_MV[row_index], [seqs[i].params.temperature for i in rows], k)
    for i, top in zip(rows, tops, strict=True):
        seqs[i].step_top_logprobs = top[: seqs[i].params.top_logprobs_num]


def sample_step(logits_MV: torch.Tensor, seqs: list[Sequence]) -> StepHandle:
    """The reference runners' sampling (CPU and transformers paths): the requests' logit rules, their top
    log-probs, then one token per row of `logits_MV` (row i belongs to `seqs[i]`), as a finished StepHandle."""
    logits_MV = shape_logits(logits_MV, seqs)  # penalties, logit_bias, min_new_tokens
    record_top_logprobs(seqs, logits_MV)
    tokens_M, logprobs_M = sample(
        logits_MV, [s.params for s in seqs], [s.sampler_state for s in seqs],
        [len(s.output_token_ids) for s in seqs],
    )  # fmt: skip
    return StepHandle(seqs=seqs, tokens=tokens_M.tolist(), logprobs=logprobs_M.tolist())
