"""The rules of a job that a loop runs (`clawrl train`, `clawrl train-async`), checked after `validate`.

`validate` (clawrl/config/validate.py) also resolves partial jobs built in Python (no data, no GPU counts), so
what only a full run needs is checked here, by `clawrl train[-async]` before Ray starts, each rule one
ConfigError naming the flags:

- train-async refuses --colocate (first: no other flag can make such a job run);
- only train-async takes --update-weights-interval != 1; --max-weight-staleness K >= --update-weights-interval
  (fresh train-async samples are that stale) and >= 2 in train-async / 1 in train (a sample resumed one
  rollout later is one version staler than it was fresh, so a smaller K would drop nearly every partial);
- a rollout needs --prompt-data and a reward (unless --rollout-function-path or --debug-train-only);
- --global-batch-size >= the trainer ranks (each joins every optimizer step); --fast-single-rank needs a
  trainer of one rank.

    check_loop_flags(validate(job), asynchronous=False)
"""

from __future__ import annotations

from clawrl.config.errors import ConfigError
from clawrl.config.job import JobConfig


def check_loop_flags(job: JobConfig, *, asynchronous: bool) -> None:
    """The rules of a job that a loop (`clawrl train` or `clawrl train-async`) runs, after `validate`.
    Not in `validate` itself, which also resolves partial jobs built in Python (no data, no GPU counts)."""
    if asynchronous and job.resources.colocate:  # first: no other flag can make this job run
        raise ConfigError(
            "--colocate: clawrl train-async needs separate trainer and engine GPUs; drop --colocate"
        )
    _weight_update_interval(job, asynchronous)
    _rollout_inputs(job)  # after the flag combinations: what the run is missing comes last
    _trainer_ranks(job)


def _fast_single_rank(job: JobConfig) -> None:
    """The world-size-1 path (no FSDP2 wrapping) holds the whole model on its one rank."""
    res = job.resources
    if job.train.fast_single_rank and res.actor_num_gpus > 1:
        raise ConfigError(
            f"--fast-single-rank needs a trainer of one rank, this job has {res.actor_num_gpus} "
            f"({_ranks_flags(job)}); drop the flag to shard with FSDP2"
        )


def _rollout_inputs(job: JobConfig) -> None:
    """What the rollout manager needs to make a rollout (nothing with --debug-train-only: it replays dumps)."""
    r = job.rollout
    if job.debug.debug_train_only or r.rollout_function_path:
        return
    if job.data.prompt_data is None:
        raise ConfigError("--prompt-data is required (unset) unless --rollout-function-path makes prompts")
    if not (r.rm_type or r.custom_rm_path or r.custom_generate_function_path):
        raise ConfigError(
            "no reward function: pass --rm-type or --custom-rm-path (or a --custom-generate-function-path "
            "or --rollout-function-path that sets rewards itself)"
        )


def _trainer_ranks(job: JobConfig) -> None:
    """Every trainer rank joins every optimizer step (FSDP's collectives), so each needs a sample of it."""
    _fast_single_rank(job)
    res, gbs = job.resources, job.train.global_batch_size
    if job.debug.debug_rollout_only or gbs is None or gbs >= res.actor_num_gpus:
        return
    raise ConfigError(
        f"--global-batch-size {gbs} (samples per optimizer step) is smaller than the {res.actor_num_gpus} "
        f"trainer ranks ({_ranks_flags(job)}); every rank needs at least one sample per step"
    )


def _weight_update_interval(job: JobConfig, asynchronous: bool) -> None:
    r = job.rollout
    interval = r.update_weights_interval
    if interval != 1 and not asynchronous:
        raise ConfigError(
            f"--update-weights-interval {interval} is for clawrl train-async; clawrl train updates the "
            "engines after every rollout"
        )
    if r.max_weight_staleness is None:
        return
    least = max(interval, 2) if asynchronous else 1
    if r.max_weight_staleness < least:
        why = (
            f"fresh samples are up to --update-weights-interval {interval} versions stale and a sample "
            "resumed one rollout later is 1 more, so a smaller K would fail fresh samples or drop nearly "
            "every partial one"
            if asynchronous
            else "a sample resumed in the next rollout is 1 version stale, so K = 0 would drop every partial one"
        )
        raise ConfigError(
            f"--max-weight-staleness {r.max_weight_staleness} must be >= {least} with clawrl "
            f"{'train-async' if asynchronous else 'train'}: {why}"
        )


def _ranks_flags(job: JobConfig) -> str:
    res = job.resources
    return (
        f"--actor-num-nodes {res.actor_num_nodes} x --actor-num-gpus-per-node {res.actor_num_gpus_per_node}"
    )
