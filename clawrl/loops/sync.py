"""The synchronous RL loop (`clawrl train`): generate -> train -> sync weights, one rollout at a time.

clawrl train --hf-checkpoint DIR --prompt-data train.jsonl --rollout-batch-size 8 --num-rollout 10 ...
"""

from __future__ import annotations

from clawrl.config.job import JobConfig
from clawrl.loops.run import Run, periodic
from clawrl.metrics.timer import timed


def train(job: JobConfig) -> None:
    run = Run.start(job)
    try:
        start = run.init_trainer()
        run.sync_weights(version=start)  # engines serve the trainer's (possibly resumed) weights
        # Row k's eval measures the weights after k updates (those that generate rollout k); the final
        # weights get a row of their own, step num_rollout.
        pending_eval = first_eval(run, job, start)
        for rollout_id in range(start, run.num_rollout):
            metrics, pending_eval = pending_eval, {}
            (batch, rollout_metrics), metrics["perf/rollout_time"] = timed(run.generate, rollout_id)
            metrics.update(rollout_metrics)
            train_metrics, metrics["perf/train_time"] = timed(run.train, batch)
            metrics.update(train_metrics)
            metrics.update(run.sync_weights(rollout_id + 1))
            if periodic(rollout_id, job.eval.eval_interval, run.num_rollout):
                pending_eval = timed_eval(run, rollout_id + 1)
            if run.save_due(rollout_id):
                run.save(rollout_id)
            run.log(rollout_id, metrics)
        if pending_eval:  # the final weights' eval: one last row, step num_rollout
            run.log(run.num_rollout, pending_eval)
    finally:
        run.close()


def timed_eval(run: Run, rollout_id: int) -> dict[str, float]:
    metrics, seconds = timed(run.eval, rollout_id)
    return {**metrics, "perf/eval_time": seconds}


def first_eval(run: Run, job: JobConfig, start: int) -> dict[str, float]:
    """The eval that opens the run: before any training, or after a resume whose weights were due one."""
    if job.eval.eval_interval is None:
        return {}
    if start == 0 or periodic(start - 1, job.eval.eval_interval, run.num_rollout):
        return timed_eval(run, start)
    return {}
