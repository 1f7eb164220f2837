"""Run: the live pieces of one training job, started in order, with one method per loop step.

    run = Run.start(job)          # Ray, placement, engines, rollout manager, trainer ranks, metric logger
    run.sync_weights(version)     # trainer -> engines (+ checksum check with --check-weight-update-equal)
    batch, m = run.generate(k)    # rollout k (RolloutManager actor over HTTP to the engines)
    m = run.train(batch)          # trainer ranks
    run.eval(k) ; run.save(k) ; run.log(k, m) ; run.close()

The loops (sync.py, async_.py) call these and nothing else, so each fits on one screen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from clawrl.cluster.engine_actor import EngineActor
from clawrl.cluster.placement import PlacementPlan, plan_placement
from clawrl.cluster.ray_cluster import actor_options, cluster_gpus, reserve, start_ray
from clawrl.cluster.train_group import TrainGroup
from clawrl.config.job import JobConfig

logger = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 600.0
# Colocated engines get their memory back in two phases, as slime does: weights for the sync, then what
# generation needs. Every released tag must come back, or the engine holds requests forever.
SYNC_MEMORY_TAGS = ("weights",)
GENERATION_MEMORY_TAGS = ("kv_cache", "cuda_graph")
ROLLOUT_TIMEOUT_S = 3600.0


@dataclass
class Run:
    job: JobConfig
    plan: PlacementPlan
    engines: list
    engine_urls: list[str]
    manager: Any
    trainer: TrainGroup
    metrics: Any
    num_rollout: int

    # --------------------------------------------------------------------------------------- start
    @classmethod
    def start(cls, job: JobConfig) -> Run:
        start_ray(job.resources.ray_address)
        plan = plan_placement(job.resources, cluster_gpus=cluster_gpus())
        group = reserve(plan)
        threads = (
            1 if plan.mode == "cpu" else None
        )  # 2-core CPU runs: one thread per process, no oversubscription
        engines = [
            EngineActor.options(**actor_options(group, slot, plan.engine_gpu_fraction)).remote(
                engine_config(job, plan, i), num_threads=threads
            )
            for i, slot in enumerate(plan.engine_slots)
        ]
        urls = _wait_all([e.start.remote() for e in engines], "engine start", ENGINE_START_TIMEOUT_S)
        from clawrl.metrics.logger import MetricLogger
        from clawrl.rollout.manager import RolloutManager

        manager = ray.remote(RolloutManager).options(num_cpus=0).remote(
            job, urls, num_rollout_gpus=max(plan.num_engines, 1)
        )  # fmt: skip
        trainer = TrainGroup(job, plan, group, num_threads=threads)
        num_rollout = job.rollout.num_rollout or ray.get(manager.num_rollout_for_epochs.remote())
        metrics = MetricLogger(
            job.logging.output_dir, run_name=job.logging.run_name, config=job.to_dict(),
            use_tensorboard=job.logging.use_tensorboard, use_wandb=job.logging.use_wandb,
            wandb_project=job.logging.wandb_project, wandb_group=job.logging.wandb_group,
            wandb_key=job.logging.wandb_key, wandb_mode=job.logging.wandb_mode or "offline",
            resume=bool(job.model.load), checks=_checks(job),
        )  # fmt: skip
        return cls(job, plan, engines, urls, manager, trainer, metrics, num_rollout)

    # --------------------------------------------------------------------------------------- steps
    def init_trainer(self) -> int:
        """Build the trainer; restore the data cursor from the checkpoint; returns the first rollout id."""
        steps_per_rollout = self.job.train.num_steps_per_rollout or 1
        start = self.trainer.init(self.num_rollout * steps_per_rollout)
        if start > 0:
            extra = self.trainer.call("loaded_extra")[0]
            ray.get(self.manager.load_state_dict.remote(extra.get("rollout", {})))
        return start

    def generate(self, rollout_id: int):
        return ray.get(self.manager.generate.remote(rollout_id), timeout=ROLLOUT_TIMEOUT_S)

    def generate_async(self, rollout_id: int):
        """Start rollout `rollout_id`; `ray.get` the returned ref for (batch, metrics)."""
        return self.manager.generate.remote(rollout_id)

    def train(self, batch) -> dict[str, Any]:
        """Train on one rollout; with --colocate the engines first free the GPU (and the trainer takes it)."""
        res = self.job.resources
        if self.plan.mode == "colocate" and res.offload_rollout:
            self._engines_call("release_memory_occupation", [*SYNC_MEMORY_TAGS, *GENERATION_MEMORY_TAGS])
        if self.plan.mode == "colocate" and res.offload_train:
            self.trainer.call("onload")
        metrics = self.trainer.train(batch)
        if self.plan.mode == "colocate" and res.offload_train:
            self.trainer.call("offload")
        return metrics

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine as weight version `version`.

        Released engines (colocate) get their weights memory back first and their KV cache only after the
        sync, so the trainer's gathered buckets never share the GPU with a KV cache. Returns
        perf/update_weights_time (the transfer, version flip included), perf/engine_resume_time and, with
        --check-weight-update-equal, perf/check_weight_update_time.
        """
        from clawrl.weight_sync import transport_for, verify_engine_weights

        released = self.plan.mode == "colocate" and self.job.resources.offload_rollout
        resume_s = 0.0
        if released:
            resume_s += timed(self._engines_call, "resume_memory_occupation", list(SYNC_MEMORY_TAGS))[1]
        metrics = self.trainer.update_weights(transport_for(self.plan, self.engine_urls), str(version))
        if self.job.ci.check_weight_update_equal:
            start = time.perf_counter()
            checksums = self.trainer.call("checksums", self.trainer_engine_dtype())[0]
            verify_engine_weights(self.engine_urls, checksums, expected_version=str(version))
            metrics["perf/check_weight_update_time"] = time.perf_counter() - start
        if released:
            resume_s += timed(self._engines_call, "resume_memory_occupation", list(GENERATION_MEMORY_TAGS))[1]
            metrics["perf/engine_resume_time"] = resume_s
        return metrics

    def _engines_call(self, route: str, *args) -> None:
        engines_call(self.engine_urls, route, *args)

    def trainer_engine_dtype(self):
        import torch

        return torch.float32 if self.plan.mode == "cpu" else torch.bfloat16

    def eval(self, rollout_id: int) -> dict[str, float]:
        if not self.job.eval.eval_prompt_data:
            return {}
        return ray.get(self.manager.eval.remote(rollout_id), timeout=ROLLOUT_TIMEOUT_S)

    def save(self, rollout_id: int) -> None:
        """Checkpoint after rollout `rollout_id`; the data cursor is the one rollout `rollout_id + 1` starts at."""
        state = ray.get(self.manager.state_dict.remote(before_rollout=rollout_id + 1))
        self.trainer.call("save", rollout_id, {"rollout": state})

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        from clawrl.metrics.progress import format_progress

        flat = self.metrics.log(rollout_id, metrics)
        line = format_progress(rollout_id, self.num_rollout, flat)
        if rollout_id >= self.num_rollout:  # the final eval row
            line = line.replace(f"[rollout {rollout_id + 1}/{self.num_rollout}]", "[final weights]")
        print(line, flush=True)

    def close(self) -> None:
        self.metrics.close()
        for engine in self.engines:
            ray.get(engine.stop.remote(), timeout=60)
        self.trainer.call("shutdown")


def engines_call(urls: list[str], route: str, *args, timeout_s: float = 300.0) -> None:
    """Call one control route (release/resume memory, ...) on every engine, with a deadline each."""
    from clawrl.engine.client import EngineClient

    for url in urls:
        getattr(EngineClient(url, timeout=timeout_s), route)(*args)


def engine_config(job: JobConfig, plan: PlacementPlan, index: int) -> dict:
    """EngineConfig fields for engine `index` of the job."""
    on_gpu = plan.mode != "cpu"
    # Without --rollout-max-prompt-len prompts may be as long as the model allows: its own context length.
    prompt_len, response_len = job.data.rollout_max_prompt_len, job.rollout.rollout_max_response_len
    context = prompt_len + (response_len or 1024) if prompt_len else None
    return {
        "model_path": job.model.hf_checkpoint,
        "device": "cuda" if on_gpu else "cpu",
        "dtype": "bfloat16" if on_gpu else "float32",
        "mem_fraction_static": 0.4 if plan.mode == "colocate" else 0.85,
        "context_length": context,
        "seed": job.rollout.rollout_seed + index,
        "enable_cuda_graph": on_gpu,
    }


def _checks(job: JobConfig) -> list:
    """--ci-test: assertions that watch the metric stream (the training code has no CI branches)."""
    ci = job.ci
    if not ci.ci_test:
        return []
    from clawrl.metrics.checks import CITestChecks, MetricThresholdCheck

    checks = [
        CITestChecks(
            check_kl=not ci.ci_disable_kl_checker,
            logprob_abs_diff_threshold=ci.ci_train_rollout_logprob_abs_diff_threshold,
        )
    ]
    if ci.ci_metric_checker_key is not None:
        checks.append(MetricThresholdCheck(ci.ci_metric_checker_key, ci.ci_metric_checker_threshold))
    return checks


def _wait_all(refs: list, what: str, timeout_s: float) -> list:
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        raise TimeoutError(f"{what}: {len(pending)} of {len(refs)} did not finish within {timeout_s:.0f} s")
    return ray.get(refs)


def periodic(rollout_id: int, interval: int | None, num_rollout: int | None = None) -> bool:
    """slime's should_run_periodic_action: every `interval` rollouts, and at the last one if `num_rollout`."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    return (rollout_id + 1) % interval == 0


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start
