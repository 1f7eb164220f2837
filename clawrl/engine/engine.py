"""Engine: the synchronous engine core (docs/engine.md). One thread calls add/abort/step.

    engine = Engine(EngineConfig(model_path="/tmp/tiny-qwen2"))
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.7, seed=1))

Each `step()` schedules one batch (scheduler.py), runs it (model_runner.py), appends the sampled tokens and
applies the stop rules (stop_checker.py).

Weight updates load through `clawrl.models.loader.load_weights` into the fused model, bump
`weight_version` and flush the prefix cache (whose keys also carry the version). If sequences are still
running, they are retracted first (K/V freed) and recomputed with the new weights when stepped again; the
tokens they produce from then on carry the new version.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from clawrl.engine.block_manager import BlockManager
from clawrl.engine.checks import check_request, check_same_shapes, context_length_of
from clawrl.engine.config import EngineConfig
from clawrl.engine.detokenizer import IncrementalDetokenizer
from clawrl.engine.kv_cache import build_kv_cache
from clawrl.engine.model_runner import make_model_runner
from clawrl.engine.sampler import sequence_seed
from clawrl.engine.sampling_params import SamplingParams
from clawrl.engine.scheduler import Scheduler
from clawrl.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from clawrl.engine.step_output import StepOutput
from clawrl.engine.stop_checker import stop_reason
from clawrl.models.config import load_model_args
from clawrl.models.hf_io import load_model
from clawrl.models.loader import iter_safetensors, load_weights, safetensors_weight_map

MEMORY_TAGS = ("kv_cache", "weights")
_new_tuple = tuple.__new__


class Engine:
    """Continuous-batching engine over a paged KV cache (CPU reference path; CUDA: gpu_runner.py)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_args = load_model_args(config.model_path)
        self.tokenizer = _load_tokenizer(config.model_path)
        dtype = getattr(torch, config.dtype)
        self.model = load_model(config.model_path, fused=True, device=self.device, dtype=dtype)
        self.context_length = context_length_of(config, self.model_args.max_position_embeddings)
        self.kv_cache = build_kv_cache(config, self.model_args, dtype=dtype, device=self.device)
        num_blocks = self.kv_cache.num_blocks
        self.scheduler = Scheduler(
            BlockManager(num_blocks, config.block_size),
            max_running_requests=config.max_running_requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.runner = make_model_runner(config, self.model, self.kv_cache, context_length=self.context_length)
        self.runner.capture_cuda_graphs()  # CUDA: compile the kernels and capture decode graphs now
        self.weight_version = "0"
        self.eos_token_ids = set(self.model_args.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, list[Sequence]] = {}
        self._pending: list[StepOutput] = []
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._released: set[str] = set()
        self._overlap = config.overlap_schedule  # default: on for CUDA (EngineConfig.enable_overlap_schedule)
        self._inflight: tuple | None = None  # (batch, runner handle) of the launched step (overlap schedule)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (K/V dropped, later recomputed) since start."""
        return self.scheduler.num_preemptions

    # -- requests ---------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; its n samples are reported under `request_id` with index 0..n-1."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        check_request(
            prompt_token_ids, params, vocab_size=self.model_args.vocab_size, context_length=self.context_length,
            block_manager=self.scheduler.block_manager, has_tokenizer=self.tokenizer is not None,
        )  # fmt: skip
        params = dataclasses.replace(params)  # a private copy: the caller may reuse or mutate theirs
        seqs = self._make_sequences(request_id, list(prompt_token_ids), params)
        if params.max_new_tokens == 0:  # finished before it starts; reported by the next step()
            for seq in seqs:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, {"type": "length", "length": 0}
                self._pending.append(self._output(seq, [], []))
            return
        self._requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Finish every unfinished sample of the request with {"type": "abort"}; unknown ids are ignored."""
        for seq in self._requests.get(request_id, []):
            if not seq.is_finished:
                self._finish(seq, {"type": "abort"})

    def has_unfinished_requests(self) -> bool:
        """True while a sequence waits or runs, or outputs are still to be returned by step()."""
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    def step(self) -> list[StepOutput]:
        """Run one scheduler step; returns the outputs it produced (and any pending aborts).

        With `enable_overlap_schedule` it launches the next step first and returns the outputs of the
        step launched by the previous call (see `_overlap_step`)."""
        outputs, self._pending = self._pending, []
        if self._overlap:
            return outputs + self._overlap_step()
        if not self.scheduler.has_unfinished():
            return outputs
        self._check_not_released()
        batch = self.scheduler.schedule()
        assert not batch.is_empty, "unfinished sequences but nothing schedulable"
        seqs, tokens, logprobs = self.runner.run(batch)
        self.scheduler.postprocess(batch)
        return outputs + self._apply_tokens(seqs, tokens, logprobs, in_flight=False)

    def _apply_tokens(
        self, seqs: list[Sequence], tokens: list[int], logprobs: list[float], *, in_flight: bool
    ) -> list[StepOutput]:
        """Record each sequence's sampled token, finish the sequences it stops, one output per sequence.

        `in_flight` (overlap schedule): the token replaces the sequence's PENDING_TOKEN placeholder, and a
        sequence that stopped or was aborted while the step ran drops its token. This loop runs over the whole
        batch every step, so it reads attributes directly and only runs the full stop rules (stop_checker.py)
        when the token can stop the sequence: a length or context limit, a stop / EOS token id, or stop strings.
        """
        outputs: list[StepOutput] = []
        append = outputs.append
        finished, version = SequenceStatus.FINISHED, self.weight_version
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            ids = seq.output_token_ids
            if in_flight:
                if seq.status is finished:  # stopped or aborted while this step ran: its token is dropped
                    if ids and ids[-1] == PENDING_TOKEN:
                        ids.pop()
                        seq.output_logprobs.pop()
                    continue
                assert ids and ids[-1] == PENDING_TOKEN, (
                    "a launched sequence's sampled token has no placeholder"
                )
                ids[-1] = token
                seq.output_logprobs[-1] = logprob
            else:
                ids.append(token)
                seq.output_logprobs.append(logprob)
            if (
                len(ids) >= seq.max_output_tokens
                or token in seq.stop_token_set
                or seq.detokenizer is not None
            ):
                reason = stop_reason(
                    seq, token, eos_token_ids=self.eos_token_ids, context_length=self.context_length
                )
                if reason is not None:
                    self._finish(seq, reason, emit=False)
            # A StepOutput built positionally, in its field order, by tuple.__new__: ~3x cheaper than by keywords.
            append(_new_tuple(StepOutput, (
                seq.request_id, seq.index, [token], [logprob], seq.status is finished, seq.finish_reason, version,
                len(seq.prompt_token_ids), seq.num_cached_tokens,
            )))  # fmt: skip
        return outputs

    def _overlap_step(self) -> list[StepOutput]:
        """Schedule and launch step t + 1, then wait for step t (launched by the previous call) and return its
        outputs: the GPU computes t + 1 while this thread processes t and the caller consumes the outputs.

        Step t's sampled tokens are still on the device when t + 1 is scheduled, so each sampling sequence of
        t carries a PENDING_TOKEN as its last output token meanwhile (the runner feeds the real id to t + 1
        on the device). A sequence that stops at t has already been scheduled for t + 1: that token is
        dropped. The next step is only postprocessed (counts, prefix-cache publication, which hashes its
        input tokens) once t's tokens are known."""
        previous, self._inflight = self._inflight, None
        if self.scheduler.has_unfinished():
            self._check_not_released()
            batch = self.scheduler.schedule()
            if not batch.is_empty:  # empty when every running sequence only awaits its final token
                self._inflight = (batch, self.runner.launch(batch))
        outputs = self._collect(previous) if previous is not None else []
        if self._inflight is not None:
            self.scheduler.postprocess(self._inflight[0], pending_tokens=True)
        return outputs

    def _collect(self, inflight: tuple) -> list[StepOutput]:
        """Fill in the PENDING_TOKENs of a launched step and apply the stop rules."""
        seqs, tokens, logprobs = self.runner.collect(inflight[1])
        return self._apply_tokens(seqs, tokens, logprobs, in_flight=True)

    def _drain(self) -> None:
        """Wait for the launched step (overlap schedule) and queue its outputs for the next step() call."""
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._pending += self._collect(previous)

    def set_overlap_schedule(self, enabled: bool) -> None:
        """Switch EngineConfig.enable_overlap_schedule between steps (the launched step is collected first)."""
        self._drain()
        self._overlap = enabled

    def _check_not_released(self) -> None:
        if self._released:
            raise RuntimeError(f"Engine.step(): memory {sorted(self._released)} is released; resume it first")

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Run prompts to completion. One dict per sample (prompt order, then index): output_ids, logprobs,
        finish_reason, prompt_tokens, cached_tokens, weight_version, index."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"generate(): {len(prompts)} prompts but {len(params_list)} SamplingParams")
        prefix = f"generate-{uuid.uuid4().hex[:8]}"
        results: dict[tuple[str, int], dict] = {}
        keys = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            self.add_request(f"{prefix}-{i}", prompt, p)
            keys += [(f"{prefix}-{i}", index) for index in range(p.n)]
        while self.has_unfinished_requests():
            for out in self.step():
                key = (out.request_id, out.index)
                result = results.get(key)
                if result is None:
                    result = results[key] = _empty_result(out.index)
                result["output_ids"] += out.token_ids
                result["logprobs"] += out.logprobs
                if out.finished:  # every sample ends with one finished output; it carries the final fields
                    result.update(finish_reason=out.finish_reason, weight_version=out.weight_version)
                    result.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
        return [results[key] for key in keys]

    # -- weights and memory -----------------------------------------------------------------------------

    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> str:
        """Load HF-named tensors (any subset), bump the weight version, flush the prefix cache."""
        self._before_weight_update()
        load_weights(self.model, named_tensors, strict=False)
        return self._bump_version(weight_version)

    def load_weight_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of a multi-bucket weight sync; the version stays until set_weight_version."""
        self._before_weight_update()
        load_weights(self.model, named_tensors, strict=False)

    def set_weight_version(self, weight_version: str | None = None) -> str:
        """End a weight sync: take `weight_version` (None: bump) and flush the prefix cache."""
        return self._bump_version(weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load every weight of the HF checkpoint at `model_path`, bump the version, flush the cache."""
        files = safetensors_weight_map(model_path)  # raises ValueError naming the directory
        check_same_shapes(self.model_args, load_model_args(model_path), model_path)
        self._before_weight_update()
        load_weights(self.model, iter_safetensors(model_path), files=files)
        return self._bump_version(weight_version)

    def flush_cache(self) -> bool:
        """Forget the prefix cache; False (nothing done) while requests are unfinished."""
        self._drain()
        if self.scheduler.has_unfinished():
            return False
        self.scheduler.block_manager.flush()
        return True

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV cache and/or move the weights off the accelerator (tags: "kv_cache", "weights")."""
        tags = self._check_tags(tags)
        self._drain()
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                "release_memory_occupation: requests are unfinished; abort or finish them first"
            )
        self.runner.invalidate_cuda_graphs()  # frees their memory pool; recaptured after resume
        if "kv_cache" in tags:
            self.kv_cache.release()
            self.scheduler.block_manager.flush()  # the cached K/V are gone
        if "weights" in tags and self.device.type != "cpu":
            self.model.to("cpu")  # CPU engine: nothing to give back
        self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Re-allocate what release_memory_occupation freed."""
        tags = self._check_tags(tags)
        if "kv_cache" in tags:
            self.kv_cache.resume()
        if "weights" in tags and self.device.type != "cpu":
            self.model.to(self.device)
        self.runner.invalidate_cuda_graphs()  # they point at the old KV-cache / weight memory
        self._released -= set(tags)

    # -- internals --------------------------------------------------------------------------------------

    def _make_sequences(self, request_id: str, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        """The request's n samples; sample 0 leads (the others share its prompt blocks)."""
        seqs: list[Sequence] = []
        for index in range(params.n):
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=index, prompt_token_ids=prompt,
                params=params, leader=seqs[0] if seqs else None,
                sampler_state=sequence_seed(seed, index),
            )  # fmt: skip
            seq.max_output_tokens = min(params.max_new_tokens, self.context_length - len(prompt))
            if not params.ignore_eos:
                seq.stop_token_set = frozenset(params.stop_token_ids) | self.eos_token_ids
            if params.stop:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, prompt, skip_special_tokens=params.skip_special_tokens, stop=params.stop
                )
            seqs.append(seq)
        return seqs

    def _finish(self, seq: Sequence, reason: dict, *, emit: bool = True) -> None:
        self.scheduler.finish(seq, reason)
        if emit:
            self._pending.append(self._output(seq, [], []))
        seqs = self._requests.get(seq.request_id, [])
        if all(s.is_finished for s in seqs):
            self._requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id, index=seq.index, token_ids=tokens, logprobs=logprobs,
            finished=seq.is_finished, finish_reason=seq.finish_reason, weight_version=self.weight_version,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
        )  # fmt: skip

    def _before_weight_update(self) -> None:
        # The launched step (overlap schedule) reads the weights being replaced: let it finish first.
        self._drain()
        # Running sequences hold K/V of the old weights: retract them (recomputed later with the new ones).
        self.scheduler.preempt_all()
        # Flushed before loading: if loading fails half-way, no K/V of either weights can be reused.
        self.scheduler.block_manager.flush()

    def _bump_version(self, weight_version: str | None) -> str:
        if weight_version is not None:
            self.weight_version = str(weight_version)
        elif self.weight_version.isdigit():
            self.weight_version = str(int(self.weight_version) + 1)
        else:
            self.weight_version = f"{self.weight_version}+1"
        self.scheduler.weight_version = self.weight_version
        self.scheduler.block_manager.flush()
        return self.weight_version

    def _check_tags(self, tags: list[str] | None) -> list[str]:
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"memory tags must be among {MEMORY_TAGS}, got {bad}")
        return tags


def _empty_result(index: int) -> dict:
    return {"index": index, "output_ids": [], "logprobs": [], "finish_reason": None}


def _load_tokenizer(model_path: str):
    """The directory's HF tokenizer, or None when it has no tokenizer files (stop strings then refused)."""
    path = Path(model_path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
