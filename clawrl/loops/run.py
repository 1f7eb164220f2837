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
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from clawrl.cluster.deadline import ActorInfo, wait_all
from clawrl.cluster.engine_pool import EnginePool
from clawrl.cluster.external_engines import ExternalEnginePool, sync_from_disk
from clawrl.cluster.health import EngineHealthMonitor
from clawrl.cluster.placement import PlacementPlan, plan_placement
from clawrl.cluster.ray_cluster import Reservation, cluster_gpus, reserve, start_ray, stop_ray
from clawrl.cluster.rollout_actor import RolloutManagerActor
from clawrl.cluster.startup import StartupClock, early_init_steps, optimizer_steps
from clawrl.cluster.train_group import TrainGroup
from clawrl.config.engine import GENERATION_MEMORY_TAGS, MEMORY_TAGS, SYNC_MEMORY_TAGS, engine_dtype
from clawrl.config.fault import FaultSpec
from clawrl.config.job import JobConfig
from clawrl.metrics.timer import timed
from clawrl.trainer.train_dump import TRAIN_RECORDS_KEY

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from clawrl.metrics.logger import MetricLogger
    from clawrl.rollout.replay import ReplaySource

logger = logging.getLogger(__name__)

EARLY_ONLOAD_HEADROOM = 0.05
"""Share of the GPU's memory the trainer leaves free when it onloads beside generating engines (their
allocations outside the KV cache, e.g. a long prefill's activations)."""


@dataclass(kw_only=True)
class Run:
    """What `start` opened, in the order it opened it; `close` ends each of them."""

    job: JobConfig
    """The validated job."""
    plan: PlacementPlan
    """Where the trainer ranks and engines run."""
    reservation: Reservation | None = None
    """The job's placement group; None on CPU on one node (actors go anywhere)."""
    pool: EnginePool | ExternalEnginePool | None = None
    """The engine actors (--rollout-external-engine-addrs: the servers there); None with --debug-train-only."""
    manager: ActorHandle | None = None
    """The RolloutManagerActor; None with --debug-train-only."""
    trainer: TrainGroup | None = None
    """None with --debug-rollout-only (no trainer process is started)."""
    metrics: MetricLogger | None = None
    """metrics.jsonl (+ tensorboard, wandb) and the checks that watch it."""
    num_rollout: int = 0
    """Rollouts the run makes (--num-rollout, or counted from --num-epoch or the dumps)."""
    replay: ReplaySource | None = None
    """--load-debug-rollout-data: rollouts come from dumps, not from engines."""
    monitor: EngineHealthMonitor | None = None
    """--use-fault-tolerance: checks the engines while rollouts run and replaces failed ones."""
    manager_info: list[ActorInfo] = field(default_factory=list)
    """(pid, node) of the rollout manager, for stack dumps."""
    engine_version: int = 0
    """Weight version the engines serve."""
    trainer_version: int = 0
    """Weight version the trainer holds (ahead of the engines between a train step and the next sync)."""
    _trainer_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held during a train step and a recovery's weight sync (one of them at a time)."""
    _fault: FaultSpec | None = None
    """--fault-injection, until it is armed."""
    _restarts_logged: int = 0
    """Engine restarts already counted in an earlier metrics row."""
    _trainer_weights_resident: bool = False
    """Colocated: train() offloaded all but the weights, which the next sync reads and then offloads."""
    _early_onload: list | None = None
    """Colocated: the trainer ranks' onload calls started with the rollout (`_start_early_onload`)."""
    _clock: StartupClock | None = None
    """Prints the start-up phases until the first weight sync ends them (then None)."""
    _manager_began: float = 0.0
    """time.monotonic() when the rollout manager's actor was created."""
    _owns_ray: bool = False
    """Run.start initialised Ray in this process (not a caller's ray.init): close() shuts it down, so a run
    started from Python leaves the process as it found it."""

    # --------------------------------------------------------------------------------------- start
    @classmethod
    def start(cls, job: JobConfig) -> Run:
        """Start the job's parts. Engines, the rollout manager's process and the trainer ranks start at once;
        the driver waits for the engines (watching the trainer meanwhile) and connects the manager to them;
        `init_trainer` then waits for the trainer's model and optimizer, which were built meanwhile."""
        d = job.debug
        clock = StartupClock()
        owns_ray = start_ray(job.resources.ray_address)
        clock.phase("Ray ready", clock.began)
        try:
            plan = plan_placement(
                job.resources, cluster_gpus=cluster_gpus(), trainer=not d.debug_rollout_only,
                engines=not d.debug_train_only and not job.resources.rollout_external_engine_addrs,
            )  # fmt: skip
        except BaseException:
            if owns_ray:
                stop_ray()
            raise
        run = cls(job=job, plan=plan, _clock=clock, _owns_ray=owns_ray)
        threads = 1 if plan.mode == "cpu" else None  # 2-core CPU runs: one thread per process
        try:
            run.reservation = group = reserve(plan)
            if d.dump_details:
                _save_tokenizer(job.model.hf_checkpoint, d.dump_details)
            run._launch(group, threads)
            run._connect_rollout_side()
            run.metrics = _metric_logger(job)
            run._start_monitor()
        except BaseException:
            run.close()
            raise
        return run

    def _launch(self, group: Reservation | None, threads: int | None) -> None:
        """Start every actor of the job without waiting for any to load (only for the trainer ranks'
        processes to answer): the engines, the rollout manager's process (it imports the rollout code
        meanwhile and connects to the engines later) and the trainer ranks with their model build."""
        job, plan = self.job, self.plan
        if job.debug.debug_train_only:
            from clawrl.rollout.replay import ReplaySource

            logger.info("--debug-train-only: no engines; rollouts are read from %s",
                        job.debug.load_debug_rollout_data)  # fmt: skip
            self.replay = ReplaySource(job)
            self.num_rollout = self.replay.num_rollout()
        elif job.resources.rollout_external_engine_addrs:  # running already: checked in _connect_rollout_side
            self.pool = ExternalEnginePool(job.resources.rollout_external_engine_addrs,
                                           hf_checkpoint=job.model.hf_checkpoint)  # fmt: skip
        else:
            configs = [engine_config(job, plan, i) for i in range(plan.num_engines)]
            self.pool = EnginePool(configs, group, plan.engine_slots, plan.engine_gpu_fraction,
                                   num_threads=threads, multi_node=bool(job.resources.multi_node))  # fmt: skip
            self.pool.launch(job.fault.engine_start_timeout)
        if self.pool is not None:
            self._manager_began = time.monotonic()
            self.manager = RolloutManagerActor.options(num_cpus=0, max_concurrency=4).remote(job)
        if job.debug.debug_rollout_only:
            logger.info("--debug-rollout-only: no trainer; training, saving and weight sync are skipped")
            return
        self.trainer = TrainGroup(job, plan, group, num_threads=threads)
        steps = early_init_steps(plan, job.train, self.num_rollout or job.rollout.num_rollout)
        self.trainer.begin(steps)

    def _connect_rollout_side(self) -> None:
        """Wait for the engines (a trainer rank that fails or runs late meanwhile ends the start at once),
        connect the rollout manager to them, count the rollouts; then send the trainer's model build if it
        had to wait for those."""
        if self.pool is not None:
            watch = self.trainer.check if self.trainer is not None else None
            if isinstance(self.pool, ExternalEnginePool):  # running already: discovered and checked here
                began = time.monotonic()
                urls, ready_at = self.pool.start(self.job.fault.engine_start_timeout), None
            else:
                began = self.pool.began
                urls, ready_at = self.pool.wait_started(watch), self.pool.ready_at
            self._clock.phase(f"{len(urls)} engine(s) ready", began, ready_at)
            self._connect_manager(urls, watch)
        if self.trainer is not None and not self.trainer.init_begun:
            # With --colocate the engines have now sized their KV caches: the trainer may take its share.
            self.trainer.begin_init(optimizer_steps(self.job.train, self.num_rollout))

    def _connect_manager(self, urls: list[str], watch: Callable[[], None] | None) -> None:
        f = self.job.fault
        where = self.manager.where.remote()
        connected = self.manager.connect.remote(urls, num_rollout_gpus=max(len(urls), 1))
        pid, node = self._wait([where], "rollout manager start", f.engine_start_timeout, poll=watch)[0]
        self.manager_info = [ActorInfo("rollout manager", pid, node)]
        self._wait([connected], "rollout manager start", f.engine_start_timeout, poll=watch)
        self._clock.phase("rollout manager ready", self._manager_began)
        self.num_rollout = self.job.rollout.num_rollout
        if not self.num_rollout:
            count = self.manager.num_rollout_for_epochs.remote()
            self.num_rollout = self._wait([count], "counting prompts", f.rollout_timeout, poll=watch)[0]
        if f.fault_injection:
            self._fault = FaultSpec.parse(f.fault_injection)

    def _start_monitor(self) -> None:
        f = self.job.fault
        if self.pool is None or not f.use_fault_tolerance:
            return
        self.monitor = EngineHealthMonitor(
            lambda: list(self.pool.urls), self._recover, interval_s=f.rollout_health_check_interval,
            timeout_s=f.rollout_health_check_timeout, first_wait_s=f.rollout_health_check_first_wait,
        )  # fmt: skip
        self.monitor.start()

    @property
    def engine_urls(self) -> list[str]:
        return list(self.pool.urls) if self.pool is not None else []

    def actor_infos(self) -> list[ActorInfo]:
        """Every actor of the job, for stack dumps when a deadline fires."""
        engines = self.pool.actor_infos() if self.pool is not None else []
        trainer = self.trainer.infos if self.trainer is not None else []
        return [*engines, *self.manager_info, *trainer]

    def _wait(self, refs: list, what: str, timeout_s: float, owner: str = "the rollout manager",
              poll: Callable[[], None] | None = None) -> list:  # fmt: skip
        return wait_all(refs, what, timeout_s, self.actor_infos(), [owner] * len(refs), poll)

    # --------------------------------------------------------------------------------------- steps
    def init_trainer(self) -> int:
        """Wait for the trainer's model and optimizer (built while the engines loaded, or sent now); restore
        the data cursor from the checkpoint; returns the first rollout id."""
        if self.trainer is None:
            return 0
        start = self.trainer.init(optimizer_steps(self.job.train, self.num_rollout))
        if start > 0:
            logger.info(
                "resumed from the checkpoint in %s: continuing at rollout %d", self.job.model.load, start
            )
            extra = self.trainer.loaded_extra()
            if self.manager is not None:
                self._wait([self.manager.load_state_dict.remote(extra.get("rollout", {}))], "data cursor", 60)
        self.engine_version = self.trainer_version = start
        if self._clock is not None:
            self._clock.phase(f"trainer ready: {self.plan.num_trainer_ranks} rank(s), model and optimizer built",
                              self.trainer.began, self.trainer.ready_at)  # fmt: skip
        return start

    def generate(self, rollout_id: int):
        """Rollout `rollout_id`: (TrainBatch, metrics)."""
        return self.wait_rollout(self.generate_async(rollout_id), rollout_id)

    def generate_async(self, rollout_id: int):
        """Start rollout `rollout_id`; `wait_rollout` the returned ref for (batch, metrics)."""
        if self.replay is not None:
            return ray.put(self.replay.generate(rollout_id))
        if self.monitor is not None:
            self.monitor.resume()
        self._arm_fault(rollout_id)
        ref = self.manager.generate.remote(rollout_id)
        self._start_early_onload()
        return ref

    def _start_early_onload(self) -> None:
        """Colocated with --offload-train: the trainer brings its state back to the GPU while the engines
        generate, where the GPU has room for both (the engines size their KV cache to leave the trainer
        1 - --sglang-mem-fraction-static of it), so the copies are off the step's critical path. A trainer
        that had that room keeps its state on the GPU after the step (`train`): this is then a no-op."""
        res = self.job.resources
        if (self.trainer is None or self.plan.mode != "colocate" or not res.offload_train
                or res.disable_onload_during_rollout or self._early_onload is not None):  # fmt: skip
            return
        if not self._trainer_lock.acquire(blocking=False):
            return  # an engine is being replaced: it sizes its KV cache from the free memory right now
        try:
            self._early_onload = self.trainer.start_onload_if_room(EARLY_ONLOAD_HEADROOM)
        finally:
            self._trainer_lock.release()

    def wait_rollout(self, ref, rollout_id: int):
        """(batch, metrics) of a started rollout, within --rollout-timeout. A failed engine recovery ends the
        wait at once: the rollout may be waiting for the engine that could not be replaced."""
        from clawrl.metrics.progress import ProgressBar, poll_rollout_progress

        bar = ProgressBar(
            f"rollout {rollout_id + 1}/{self.num_rollout}", interval_s=self.job.logging.progress_interval_s
        )

        def poll() -> None:  # about once a second: the progress bar, and a failed engine recovery
            self._raise_monitor_error()
            if self.manager is not None:
                poll_rollout_progress(self.manager, bar)

        try:
            batch, metrics = wait_all([ref], f"rollout {rollout_id}", self.job.fault.rollout_timeout,
                                      self.actor_infos(), ["the rollout manager"], poll=poll)[0]  # fmt: skip
            if self.manager is not None:  # the totals of a rollout that outlasted one interval
                poll_rollout_progress(self.manager, bar, final=True)
        finally:
            bar.close()
        self._raise_monitor_error()
        return batch, metrics

    def _arm_fault(self, rollout_id: int) -> None:
        """--fault-injection: from rollout K on, the manager breaks the engine once, right after it has
        sent it a request (so requests are in flight on it when it dies or freezes)."""
        spec = self._fault
        if spec is None or rollout_id < spec.rollout:
            return
        self._fault = None
        url, actor = self.pool.urls[spec.engine], self.pool.actors[spec.engine]
        self._wait([self.manager.arm_fault.remote(url, actor, spec.mode)], "arming the fault injection", 60)
        logger.warning("fault injection: engine %d will be %s during rollout %d", spec.engine,
                       "killed" if spec.mode == "kill" else "frozen", rollout_id)  # fmt: skip

    def _recover(self, index: int, reason: str) -> None:
        """Health monitor thread: replace engine `index`, load the trainer's current weights into it (checked
        with --check-weight-update-equal), then route to it. In-flight requests were re-sent meanwhile."""
        f, timings = self.job.fault, {}
        old = self.pool.urls[index]
        with self._trainer_lock:  # the new engine sizes its KV cache from the free memory: the trainer's out
            if self._early_onload is not None:
                started, self._early_onload = self._early_onload, None
                self.trainer.undo_onload(started)
            new, timings["restart"] = timed(self.pool.restart, index, f.engine_start_timeout)
        if self.trainer is not None:
            timings["resync"] = timed(self._resync, new)[1]
        self._wait([self.manager.replace_engine.remote(old, new)], "routing to the new engine", 60)
        logger.warning(
            "engine %d recovered (%s): restart %.1f s, weight sync %.1f s, now serving at %s",
            index, reason.split(";")[0][:120], timings["restart"], timings.get("resync", 0.0), new,
        )  # fmt: skip

    def _resync(self, url: str) -> None:
        """Load the trainer's current weights into the restarted engine at `url` (and check them)."""
        with self._trainer_lock:  # not during a train step: the version label must match the weights
            self._push_weights([url], self.trainer_version)

    def _raise_monitor_error(self) -> None:
        if self.monitor is not None and self.monitor.error is not None:
            error, self.monitor.error = self.monitor.error, None
            raise RuntimeError(f"engine recovery failed: {error}") from error

    def train(self, batch) -> dict[str, Any]:
        """Train on one rollout; with --colocate the engines first free the GPU (and the trainer takes it)."""
        if self.trainer is None:
            return {}
        res = self.job.resources
        colocated = self.plan.mode == "colocate"
        moves: dict[str, float] = {}  # seconds of the memory hand-overs, logged beside the train phases
        if colocated and res.offload_rollout:
            self._pause_monitor()  # released engines cannot generate: no health checks until the sync
            if self.monitor is not None:
                self.monitor.check_now()  # a dead engine is replaced now, while it can still be resynced
            moves["perf/engine_release_time"] = timed(lambda: release_engine_memory(
                self.engine_urls, MEMORY_TAGS, timeout_s=self.job.fault.update_weights_timeout))[1]  # fmt: skip
        with self._trainer_lock:
            if colocated and res.offload_train:
                started, self._early_onload = self._early_onload, None
                early, moves["perf/trainer_onload_time"] = timed(self.trainer.finish_onload, started)
                moves["perf/trainer_onload_early"] = float(early)
            metrics = self.trainer.train(batch)
            if colocated and res.offload_train:
                # The weights stay for the sync that follows (sync_weights offloads them after it): it reads
                # them on the device instead of copying them back from the host for it. A trainer whose
                # state fitted beside the generating engines (and still does) keeps all of it instead.
                if early:
                    kept, moves["perf/trainer_offload_time"] = timed(self.trainer.offload_after_step)
                else:
                    kept = False
                    moves["perf/trainer_offload_time"] = timed(
                        lambda: self.trainer.offload(keep_weights=True)
                    )[1]
                moves["perf/trainer_stays_resident"] = float(kept)
                self._trainer_weights_resident = not kept
            self.trainer_version += 1
        metrics.update(moves)
        records = metrics.pop(TRAIN_RECORDS_KEY, None)
        if records is not None:
            self._save_train_dump(batch.rollout_id, records, metrics)
        return metrics

    def _pause_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.pause()
            self._raise_monitor_error()

    def _save_train_dump(self, rollout_id: int, records: list, metrics: dict[str, Any]) -> None:
        from clawrl.debug.dump import dump_path, save_train_dump

        payload = {
            "format_version": 1, "kind": "clawrl-train-data", "rollout_id": rollout_id,
            "world_size": self.plan.num_trainer_ranks, "samples": records,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "optimizer_steps": [dict(step) for step in metrics.get("train", [])],
        }  # fmt: skip
        path = save_train_dump(dump_path(self.job.debug.save_debug_train_data, rollout_id), payload)
        logger.info("rollout %d: train data of %d samples dumped to %s", rollout_id, len(records), path)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine as weight version `version`.

        Released engines (colocate) get their weights memory back first and their KV cache only after the
        sync, so the trainer's gathered buckets never share the GPU with a KV cache. Returns
        perf/update_weights_time (the transfer, version flip included), perf/engine_resume_time and, with
        --check-weight-update-equal, perf/check_weight_update_time.
        """
        if self.trainer is None or self.pool is None:  # a half-run: nothing to sync
            return {}
        began = time.monotonic()
        self._pause_monitor()  # a recovery in progress finishes first; no checks while weights change
        if self.monitor is not None and not self._released():
            self.monitor.check_now()  # every engine must be alive to take the new weights
        released = self._released()
        resume_s = 0.0
        if released:
            resume_s += timed(self._resume_engines, SYNC_MEMORY_TAGS)[1]
        metrics = self._push_weights(self.engine_urls, version)
        if self._trainer_weights_resident:  # colocated: what train() kept for this sync leaves now
            with self._trainer_lock:
                metrics["perf/trainer_weights_offload_time"] = timed(self.trainer.offload)[1]
            self._trainer_weights_resident = False
        if released:
            resume_s += timed(self._resume_engines, GENERATION_MEMORY_TAGS)[1]
            metrics["perf/engine_resume_time"] = resume_s
        self.engine_version = version
        if self._clock is not None:
            self._clock.phase("weights synced to the engines", began)
            self._clock.done()
            self._clock = None
        return metrics

    def _push_weights(self, urls: list[str], version: int) -> dict[str, float]:
        """The trainer's weights to the engines at `urls` as `version` (with --check-weight-update-equal,
        also perf/check_weight_update_time): through the HF directory of --update-weight-transport disk,
        else the transport of the placement (external engines: SGLang's broadcast payloads)."""
        from clawrl.config.engine import engine_dtype
        from clawrl.weight_sync.cycle import Transport

        m, timeout = self.job.model, self.job.fault.update_weights_timeout
        verify = self.job.ci.check_weight_update_equal
        if m.update_weight_transport == "disk":
            return sync_from_disk(
                self.trainer, urls, str(version), disk_dir=m.update_weight_disk_dir,
                keep_files=m.update_weight_disk_keep_files, verify=verify, timeout_s=timeout,
                export_dtype=engine_dtype("cpu" if self.plan.mode == "cpu" else "cuda"),  # what checksums use
            )  # fmt: skip
        if isinstance(self.pool, ExternalEnginePool):
            kind = self.pool.weight_transport
        else:
            kind = "broadcast" if m.update_weight_transport == "distributed" else self.plan.weight_transport
        return self.trainer.update_weights(Transport(kind=kind, engine_urls=urls), str(version), timeout,
                                           self.pool.actor_infos(), verify=verify)  # fmt: skip

    def _released(self) -> bool:
        """Whether the engines released their memory for training (colocated with offload)."""
        return self.plan.mode == "colocate" and self.job.resources.offload_rollout

    def _resume_engines(self, tags: tuple[str, ...]) -> None:
        resume_engine_memory(self.engine_urls, tags, timeout_s=self.job.fault.update_weights_timeout)

    def eval(self, rollout_id: int) -> dict[str, float]:
        if not self.job.eval.eval_prompt_data or self.manager is None:
            return {}
        if self.monitor is not None:
            self.monitor.resume()
        return self._wait(
            [self.manager.eval.remote(rollout_id)], f"eval {rollout_id}", self.job.fault.rollout_timeout
        )[0]

    def save_due(self, rollout_id: int) -> bool:
        """--save / --save-hf: after every --save-interval rollouts and after the last one."""
        model = self.job.model
        if not (model.save or model.save_hf):
            return False
        return rollout_id == self.num_rollout - 1 or periodic(rollout_id, model.save_interval)

    def save(self, rollout_id: int) -> None:
        """After rollout `rollout_id`: the --save checkpoint (its data cursor is the one rollout
        `rollout_id + 1` starts at; its meta.json records the job config, which `clawrl convert-checkpoint`
        reads) and the --save-hf export."""
        from clawrl.config.model import save_hf_path
        from clawrl.metrics.logger import redact

        if self.trainer is None:
            return
        model = self.job.model
        if model.save:
            state = {}
            if self.manager is not None:
                state = self._wait(
                    [self.manager.state_dict.remote(before_rollout=rollout_id + 1)],
                    "rollout state for the checkpoint",
                    self.job.fault.rollout_timeout,
                )[0]
            self.trainer.save(rollout_id, {"rollout": state, "job": redact(self.job.to_dict())})
        if model.save_hf:
            path = save_hf_path(model.save_hf, rollout_id)
            self.trainer.export_hf(path)
            logger.info("rollout %d: HF model written to %s", rollout_id, path)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        if self.monitor is not None and rollout_id < self.num_rollout:
            # restarts finished since the last row: the sync before this row waited for any recovery
            metrics["rollout/engine_restarts"] = float(self.pool.num_restarts - self._restarts_logged)
            self._restarts_logged = self.pool.num_restarts
        from clawrl.metrics.progress import format_progress

        flat = self.metrics.log(rollout_id, metrics)
        line = format_progress(rollout_id, self.num_rollout, flat, on_gpu=self.plan.mode != "cpu")
        if rollout_id >= self.num_rollout:  # the final eval row
            line = line.replace(f"[rollout {rollout_id + 1}/{self.num_rollout}]", "[final weights]")
        print(line, flush=True)

    def close(self) -> None:
        """Close everything that was opened, also after a failed start. On a normal end each part gets a
        minute and the first failure is raised; while an error propagates (a deadline fired, an actor died)
        each gets two seconds, failures are only logged, and the original error stays the one reported."""
        failing = sys.exc_info()[0] is not None
        # Failing: a healthy actor ends within a second; a stuck one (what the deadline caught) never answers
        # and is killed when its grace runs out, so a short grace gets the error to the user sooner.
        grace = 2.0 if failing else 60.0
        errors = []
        steps = [("health monitor", lambda: self.monitor and self.monitor.stop()),
                 ("metrics", lambda: self.metrics and self.metrics.close())]  # fmt: skip
        if self.manager is not None:
            steps.append(("rollout manager", lambda: ray.get(self.manager.close.remote(), timeout=grace)))
        if self.pool is not None:
            steps.append(("engines", lambda: self.pool.stop(grace)))
        if self.trainer is not None:
            steps.append(("trainer", lambda: self.trainer.shutdown(grace if failing else 2 * grace)))
        for what, step in steps:
            try:
                step()
            except Exception as error:  # keep closing the rest
                if not failing:
                    logger.warning("closing the %s failed: %s", what, error)
                errors.append(error)
        if self.manager is not None:
            ray.kill(self.manager, no_restart=True)
        if self.reservation is not None:  # after every actor in it has ended
            ray.util.remove_placement_group(self.reservation.group)
        if self._owns_ray:
            stop_ray()
        if errors and not failing:
            raise errors[0]


def release_engine_memory(urls: list[str], tags: tuple[str, ...], *, timeout_s: float = 300.0) -> None:
    """Every engine frees the memory of `tags` (colocated runs, before training), with a deadline each."""
    from clawrl.engine.http.client import EngineClient

    for url in urls:
        EngineClient(url, timeout=timeout_s).release_memory_occupation(list(tags))


def resume_engine_memory(urls: list[str], tags: tuple[str, ...], *, timeout_s: float = 300.0) -> None:
    """Every engine takes back the memory of `tags`, with a deadline each."""
    from clawrl.engine.http.client import EngineClient

    for url in urls:
        EngineClient(url, timeout=timeout_s).resume_memory_occupation(list(tags))


def engine_config(job: JobConfig, plan: PlacementPlan, index: int) -> dict:
    """EngineConfig fields for engine `index` of the job."""
    from clawrl.engine.config import EngineConfig

    device, flags = "cpu" if plan.mode == "cpu" else "cuda", job.engine
    # Without --rollout-max-prompt-len prompts may be as long as the model allows: its own context length.
    prompt_len, response_len = job.data.rollout_max_prompt_len, job.rollout.rollout_max_response_len
    context = prompt_len + (response_len or 1024) if prompt_len else None
    config = {
        "model_path": job.model.hf_checkpoint,
        "model_impl": "hf"
        if job.model.model_impl == "hf"
        else "auto",  # --model-impl hf: transformers in both
        "device": device,
        "dtype": engine_dtype(device),
        "mem_fraction_static": flags.sglang_mem_fraction_static or (0.4 if plan.mode == "colocate" else 0.85),
        "context_length": flags.sglang_context_length or context,
        "seed": job.rollout.rollout_seed + index,
        "enable_cuda_graph": device == "cuda" and not flags.sglang_disable_cuda_graph,
        "enable_prefix_caching": not flags.sglang_disable_radix_cache,
        "attention_backend": flags.attention_backend,
        "true_on_policy_mode": job.model.uses_true_on_policy,
        "tp_size": plan.engine_tp_size,
        # Released engines of a colocated run get every weight from the sync that follows each resume: no
        # host copy of the weights on release and resume (0.5-3 GB each way per train step).
        "weights_cpu_backup": not (plan.mode == "colocate" and job.resources.offload_rollout),
        **flags.sizing(),
    }
    if flags.sglang_max_total_tokens is not None:
        page = config.get("block_size", EngineConfig.__dataclass_fields__["block_size"].default)
        config["num_kv_blocks"] = -(-flags.sglang_max_total_tokens // page)  # whole pages, rounded up
    return config


def _metric_logger(job: JobConfig):
    from clawrl.metrics.logger import MetricLogger

    log = job.logging
    return MetricLogger(
        log.output_dir, run_name=log.run_name, config=job.to_dict(), use_tensorboard=log.use_tensorboard,
        use_wandb=log.use_wandb, wandb_project=log.wandb_project, wandb_group=log.wandb_group,
        wandb_key=log.wandb_key, wandb_mode=wandb_mode(log.wandb_mode),
        resume=bool(job.model.load), checks=_checks(job),
    )  # fmt: skip


def wandb_mode(flag: str | None) -> str:
    """--wandb-mode if given, else the WANDB_MODE environment variable, else online (as --help says)."""
    return flag or os.environ.get("WANDB_MODE") or "online"


def _save_tokenizer(model_dir: str | None, dump_dir: str) -> None:
    """--dump-details: the tokenizer beside the dumps, so the directory alone can be read and replayed."""
    if not model_dir:
        return
    from transformers import AutoTokenizer

    out = os.path.join(dump_dir, "tokenizer")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    logger.info("--dump-details: tokenizer saved to %s", out)


def _checks(job: JobConfig) -> list:
    """Checks that watch the metric stream (--ci-test, --ci-*-grad-norm, the text check); no CI branches."""
    from clawrl.metrics.checks import build_checks

    return build_checks(job)


def periodic(rollout_id: int, interval: int | None, num_rollout: int | None = None) -> bool:
    """slime's should_run_periodic_action: every `interval` rollouts, and at the last one if `num_rollout`."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    return (rollout_id + 1) % interval == 0
