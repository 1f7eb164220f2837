"""Engine side of `clawrl debug align`: the real engine's log-probs and hidden states on recorded tokens.

    engine = build_align_engine("ckpt", device="cpu", dtype="float32")
    samples = generate_samples(engine, [[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=0)
    forced = TeacherForcedEngine(engine, temperature=1.0)
    trace = forced.trace(samples[0])          # SideTrace: [R] log-probs, [K, tokens - 1, H] hidden states

Teacher forcing runs the engine's own step loop (scheduler, block manager, paged KV cache, model runner,
sampler): the prompt is prefilled, then at every step the runner samples as usual and the recorded response
token replaces the sampled one before the engine appends it, so the next step decodes exactly the recorded
sequence. The log-prob reported for a position is computed from the step's own logits with the sampler's
rule (ARCHITECTURE decision 7): log-softmax of logits / T, in fp32, at the recorded token (T = 1 when
greedy). Where the runner's sample equals the recorded token, its own log-prob is compared with that one:
the `sampler_check` numbers say the forced path reports what the engine reports when it samples.

One sequence runs at a time (prefix caching and the overlap schedule off), so every row of a step belongs to
it. On CUDA the engine runs without CUDA graphs and without the fused decoder kernels, because a graph
replay or the fused forward does not go through the modules the hidden-state hooks sit on; attention and
the sampler are still the GPU runner's.

Shapes: R = response tokens, K = captured modules (align_capture.layer_names), H = hidden size.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from clawrl.data.sample import Sample
from clawrl.debug.align_capture import LayerCapture
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.core.scheduler import ScheduledBatch


@dataclass(kw_only=True)
class SideTrace:
    """One side's numbers for one sample (engine or trainer)."""

    log_probs_R: torch.Tensor
    """fp32 [R] on CPU: log-prob of each response token under softmax(logits / T)."""
    hidden_KPH: torch.Tensor
    """fp32 [K, P, H] on CPU: each captured module's output at positions 0 .. P - 1."""


@dataclass(kw_only=True)
class SamplerCheck:
    """How the forced log-probs compare with the runner's own where it sampled the recorded token."""

    num_steps: int = 0
    """Steps whose sampled token equalled the recorded one."""
    max_abs_diff: float = 0.0
    """Largest |forced log-prob - runner's log-prob| over those steps."""


def build_align_engine(model_path: str, *, device: str, dtype: str) -> Engine:
    """A real Engine configured so that every step runs through hookable modules, one sequence at a time."""
    config = EngineConfig(
        model_path=model_path, device=device, dtype=dtype, enable_prefix_caching=False,
        enable_overlap_schedule=False, enable_cuda_graph=False, fused_kernels=False,
    )  # fmt: skip
    return Engine(config)


def generate_samples(
    engine: Engine, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int
) -> list[Sample]:
    """Generate one response per prompt with the engine (prompt i seeded `seed + i`); Samples with the
    engine's log-probs as rollout_log_probs, like a rollout records them."""
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        for i in range(len(prompts))
    ]
    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, engine.generate(prompts, params), strict=True)):
        ids = list(out["output_ids"])
        text = engine.tokenizer.decode(ids) if engine.tokenizer is not None else ""
        sample = Sample(index=i, group_index=i, tokens=list(prompt))
        sample.append_response(ids, [float(v) for v in out["logprobs"]], text)
        sample.apply_finish(out.get("finish_reason"), out.get("weight_version"))
        samples.append(sample)
    return samples


class TeacherForcedEngine:
    """Drives a real Engine over recorded responses; stands in for its model runner (same interface) and
    delegates every forward to the runner it replaces."""

    def __init__(self, engine: Engine, *, temperature: float) -> None:
        self.engine = engine
        self.inner = engine.runner
        self.temperature = temperature
        self.sampler_check = SamplerCheck()
        engine.set_overlap_schedule(False)  # the next step must read the forced token, not the sampled one
        engine.runner = self
        self.capture = LayerCapture(engine.model)
        self._logits_hook = engine.model.lm_head.register_forward_hook(self._record_logits)
        self._logits: torch.Tensor | None = None
        self._forced: list[int] = []
        self._log_probs: list[float] = []
        self._hidden: torch.Tensor | None = None
        self._computed: torch.Tensor | None = None

    def trace(self, sample: Sample, *, seed: int | None = None) -> SideTrace:
        """Prefill the sample's prompt and decode its recorded response token by token. With the seed the
        response was sampled with, the sampler draws the recorded tokens again wherever the logits agree
        (the `sampler_check` then covers every step); without it, only greedy runs redraw them."""
        num_tokens, num_response = len(sample.tokens), sample.response_length
        prompt = list(sample.tokens[: num_tokens - num_response])
        self._forced = list(sample.tokens[num_tokens - num_response :])
        self._log_probs = []
        num_modules, hidden_size = len(self.capture.names), self.engine.model_args.hidden_size
        self._hidden = torch.zeros(num_modules, num_tokens - 1, hidden_size)
        # Coverage is tracked apart from the values: a broken model may well produce NaN hidden states.
        self._computed = torch.zeros(num_tokens - 1, dtype=torch.bool)
        params = SamplingParams(
            max_new_tokens=num_response, temperature=self.temperature, ignore_eos=True, seed=seed
        )
        self.engine.add_request(f"align-{uuid.uuid4().hex[:8]}", prompt, params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        assert len(self._log_probs) == num_response, (len(self._log_probs), num_response)
        assert bool(self._computed.all()), "a position was never computed by the engine"
        return SideTrace(log_probs_R=torch.tensor(self._log_probs), hidden_KPH=self._hidden)

    def close(self) -> None:
        """Remove the hooks and give the engine its runner back."""
        self.capture.close()
        self._logits_hook.remove()
        self.engine.runner = self.inner

    # -- the model-runner interface the Engine calls ----------------------------------------------------

    def run(self, batch: ScheduledBatch):
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch):
        assert len(batch.seqs) == 1, "teacher forcing runs one sequence at a time"
        start = batch.seqs[0].num_computed_tokens
        stop = start + batch.num_new_tokens[0]
        self.capture.clear()
        self._logits = None
        handle = self.inner.launch(batch)
        outputs = self.capture.outputs
        self._hidden[:, start:stop] = outputs[:, : stop - start]
        self._computed[start:stop] = True
        return handle

    def collect(self, handle):
        seqs, tokens, log_probs = self.inner.collect(handle)
        if not seqs:
            return seqs, tokens, log_probs
        assert self._logits is not None and len(seqs) == 1
        token = self._forced[len(seqs[0].output_token_ids)]
        forced = self._forced_log_prob(self._logits[0], token)
        if tokens[0] == token:
            check = self.sampler_check
            check.num_steps += 1
            check.max_abs_diff = max(check.max_abs_diff, abs(forced - float(log_probs[0])))
        self._log_probs.append(forced)
        return seqs, [token], [forced]

    def capture_cuda_graphs(self) -> None:
        """Nothing to capture: the forced engine runs eagerly."""

    def invalidate_cuda_graphs(self) -> None:
        self.inner.invalidate_cuda_graphs()

    # -- internals --------------------------------------------------------------------------------------

    def _record_logits(self, _module, _inputs, output) -> None:
        self._logits = output.detach()

    def _forced_log_prob(self, logits_V: torch.Tensor, token: int) -> float:
        # The sampler's rule: fp32 logits / T (T = 1 when greedy), log-softmax before any top-k/p filtering.
        # The divisor is an fp32 tensor, as in the sampler, so T rounds the same way on both paths.
        scale = torch.tensor(self.temperature if self.temperature > 0 else 1.0, dtype=torch.float32)
        return float(torch.log_softmax(logits_V.float() / scale.to(logits_V.device), dim=-1)[token])
