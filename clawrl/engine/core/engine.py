"""Engine: the synchronous engine core (docs/engine.md). One thread calls add/abort/step.

    engine = Engine(EngineConfig(model_path="/tmp/tiny-qwen2"))
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.7, seed=1))

One decode step, through three files: `Engine.step()` here asks the scheduler (scheduler.py) for a batch,
hands it to the model runner (runner/cpu_runner.py, or runner/gpu_runner.py on CUDA; both follow
runner/base.py's ModelRunner), which runs the model (clawrl/models/decoder.py) over the paged KV cache and
samples; back here, `_apply_tokens` appends the sampled tokens, applies the stop rules (sequence.py) and
reports one StepOutput per sequence.

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
from typing import NamedTuple

import torch

from clawrl.config.engine import CORE_MEMORY_TAGS
from clawrl.cuda_memory import StableBuffer, move_parameters_into, stable_memory_available
from clawrl.engine.config import EngineConfig, check_same_shapes, context_length_of
from clawrl.engine.core.request import (
    RequestError,
    SamplingParams,
    StepLogprobs,
    check_prompt,
)
from clawrl.engine.core.scheduler import BlockManager, Scheduler
from clawrl.engine.core.sequence import (
    PENDING_TOKEN,
    IncrementalDetokenizer,
    Sequence,
    SequenceStatus,
    stop_reason,
)
from clawrl.engine.runner.base import ModelRunner
from clawrl.engine.runner.cpu_runner import CpuModelRunner, TensorParallelLeader
from clawrl.engine.runner.hf_runner import (
    HFModelRunner,
    hf_block_budget,
    hf_model_args,
    load_hf_engine_model,
    uses_hf_runner,
)
from clawrl.engine.runner.kv_cache import KVCache, build_kv_cache
from clawrl.engine.runner.sampler import sequence_seed
from clawrl.models.config import load_model_args
from clawrl.models.hf_io import load_model
from clawrl.models.loader import iter_safetensors, load_weights, safetensors_weight_map
from clawrl.models.tp import load_sharded_model, local_args

_new_tuple = tuple.__new__


class StepOutput(NamedTuple):
    """What one step produced for one sample of one request. A NamedTuple: the engine builds one per running
    sequence every step, and a tuple is the cheapest record Python can build (`Engine._apply_tokens` builds
    it positionally, in field order)."""

    request_id: str
    """Request id given to add_request."""
    index: int
    """Sample index 0..n-1."""
    token_ids: list[int]
    """New tokens produced in this step (one, or none for an abort or max_new_tokens=0)."""
    logprobs: list[float]
    """Logprob of each new token under the temperature-scaled distribution (runner/sampler.py)."""
    finished: bool
    """True on the sample's last output."""
    finish_reason: dict | None
    """{"type": "stop", "matched": id | str} | {"type": "length", "length": n} | {"type": "abort"}."""
    weight_version: str
    """Weight version that produced these tokens."""
    prompt_tokens: int
    """Prompt length."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    logprob_extras: StepLogprobs | None = None
    """Top / prompt logprobs, for requests that ask for them (top_logprobs_num, logprob_start_len)."""


class Engine:
    """Continuous-batching engine over a paged KV cache (CPU: runner/cpu_runner.py; CUDA: runner/gpu_runner.py)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.tokenizer = _load_tokenizer(config.model_path)
        dtype = getattr(torch, config.dtype)
        # An architecture only transformers implements, or model_impl "hf": runner/hf_runner.py.
        self.uses_hf = uses_hf_runner(config)
        self.tp: TensorParallelLeader | None = None  # tp_size > 1: the other ranks (runner/cpu_runner.py)
        # CUDA, native model: weights and KV cache in StableBuffers (clawrl/cuda_memory.py), so a memory release
        # keeps their addresses and the captured CUDA graphs stay valid.
        self._weights_buffer: StableBuffer | None = None
        self._weights_backup: torch.Tensor | None = None  # pinned host copy (config.weights_cpu_backup)
        self._weights_stale = False  # released without a backup; no weight update has landed since
        if self.uses_hf and config.tp_size > 1:
            raise ValueError(f"EngineConfig.tp_size={config.tp_size}: tensor parallelism needs the native "
                             f"model code, but {config.model_path} is served by transformers (model_impl hf)")  # fmt: skip
        if self.uses_hf:
            self.model_args = hf_model_args(config.model_path)
            self.model = load_hf_engine_model(config.model_path, device=self.device, dtype=dtype)
            self.kv_cache = hf_block_budget(config, self.model_args, dtype=dtype, device=self.device)
        elif config.tp_size > 1:
            self.model_args = load_model_args(config.model_path)
            self.tp = TensorParallelLeader.start(config)
            self.model = load_sharded_model(config.model_path, self.tp.tp, device=self.device, dtype=dtype)
            shard_args = local_args(self.model_args, config.tp_size)
            self.kv_cache = build_kv_cache(config, shard_args, dtype=dtype, device=self.device)
            self.tp.share_kv_blocks(self.kv_cache.num_blocks)
        else:
            self.model_args = load_model_args(config.model_path)
            self.model = load_model(config.model_path, fused=True, device=self.device, dtype=dtype)
            stable = self.device.type == "cuda" and stable_memory_available()
            if stable:
                self._weights_buffer = move_parameters_into(self.model, self.device)
            if config.true_on_policy_mode and self.device.type == "cuda":
                from clawrl.models.batch_invariant import enable_batch_invariant

                # its cuBLAS row checks run now, before the KV cache takes the memory
                enable_batch_invariant(self.model)
            self.kv_cache = build_kv_cache(
                config, self.model_args, dtype=dtype, device=self.device, stable=stable
            )
        self.context_length = context_length_of(config, self.model_args.max_position_embeddings)
        num_blocks = self.kv_cache.num_blocks
        self.scheduler = Scheduler(
            BlockManager(num_blocks, config.block_size),
            max_running_requests=config.max_running_requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.runner = _make_model_runner(
            config, self.model, self.kv_cache, context_length=self.context_length, tp=self.tp
        )
        self.runner.capture_cuda_graphs()  # CUDA: compile the kernels and capture decode graphs now
        self.weight_version = "0"
        self.eos_token_ids = set(self.model_args.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, list[Sequence]] = {}
        # Requests whose tokens the runner must see each step (penalties, top / prompt logprobs): while any
        # runs, steps go without the overlap schedule.
        self._host_step_requests: set[str] = set()
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

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, quiet: bool = False
    ) -> None:
        """Queue a request; its n samples are reported under `request_id` with index 0..n-1.

        quiet: the caller wants each sample's result only (a non-streaming request): step() reports a sample's
        tokens once, when it finishes, instead of one output per step (and, if the weight version changes
        meanwhile, the tokens of the old version just before it changes, so each output has one version).
        The outputs concatenate to the same tokens, logprobs and versions."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        self._check_request(prompt_token_ids, params)
        if self._weights_stale:
            raise RequestError(
                "the engine's weights were released without a CPU backup (EngineConfig.weights_cpu_backup=False) "
                "and no weight update has landed since: update the weights before generating"
            )
        params = dataclasses.replace(params)  # a private copy: the caller may reuse or mutate theirs
        score_only = params.max_new_tokens == 0 and params.logprob_start_len >= 0
        if score_only:  # the prompt runs for its logprobs; its one sampled token is dropped (_score_output)
            params.max_new_tokens = 1
        seqs = self._make_sequences(request_id, list(prompt_token_ids), params, score_only=score_only)
        for seq in seqs:
            seq.quiet = quiet
        if params.max_new_tokens == 0:  # finished before it starts; reported by the next step()
            for seq in seqs:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, {"type": "length", "length": 0}
                self._pending.append(self._output(seq, [], []))
            return
        self._requests[request_id] = seqs
        if params.needs_host_step:
            self._host_step_requests.add(request_id)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> list[StepOutput]:
        """Finish every unfinished sample of the request with {"type": "abort"}; unknown ids are ignored.
        Returns the abort's outputs (a quiet sample's carry its unreported tokens); the next step() returns
        them too."""
        queued = len(self._pending)
        for seq in self._requests.get(request_id, []):
            if not seq.is_finished:
                self._finish(seq, {"type": "abort"})
        return self._pending[queued:]

    def has_unfinished_requests(self) -> bool:
        """True while a sequence waits or runs, or outputs are still to be returned by step()."""
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    def step(self) -> list[StepOutput]:
        """Run one scheduler step; returns the outputs it produced (and any pending aborts).

        With `enable_overlap_schedule` it launches the next step first and returns the outputs of the
        step launched by the previous call (see `_overlap_step`)."""
        overlap = self._overlap and not self._host_step_requests
        if not overlap:
            self._drain()  # a request that needs host steps arrived while a step was in flight
        outputs, self._pending = self._pending, []
        if overlap:
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
        batch every step, so it reads attributes directly and only runs the full stop rules (sequence.py)
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
                if seq.score_only:
                    append(self._score_output(seq))
                    continue
                reason = stop_reason(
                    seq, token, eos_token_ids=self.eos_token_ids, context_length=self.context_length
                )
                if reason is not None:
                    self._finish(seq, reason, emit=False)
            if seq.quiet:  # reported when it finishes (or each step when it reports top / prompt logprobs)
                if seq.status is not finished and not seq.reports_logprobs:
                    continue
                start = seq.num_reported
                seq.num_reported = len(ids)
                token_ids, token_logprobs = ids[start:], seq.output_logprobs[start:]
            else:
                token_ids, token_logprobs = [token], [logprob]
            # A StepOutput built positionally, in its field order, by tuple.__new__: ~3x cheaper than by keywords.
            append(_new_tuple(StepOutput, (
                seq.request_id, seq.index, token_ids, token_logprobs, seq.status is finished, seq.finish_reason,
                version, len(seq.prompt_token_ids), seq.num_cached_tokens,
                self._take_logprobs(seq) if seq.reports_logprobs else None,
            )))  # fmt: skip
        return outputs

    def _take_logprobs(self, seq: Sequence) -> StepLogprobs:
        """The step's top logprobs of `seq`, and with its first token its prompt logprobs (sample 0)."""
        top, seq.step_top_logprobs = seq.step_top_logprobs, None
        first = len(seq.output_token_ids) == 1
        prompt = list(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else None
        return StepLogprobs(output_top=None if top is None else [top], prompt=prompt)

    def _score_output(self, seq: Sequence) -> StepOutput:
        """A score-only sequence (max_new_tokens 0, prompt logprobs): drop its token, finish, report the prompt."""
        seq.output_token_ids.pop()
        seq.output_logprobs.pop()
        seq.step_top_logprobs = None
        self._finish(seq, {"type": "length", "length": 0}, emit=False)
        prompt = None if seq.prompt_logprobs is None else list(seq.prompt_logprobs)
        return self._output(seq, [], [])._replace(logprob_extras=StepLogprobs(output_top=None, prompt=prompt))

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
        finish_reason, prompt_tokens, cached_tokens, weight_version, index; and "top_logprobs" /
        "prompt_logprobs" when asked for (top_logprobs_num, logprob_start_len)."""
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
                if out.logprob_extras is not None:
                    _add_extras(result, out.logprob_extras)
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
        self._load_tensors(named_tensors)
        return self._bump_version(weight_version)

    def load_weight_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of a multi-bucket weight sync; the version stays until set_weight_version."""
        self._before_weight_update()
        self._load_tensors(named_tensors)

    def _load_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tp is None:
            load_weights(self.model, named_tensors, strict=False)
            return
        named = list(named_tensors)
        load_weights(self.model, named, strict=False)  # rank 0 first: a bad tensor fails before any is sent
        self.tp.load_weights(named)  # full tensors to the other ranks; each keeps its slice

    def set_weight_version(self, weight_version: str | None = None) -> str:
        """End a weight sync: take `weight_version` (None: bump) and flush the prefix cache."""
        return self._bump_version(weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load every weight of the HF checkpoint at `model_path`, bump the version, flush the cache."""
        files = safetensors_weight_map(model_path)  # raises ValueError naming the directory
        incoming = (hf_model_args if self.uses_hf else load_model_args)(model_path)
        check_same_shapes(self.model_args, incoming, model_path)
        self._before_weight_update()
        load_weights(self.model, iter_safetensors(model_path), files=files)
        if self.tp is not None:
            self.tp.load_from_disk(model_path)
        return self._bump_version(weight_version)

    def flush_cache(self) -> bool:
        """Forget the prefix cache; False (nothing done) while requests are unfinished."""
        self._drain()
        if self.scheduler.has_unfinished():
            return False
        self.scheduler.block_manager.flush()
        return True

    @property
    def keeps_addresses(self) -> bool:
        """Whether a memory release keeps the weights' and KV cache's addresses (and so the CUDA graphs)."""
        return self._weights_buffer is not None

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV cache and/or the weights' device memory (tags: "kv_cache", "weights").

        CUDA with stable memory: the physical memory is unmapped (~ms), the CUDA graphs are kept; released
        weights are copied to pinned host memory first only with EngineConfig.weights_cpu_backup. Otherwise
        the KV cache is freed, the weights move to the host and the graphs are recaptured after resume."""
        tags = self._check_tags(tags)
        self._drain()
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                "release_memory_occupation: requests are unfinished; abort or finish them first"
            )
        if not self.keeps_addresses:
            self.runner.invalidate_cuda_graphs()  # frees their memory pool; recaptured after resume
        if "kv_cache" in tags:
            self.kv_cache.release()
            self.scheduler.block_manager.flush()  # the cached K/V are gone
        if "weights" in tags and self.device.type != "cpu" and "weights" not in self._released:
            self._release_weights()  # CPU engine: nothing to give back
        if self.tp is not None:
            self.tp.memory("release", tags)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's cached activation blocks go back to the device too
        self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Re-allocate what release_memory_occupation freed."""
        tags = self._check_tags(tags)
        if "kv_cache" in tags:
            self.kv_cache.resume()
        if "weights" in tags and self.device.type != "cpu" and "weights" in self._released:
            self._resume_weights()
        if self.tp is not None:
            self.tp.memory("resume", tags)
        if not self.keeps_addresses:
            self.runner.invalidate_cuda_graphs()  # they point at the old KV-cache / weight memory
        self._released -= set(tags)

    def check_weights_resident(self, what: str) -> None:
        """Raise naming `what` when the weights' memory is unmapped (reading it would fault the device)."""
        if self.keeps_addresses and "weights" in self._released:
            raise RuntimeError(
                f"{what}: the engine's weights are released; resume_memory_occupation(['weights']) first"
            )

    def _release_weights(self) -> None:
        buffer = self._weights_buffer
        if buffer is None:
            self.model.to("cpu")
            return
        if self.config.weights_cpu_backup:
            if self._weights_backup is None:  # pinned once, reused by every later release
                self._weights_backup = torch.empty(buffer.nbytes, dtype=torch.uint8, pin_memory=True)
            self._weights_backup.copy_(buffer.tensor)
        else:
            self._weights_stale = True
        buffer.release()

    def _resume_weights(self) -> None:
        buffer = self._weights_buffer
        if buffer is None:
            self.model.to(self.device)
            return
        buffer.resume()
        if self.config.weights_cpu_backup and self._weights_backup is not None:
            buffer.tensor.copy_(self._weights_backup)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also exit when this process does)."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    # -- internals --------------------------------------------------------------------------------------

    def _make_sequences(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, score_only: bool = False
    ) -> list[Sequence]:
        """The request's n samples; sample 0 leads (the others share its prompt blocks) and alone reports
        the prompt's logprobs (position 0 has none: nothing predicts it)."""
        seqs: list[Sequence] = []
        for index in range(params.n):
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=index, prompt_token_ids=prompt,
                params=params, leader=seqs[0] if seqs else None,
                sampler_state=sequence_seed(seed, index),
            )  # fmt: skip
            seq.max_output_tokens = (
                0 if score_only else min(params.max_new_tokens, self.context_length - len(prompt))
            )
            seq.score_only = score_only
            seq.reports_logprobs = params.top_logprobs_num > 0 or params.logprob_start_len >= 0
            if index == 0 and params.logprob_start_len >= 0:
                seq.prompt_logprobs = [(None, None)] if params.logprob_start_len == 0 else []
            if not params.ignore_eos:
                seq.stop_token_set = frozenset(params.stop_token_ids) | self.eos_token_ids
            if params.stop:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, prompt, skip_special_tokens=params.skip_special_tokens, stop=params.stop
                )
            seqs.append(seq)
        return seqs

    def _check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestError (a ValueError) naming the field and value that this engine cannot serve."""
        params.validate()
        check_prompt(prompt, field="prompt_token_ids", vocab_size=self.model_args.vocab_size,
                     context_len=self.context_length, max_new_tokens=params.max_new_tokens)  # fmt: skip
        if params.logprob_start_len >= 0 and self.uses_hf:
            raise RequestError(
                f"logprob_start_len={params.logprob_start_len}: prompt logprobs are not computed by the "
                "transformers path (model_impl hf); serve a native architecture for them"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling_params.stop={params.stop!r} needs a tokenizer in the model directory")
        # A sequence alone must fit the cache, or it would preempt itself forever.
        blocks = self.scheduler.block_manager
        longest = min(len(prompt) + params.max_new_tokens, self.context_length)
        if blocks.blocks_for_tokens(longest) > blocks.num_blocks:
            raise ValueError(
                f"sampling_params.max_new_tokens={params.max_new_tokens} with a {len(prompt)}-token prompt needs "
                f"{longest} KV-cache slots, but the cache holds {blocks.num_blocks * blocks.block_size} "
                "(num_kv_blocks x block_size)"
            )

    def _finish(self, seq: Sequence, reason: dict, *, emit: bool = True) -> None:
        self.scheduler.finish(seq, reason)
        if emit:
            self._pending.append(self._output(seq, *self._unreported(seq)))
        seqs = self._requests.get(seq.request_id, [])
        if all(s.is_finished for s in seqs):
            self._requests.pop(seq.request_id, None)
            self._host_step_requests.discard(seq.request_id)

    def _unreported(self, seq: Sequence) -> tuple[list[int], list[float]]:
        """A quiet sequence's tokens (and logprobs) not reported yet, now marked reported; a launched step's
        placeholder is left out (that step drops its token, or reports it when it is collected)."""
        if not seq.quiet:
            return [], []
        ids, end = seq.output_token_ids, len(seq.output_token_ids)
        if end and ids[-1] == PENDING_TOKEN:
            end -= 1
        start, seq.num_reported = seq.num_reported, max(seq.num_reported, end)
        return ids[start:end], seq.output_logprobs[start:end]

    def _report_quiet(self) -> None:
        """Queue the tokens every unfinished quiet sequence has not reported yet (before the version changes)."""
        for seqs in self._requests.values():
            for seq in seqs:
                if seq.quiet and not seq.is_finished:
                    tokens, logprobs = self._unreported(seq)
                    if tokens:
                        self._pending.append(self._output(seq, tokens, logprobs))

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id, index=seq.index, token_ids=tokens, logprobs=logprobs,
            finished=seq.is_finished, finish_reason=seq.finish_reason, weight_version=self.weight_version,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
        )  # fmt: skip

    def _before_weight_update(self) -> None:
        self.check_weights_resident("weight update")
        # The launched step (overlap schedule) reads the weights being replaced: let it finish first.
        self._drain()
        # Running sequences hold K/V of the old weights: retract them (recomputed later with the new ones).
        self.scheduler.preempt_all()
        # Flushed before loading: if loading fails half-way, no K/V of either weights can be reused.
        self.scheduler.block_manager.flush()

    def _bump_version(self, weight_version: str | None) -> str:
        self._report_quiet()  # their tokens so far carry the version they were generated with
        self._weights_stale = False  # a sync loads every weight before it sets the version
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
        tags = list(CORE_MEMORY_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in CORE_MEMORY_TAGS]
        if bad:
            raise ValueError(f"memory tags must be among {CORE_MEMORY_TAGS}, got {bad}")
        return tags


def _add_extras(result: dict, extras: StepLogprobs) -> None:
    """generate(): "top_logprobs" per output token, "prompt_logprobs" per scored prompt position."""
    if extras.output_top is not None:
        result.setdefault("top_logprobs", []).extend(extras.output_top)
    if extras.prompt is not None:
        result["prompt_logprobs"] = extras.prompt


def _empty_result(index: int) -> dict:
    return {"index": index, "output_ids": [], "logprobs": [], "finish_reason": None}


def _load_tokenizer(model_path: str):
    """The directory's HF tokenizer, or None when it has no tokenizer files (stop strings then refused)."""
    path = Path(model_path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _make_model_runner(
    config: EngineConfig,
    model: torch.nn.Module,
    kv_cache: KVCache,
    *,
    context_length: int,
    tp: TensorParallelLeader | None = None,
) -> ModelRunner:
    """The GPU runner on CUDA; the reference runner elsewhere or with attention_backend "torch" (the
    plain-torch path, for debugging crashes in the kernels), and for tensor parallelism (any device)."""
    if config.true_on_policy_mode:  # batch-invariant kernels, on CUDA or under the Triton interpreter
        if tp is not None or uses_hf_runner(config):
            raise ValueError(f"EngineConfig.true_on_policy_mode needs a native dense model at tp_size 1: "
                             f"{config.model_path} is served by transformers or tensor-parallel")  # fmt: skip
        from clawrl.engine.runner.gpu_runner import GpuModelRunner

        return GpuModelRunner(
            model, kv_cache, max_running_requests=config.max_running_requests, context_length=context_length,
            enable_cuda_graph=config.enable_cuda_graph, batch_invariant=True,
        )  # fmt: skip
    if tp is not None:
        return CpuModelRunner(model, kv_cache, tp=tp)
    if uses_hf_runner(config):
        return HFModelRunner(model, torch.device(config.device))
    if kv_cache.device.type != "cuda" or config.attention_backend == "torch":
        return CpuModelRunner(model, kv_cache)
    from clawrl.engine.runner.gpu_runner import GpuModelRunner  # imports Triton: only on the GPU path

    return GpuModelRunner(
        model, kv_cache, max_running_requests=config.max_running_requests, context_length=context_length,
        enable_cuda_graph=config.enable_cuda_graph, fused_kernels=config.fused_kernels,
    )  # fmt: skip
