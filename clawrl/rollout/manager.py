"""RolloutManager: prompts -> engine generations -> rewards -> a TrainBatch, and evaluation (a plain class;
the training loop wraps it in a Ray actor).

    manager = RolloutManager(job, engine_urls, tokenizer_path=None, num_rollout_gpus=None)
    batch, metrics = manager.generate(rollout_id)      # TrainBatch (rewards post-processed) + rollout metrics
    manager.last_samples                               # that rollout's Samples, in batch order
    metrics = manager.eval(rollout_id)                 # {"eval/<name>": mean reward, ...}
    state = manager.state_dict(); manager.load_state_dict(state)   # data cursor (plain types)
    manager.check_health(); manager.close()

It owns an asyncio event loop in a background thread (the router's HTTP clients live there), so its methods
are plain blocking calls, each with a deadline (`rollout_timeout_s`). A rollout is clawrl's default loop
(clawrl/rollout/default_rollout.py: --over-sampling-batch-size, --dynamic-sampling-filter-path, abort of
the leftovers) or the user's `--rollout-function-path`. Then, as slime's RolloutManager does: groups are
sorted by their first sample's index, raw rewards (`--reward-key` picks from dict rewards) are
post-processed by `clawrl.algo.postprocess_rewards` (group normalisation per --advantage-estimator,
--disable-rewards-normalization, --disable-grpo-std-normalization; a group is one prompt's samples, all
groups must be the same size), and `TrainBatch.from_samples` builds the batch. Metrics: see
clawrl/rollout/metrics.py.

Decision (as slime): prompts of groups aborted because the batch was already full stay consumed; the data
cursor does not rewind, so with over-sampling an epoch visits fewer than all prompts for training. With
--partial-rollout those groups, with their partial responses, go back into the data source's buffer and
the next rollout resumes them (clawrl/rollout/partial.py); the buffer is part of `state_dict`, so a
checkpoint keeps them.

Weight staleness: the loops train rollout k with the weights after k updates, so a sample's staleness is
k minus its oldest weight version (rollout/weight_staleness/{max,mean}; not logged with
--debug-rollout-only, where no trainer exists).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

import torch

from clawrl.algo import postprocess_rewards
from clawrl.config.plugins import load_function
from clawrl.data.dataset import PromptDataset
from clawrl.data.sample import Sample, Status
from clawrl.data.source import PromptSource
from clawrl.data.train_batch import TrainBatch
from clawrl.engine.http.client import KEEPALIVE_EXPIRY_S, OWN_ENGINE_KEEPALIVE_EXPIRY_S
from clawrl.metrics.progress import RolloutCounter
from clawrl.metrics.timer import GcPauses
from clawrl.rollout.context import RolloutContext, reset_rollout_context, set_rollout_context
from clawrl.rollout.data_source import RolloutDataSource
from clawrl.rollout.default_rollout import GroupGenerator, collect_train_groups, generate_eval_samples
from clawrl.rollout.filters import FILTER_FLAG, DynamicFilterOutput, apply_filter
from clawrl.rollout.generate import eval_sampling_params, train_sampling_params
from clawrl.rollout.hooks import (
    ROLLOUT_FLAG,
    GenerateFunctions,
    call_rollout_fn,
    check_rollout_samples,
    eval_output,
    train_output,
)
from clawrl.rollout.metrics import eval_metrics, rollout_metrics
from clawrl.rollout.partial import (
    PartialStats,
    check_staleness,
    partial_metrics,
    requeue,
    staleness_metrics,
    take_groups,
)
from clawrl.rollout.rewards import build_reward_fn
from clawrl.rollout.router import EngineRouter
from clawrl.rollout.timeline import RolloutTimeline

logger = logging.getLogger(__name__)

# Estimators whose post-processing compares a sample with its group (so groups must be equal-sized).
_UNGROUPED_ESTIMATORS = ("ppo", "reinforce_plus_plus")


class RolloutManager:
    """Generates training batches and evaluation metrics from prompt data through engine servers."""

    def __init__(
        self,
        job: Any,
        engine_urls: list[str],
        *,
        tokenizer_path: str | None = None,
        num_rollout_gpus: int | None = None,
        request_timeout_s: float = 1800.0,
        health_timeout_s: float = 30.0,
        rollout_timeout_s: float = 3600.0,
        abort_timeout_s: float = 60.0,
        max_concurrency_per_engine: int = 512,
    ) -> None:
        self.job = job
        self.rollout_timeout_s = rollout_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.args = job.to_namespace()
        self.args.rollout_engine_urls = list(engine_urls)  # for plugins that talk to engines themselves
        self.num_rollout_devices = _num_devices(num_rollout_gpus, job, engine_urls)
        self.tokenizer = _load_tokenizer(tokenizer_path or job.model.hf_checkpoint)
        self._load_plugins()
        self.data_source = RolloutDataSource(
            self._train_source(),
            job.rollout.n_samples_per_prompt,
            save_dir=job.model.save,
            load_dir=job.model.load,
        )
        self.eval_datasets = {name: self._dataset(path) for name, path in job.eval.eval_prompt_data.items()}
        external = bool(job.resources.rollout_external_engine_addrs)
        self.router = EngineRouter(
            engine_urls,
            request_timeout_s=request_timeout_s,
            health_timeout_s=health_timeout_s,
            max_concurrent_requests=max_concurrency_per_engine * len(engine_urls),
            fault_tolerant=job.fault.use_fault_tolerance,
            # The run's own engines keep idle connections 30 s: a rollout reuses the last one's connections.
            # An external server's idle timeout is unknown (SGLang's is 5 s): the 2 s that any server allows.
            keepalive_s=KEEPALIVE_EXPIRY_S if external else OWN_ENGINE_KEEPALIVE_EXPIRY_S,
            compact_answers=not external,  # packed logprobs: only clawrl's own server has them
        )
        self._retried_before = 0  # router.num_retried when the current rollout started
        self._cursor_before: dict[int, dict[str, Any]] = {}
        self.last_samples: list[Sample] = []
        self.counter = RolloutCounter()
        """Samples finished in the rollout in flight, for the driver's progress bar (`progress()`)."""
        """The samples of the latest `generate`, in batch order (weight versions, text, metadata)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="clawrl-rollout-loop", daemon=True
        )
        self._thread.start()
        # What is alive now (torch, transformers, the tokenizer, the datasets: hundreds of thousands of objects)
        # lives as long as the manager. Frozen, the garbage collector's full passes skip it: a rollout's answers
        # (thousands of lists each) otherwise trigger one now and then, a ~0.1 s stop of the rollout's event
        # loop that lands in its tail (bench/rollout_http_overhead.py: 90-100 ms, in some of its runs). Logged
        # as perf/rollout_gc_time. As AsyncEngine does for the engine's process.
        gc.collect()
        gc.freeze()
        self._froze_gc = True

    # ------------------------------------------------------------------------------------------------
    # setup

    def _load_plugins(self) -> None:
        r = self.job.rollout
        self.rollout_fn = (
            load_function(r.rollout_function_path, ROLLOUT_FLAG) if r.rollout_function_path else None
        )
        self.filter_fn = (
            load_function(r.dynamic_sampling_filter_path, FILTER_FLAG)
            if r.dynamic_sampling_filter_path
            else None
        )
        self.reward_fn = None
        if r.rm_type or r.custom_rm_path:
            self.reward_fn = build_reward_fn(
                rm_type=r.rm_type,
                custom_rm_path=r.custom_rm_path,
                rm_url=r.rm_url,
                reward_key=r.reward_key,
                args=self.args,
            )
        elif self.rollout_fn is None and r.custom_generate_function_path is None:
            raise ValueError("no reward function configured: pass --rm-type or --custom-rm-path")
        self.generator = GroupGenerator(
            args=self.args,
            generate_fns=GenerateFunctions(r.custom_generate_function_path),
            reward_fn=self.reward_fn,
        )
        over = r.over_sampling_batch_size or r.rollout_batch_size
        if over < r.rollout_batch_size:
            raise ValueError(
                f"--over-sampling-batch-size {over} must be >= --rollout-batch-size {r.rollout_batch_size}"
            )
        self.over_sampling_batch_size = over

    def _dataset(self, path: str) -> PromptDataset:
        d = self.job.data
        return PromptDataset(
            path,
            self.tokenizer,
            input_key=d.input_key,
            label_key=d.label_key,
            metadata_key=d.metadata_key,
            tool_key=d.tool_key,
            apply_chat_template=d.apply_chat_template,
            max_prompt_len=d.rollout_max_prompt_len,
        )

    def _train_source(self) -> PromptSource | None:
        d = self.job.data
        if d.prompt_data is None:
            if self.rollout_fn is None:
                raise ValueError(
                    "--prompt-data is required (unset) unless --rollout-function-path makes prompts"
                )
            return None
        return PromptSource(
            self._dataset(d.prompt_data), shuffle=d.rollout_shuffle, seed=self.job.rollout.rollout_seed
        )

    # ------------------------------------------------------------------------------------------------
    # public API (blocking, each with a deadline)

    def generate(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        """One rollout: (TrainBatch of --rollout-batch-size x --n-samples-per-prompt samples, metrics)."""
        # The cursor as it was before this rollout: a checkpoint of rollout k taken while rollout k+1 is
        # already in flight (train-async) must resume at k+1's prompts, not after them.
        self._cursor_before = {k: v for k, v in self._cursor_before.items() if k >= rollout_id - 1}
        self._cursor_before[rollout_id] = {"data_source": self.data_source.state_dict()}
        self.counter.start(self.job.rollout.rollout_batch_size * self.job.rollout.n_samples_per_prompt)
        return self._run(self._generate(rollout_id), f"generate(rollout_id={rollout_id})")

    def num_rollout_for_epochs(self) -> int:
        """--num-epoch x (prompts per epoch // --rollout-batch-size): slime's default run length."""
        per_epoch = len(self.data_source) // self.job.rollout.rollout_batch_size
        if per_epoch < 1:
            raise ValueError(
                f"--prompt-data has {len(self.data_source)} prompts, fewer than one --rollout-batch-size "
                f"{self.job.rollout.rollout_batch_size}: --num-epoch cannot make a rollout"
            )
        return per_epoch * (self.job.data.num_epoch or 1)

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Evaluate on every --eval-prompt-data dataset: {"eval/<name>": mean reward, ...}."""
        return self._run(self._eval(rollout_id), f"eval(rollout_id={rollout_id})")

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Fault tolerance: route to `new_url` (a replacement serving the current weights) instead of `old_url`."""
        self._run(_call_soon(self.router.replace, old_url, new_url), "replace_engine()", timeout_s=30.0)
        self.args.rollout_engine_urls = self.router.urls

    def arm_fault(self, url: str, engine_actor: Any, mode: str) -> None:
        """Fault injection (tests): break the engine at `url` (its Ray actor handle) once, just after the
        router sends it the next request, so that request is in flight when the engine dies or freezes."""

        def fire() -> None:
            engine_actor.inject_fault.remote(mode)  # never returns: the process exits or freezes
            logger.warning("fault injection: engine %s %s with requests in flight", url, mode)

        self._run(_call_soon(self.router.arm_fault, url, fire), "arm_fault()", timeout_s=30.0)

    def progress(self) -> dict[str, float]:
        """{"done", "total", "tokens", "elapsed_s"} of the rollout in flight (callable while it runs); samples
        are counted by the default rollout loop, not inside a custom --rollout-function-path."""
        return self.counter.snapshot()

    def router_stats(self) -> dict[str, dict[str, int]]:
        """Per engine URL: requests outstanding now and served so far (callable while a rollout runs)."""
        return self._run(_call_soon(self.router.stats), "router_stats()", timeout_s=30.0)

    def check_health(self) -> dict[str, dict[str, Any]]:
        """GET /health_generate on every engine within the router's deadline; EngineHealthError if any is dead."""
        return self._run(self.router.check_health(), "check_health()")

    def state_dict(self, before_rollout: int | None = None) -> dict[str, Any]:
        """The data cursor (and buffered groups) as plain types; `before_rollout=k`: as it was when rollout k
        started (kept for the two latest rollouts)."""
        if before_rollout is not None and before_rollout in self._cursor_before:
            return self._cursor_before[before_rollout]
        return {"data_source": self.data_source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "data_source" not in state:
            raise ValueError(f"rollout manager state needs 'data_source'; got keys {sorted(state)}")
        self.data_source.load_state_dict(state["data_source"])

    def close(self) -> None:
        """Close the HTTP clients and stop the event loop thread."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self._aclose(), "close()", timeout_s=30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)
            self._loop.close()
            if self._froze_gc:  # the manager's objects may be garbage from now on (tests build many)
                gc.unfreeze()
                self._froze_gc = False

    async def _aclose(self) -> None:
        await self.router.aclose()
        if self.reward_fn is not None:
            await self.reward_fn.aclose()

    def __enter__(self) -> RolloutManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------
    # running coroutines on the manager's loop

    def _run(self, coroutine: Coroutine[Any, Any, Any], what: str, timeout_s: float | None = None) -> Any:
        timeout_s = self.rollout_timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(_with_deadline(coroutine, timeout_s, what), self._loop)
        try:
            # Margin: after the deadline the rollout still aborts its leftover requests (abort_timeout_s).
            return future.result(timeout=timeout_s + self.abort_timeout_s + 30.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"RolloutManager.{what} did not return within {timeout_s} s") from None

    def _context(self) -> RolloutContext:
        return RolloutContext(
            router=self.router,
            tokenizer=self.tokenizer,
            loop=self._loop,
            call_timeout_s=self.rollout_timeout_s,
        )

    # ------------------------------------------------------------------------------------------------
    # training rollout

    async def _generate(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        started = time.monotonic()
        ctx = self._context()
        partial = PartialStats()
        token = set_rollout_context(ctx)
        timeline = ctx.timeline = RolloutTimeline(started=started)
        stats_before = await self.router.engine_stats()
        with GcPauses() as pauses:  # this process's collections while it generates
            try:
                if self.rollout_fn is not None:
                    result = await call_rollout_fn(
                        self.rollout_fn, self.args, rollout_id, self.data_source, False
                    )
                    groups, extra = train_output(result, self.job.rollout.rollout_function_path)
                    drops, num_aborted = {}, 0
                    producer = f"{ROLLOUT_FLAG} {self.job.rollout.rollout_function_path!r}"
                else:
                    collected = await self._collect(ctx, rollout_id, partial)
                    groups, extra = collected.groups, {}
                    drops, num_aborted = collected.drops, collected.num_aborted_samples
                    producer = self.generator.generate_fns.default.flag
            finally:
                reset_rollout_context(token)
        batch, raw_rewards, groups = self._to_batch(rollout_id, groups, producer)
        self.last_samples = [s for g in groups for s in g]
        ended = time.monotonic()
        metrics = rollout_metrics(
            groups,
            raw_rewards,
            estimator=self.job.algo.advantage_estimator,
            drops=drops,
            num_aborted_samples=num_aborted,
            rollout_time_s=ended - started,
            num_rollout_devices=self.num_rollout_devices,
        )
        metrics.update(timeline.metrics(ended))  # where the rollout's time went (clawrl/rollout/timeline.py)
        metrics["perf/rollout_gc_time"] = pauses.seconds
        metrics.update(engine_busy_metrics(stats_before, await self.router.engine_stats(), ended - started))
        metrics.update(self._staleness(rollout_id, self.last_samples, partial))
        if self.router.fault_tolerant:
            metrics["rollout/requests_retried"] = float(self.router.num_retried - self._retried_before)
            self._retried_before = self.router.num_retried
        self._save_dump(rollout_id, self.last_samples, {"kind": "train", "metrics": dict(metrics)})
        return batch, {**metrics, **extra}

    async def _collect(self, ctx: RolloutContext, rollout_id: int, partial: PartialStats):
        r = self.job.rollout
        params = train_sampling_params(self.args)
        get_groups = self.data_source.get_samples
        if r.partial_rollout:

            def get_groups(num_groups: int) -> list[list[Sample]]:
                return take_groups(
                    self.data_source.get_samples, num_groups, policy_version=self._policy_version(rollout_id),
                    max_staleness=r.max_weight_staleness, mask_offpolicy=r.mask_offpolicy_in_partial_rollout,
                    stats=partial,
                )  # fmt: skip

        collected = await collect_train_groups(
            target=r.rollout_batch_size,
            over_sampling=self.over_sampling_batch_size,
            get_groups=get_groups,
            run_group=lambda group: self._counted_group(group, params),
            judge=self._judge,
            ctx=ctx,
            abort_timeout_s=self.abort_timeout_s,
            keep_partial=r.partial_rollout,
        )
        if collected.leftovers:
            requeue(collected.leftovers, rollout_id, self.data_source.add_samples, partial)
        return collected

    async def _counted_group(self, group: list[Sample], params: dict[str, Any]) -> list[Sample]:
        """GroupGenerator.group, counting each sample into the progress as soon as it is rewarded."""
        return await self.generator.group(group, params, False, on_samples=self.counter.add)

    def _policy_version(self, rollout_id: int) -> int | None:
        """The trainer's weight version when it trains rollout `rollout_id` (None: no trainer)."""
        return None if self.job.debug.debug_rollout_only else rollout_id

    def _staleness(self, rollout_id: int, samples: list[Sample], partial: PartialStats) -> dict[str, float]:
        r, version = self.job.rollout, self._policy_version(rollout_id)
        if r.max_weight_staleness is not None and version is not None:
            check_staleness(samples, version, r.max_weight_staleness)
        metrics = staleness_metrics(samples, version)
        if r.partial_rollout:
            metrics.update(partial_metrics(partial))
        return metrics

    def _judge(self, group: list[Sample]) -> DynamicFilterOutput:
        if self.filter_fn is None:
            return DynamicFilterOutput(keep=True)
        return apply_filter(self.filter_fn, self.job.rollout.dynamic_sampling_filter_path, self.args, group)

    def _to_batch(
        self, rollout_id: int, groups: list[list[Sample]], producer: str
    ) -> tuple[TrainBatch, list[float], list[list[Sample]]]:
        return train_batch_from_groups(self.job, rollout_id, groups, producer)

    def _save_dump(self, rollout_id: int | str, samples: list[Sample], extra_meta: dict[str, Any]) -> None:
        """--save-debug-rollout-data: the rollout's samples plus what a replay needs."""
        template = self.job.debug.save_debug_rollout_data
        if template is None:
            return
        from clawrl.debug.dump import config_hash, dump_path, save_rollout_dump

        evaluation = isinstance(rollout_id, str)
        params = eval_sampling_params(self.args) if evaluation else train_sampling_params(self.args)
        versions = sorted({v for s in samples for v in s.weight_versions})
        meta = {
            "weight_version": versions[-1] if len(versions) == 1 else None,
            "weight_versions": versions,
            "sampling_params": dict(params),
            "tokenizer": self.job.model.hf_checkpoint,
            "config_hash": config_hash(self.job.to_dict()),
            **extra_meta,
        }
        path = save_rollout_dump(
            dump_path(template, rollout_id), rollout_id=rollout_id, samples=samples, meta=meta
        )
        logger.info("rollout %s: %d samples dumped to %s", rollout_id, len(samples), path)

    # ------------------------------------------------------------------------------------------------
    # evaluation

    async def _eval(self, rollout_id: int) -> dict[str, float]:
        ctx = self._context()
        token = set_rollout_context(ctx)
        try:
            if self.rollout_fn is not None:
                result = await call_rollout_fn(self.rollout_fn, self.args, rollout_id, self.data_source, True)
                data, extra = eval_output(result, self.job.rollout.rollout_function_path)
            else:
                names = list(self.eval_datasets)
                results = await asyncio.gather(*(self._eval_dataset(name) for name in names))
                data, extra = dict(zip(names, results, strict=True)), {}
        finally:
            reset_rollout_context(token)
        metrics: dict[str, float] = {}
        for name, entry in data.items():
            metrics.update(eval_metrics(name, entry))
        self._save_eval_dump(rollout_id, data, metrics)
        return {**metrics, **extra}

    def _save_eval_dump(self, rollout_id: int, data: dict[str, Any], metrics: dict[str, float]) -> None:
        """Evals dump as rollout id eval_<k>: every dataset's samples in one list, positions per dataset."""
        samples: list[Sample] = []
        datasets: dict[str, list[int]] = {}
        for name, entry in data.items():
            found = [s for s in entry.get("samples", []) if isinstance(s, Sample)]
            datasets[name] = list(range(len(samples), len(samples) + len(found)))
            samples.extend(found)
        self._save_dump(
            f"eval_{rollout_id}", samples, {"kind": "eval", "datasets": datasets, "metrics": metrics}
        )

    async def _eval_dataset(self, name: str) -> dict[str, Any]:
        samples = await generate_eval_samples(
            self.generator,
            self.eval_datasets[name].samples,
            self.job.eval.n_samples_per_eval_prompt,
            eval_sampling_params(self.args),
            seed=self.job.rollout.rollout_seed,
        )
        finished = [s for s in samples if s.status != Status.ABORTED]
        if len(finished) < len(samples):
            logger.warning("eval %s: %d of %d samples were aborted by the engines and are not scored",
                           name, len(samples) - len(finished), len(samples))  # fmt: skip
        return {
            "rewards": [s.get_reward_value(self.job.rollout.reward_key) for s in finished],
            "truncated": [s.status == Status.TRUNCATED for s in finished],
            "samples": finished,
        }


def train_batch_from_groups(
    job: Any, rollout_id: int, groups: list[list[Sample]], producer: str
) -> tuple[TrainBatch, list[float], list[list[Sample]]]:
    """Rewarded groups -> (TrainBatch, raw rewards, groups in batch order), as slime's RolloutManager does:
    groups sorted by their first sample's index, raw rewards post-processed per --advantage-estimator.
    Shared by generation and replay (--load-debug-rollout-data), so both train on identical batches."""
    if all(g[0].index is not None for g in groups):
        groups = sorted(groups, key=lambda g: g[0].index)
    samples = [s for g in groups for s in g]
    check_rollout_samples(samples, producer)
    for s in samples:
        s.rollout_id = rollout_id if s.rollout_id is None else s.rollout_id
    raw = [s.get_reward_value(job.rollout.reward_key) for s in samples]
    rewards = _post_process(job.algo, raw, groups, producer)
    return TrainBatch.from_samples(rollout_id, samples, rewards, raw), raw, groups


def _post_process(a: Any, raw: list[float], groups: list[list[Sample]], producer: str) -> list[float]:
    sizes = sorted({len(g) for g in groups})
    grouped = a.advantage_estimator == "rloo" or (
        a.rewards_normalization and a.advantage_estimator not in _UNGROUPED_ESTIMATORS
    )
    if grouped and len(sizes) > 1:
        raise ValueError(
            f"--advantage-estimator {a.advantage_estimator} normalises rewards per prompt group, but the "
            f"groups from {producer} have different sizes {sizes}; make every group the same size"
        )
    rewards = postprocess_rewards(
        a.advantage_estimator,
        torch.tensor(raw, dtype=torch.float64),
        sizes[0],
        rewards_normalization=a.rewards_normalization,
        grpo_std_normalization=a.grpo_std_normalization,
    )
    return rewards.tolist()


async def _call_soon(fn, *args) -> Any:
    """Run a plain function on the manager's event loop (the router's state belongs to that loop)."""
    return fn(*args)


async def _with_deadline(coroutine: Coroutine[Any, Any, Any], timeout_s: float, what: str) -> Any:
    """Run `coroutine`; past `timeout_s` cancel it (letting it clean up) and raise one clear TimeoutError."""
    task = asyncio.ensure_future(coroutine)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its cleanup aborts leftover requests
    raise TimeoutError(f"RolloutManager.{what} did not finish within {timeout_s} s (rollout_timeout_s)")


def _num_devices(num_rollout_gpus: int | None, job: Any, engine_urls: list[str]) -> int:
    """Devices that generated, for perf/tokens_per_gpu_per_sec; CPU engines count one each."""
    if num_rollout_gpus is None:
        num_rollout_gpus = job.resources.rollout_num_gpus
    return num_rollout_gpus if num_rollout_gpus else max(len(engine_urls), 1)


def _load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"cannot load the tokenizer from {path!r} (--hf-checkpoint / tokenizer_path): {error}"
        ) from None


def engine_busy_metrics(
    before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None, rollout_s: float
) -> dict[str, float]:
    """How busy the engines were during a rollout, from their step counters before and after, as means over
    the engines: seconds inside the engine step (perf/engine_busy_time), its share of the rollout
    (perf/engine_busy_ratio), steps (perf/engine_steps); and, where an engine counts them, the engine
    thread's CPU seconds inside its steps (perf/engine_step_cpu_time), its process's CPU seconds, all threads
    (perf/engine_process_cpu_time), the engine thread's seconds waiting for work with nothing to step
    (perf/engine_idle_time) and applying commands (perf/engine_command_time), seconds blocked on the GPU
    (perf/engine_gpu_wait_time) and the steps' span on the GPU (perf/engine_gpu_time). Empty when an engine
    reports no counters (external SGLang servers) or one was replaced meanwhile."""
    if not before or not after or set(before) != set(after) or rollout_s <= 0:
        return {}
    steps = [after[url]["steps"] - before[url]["steps"] for url in after]
    if min(steps) < 0 or any(after[url]["busy_s"] < before[url]["busy_s"] for url in after):
        return {}  # a restarted engine's counters began again

    def mean_delta(key: str) -> float | None:
        if not all(key in after[url] and key in before[url] for url in after):
            return None
        return sum(after[url][key] - before[url][key] for url in after) / len(after)

    mean_busy = mean_delta("busy_s")
    metrics = {
        "perf/engine_busy_time": mean_busy,
        "perf/engine_busy_ratio": mean_busy / rollout_s,
        "perf/engine_steps": sum(steps) / len(steps),
    }
    names = {"cpu_s": "perf/engine_step_cpu_time", "process_cpu_s": "perf/engine_process_cpu_time",
             "idle_s": "perf/engine_idle_time", "command_s": "perf/engine_command_time",
             "wait_s": "perf/engine_gpu_wait_time", "gpu_s": "perf/engine_gpu_time"}  # fmt: skip
    for key, name in names.items():
        value = mean_delta(key)
        if value is not None:
            metrics[name] = value
    return metrics
