"""`clawrl train` and `clawrl train-async`: parse and validate a training job's flags, then run its loop.

    clawrl train --hf-checkpoint DIR --prompt-data train.jsonl --rollout-batch-size 8 --num-rollout 10 ...
    clawrl train --help          # every flag, grouped by component (model, data, rollout, eval, train, ...)

`train` is slime's synchronous loop; `train-async` generates rollout k+1 while training on rollout k.
Both take the same flags (clawrl/config). A flag mistake, or a placement the cluster cannot hold, prints one
line, `clawrl train: error: ...`, and exits with code 2. A failed check (--ci-test, clawrl/metrics/checks.py)
prints the table of checks and then, as the last line, `clawrl train: check failed: ...`; exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import logging.handlers
import sys
from typing import NoReturn

from clawrl.config import ConfigError, add_job_arguments, job_from_namespace, validate
from clawrl.config.flags import USAGE

_COMMANDS = {
    "train": "Train with RL: rollout, reward, train and weight sync, one after the other.",
    "train-async": "Train with RL, generating rollout k+1 while training on rollout k (one step off-policy).",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `train` and `train-async`; returns the `train` parser."""
    parsers = []
    for name, summary in _COMMANDS.items():
        parser = subparsers.add_parser(
            name, help=summary, description=summary, usage=USAGE, allow_abbrev=False
        )
        add_job_arguments(parser)
        # argparse would print the whole usage (about a hundred flags) before the error; one line is readable.
        parser.error = functools.partial(_exit_with_error, parser.prog)  # type: ignore[method-assign]
        parser.set_defaults(func=functools.partial(run, prog=parser.prog))
        parsers.append(parser)
    return parsers[0]


def run(args: argparse.Namespace, prog: str) -> int:
    """Validate the parsed flags, then run the synchronous or the asynchronous loop."""
    from clawrl.cli.preflight import preflight
    from clawrl.cluster.deadline import ActorFailure, DeadlineError
    from clawrl.cluster.placement import PlacementError
    from clawrl.config.loop_rules import check_loop_flags
    from clawrl.metrics.checks import MetricCheckError

    try:
        with _held_log_lines():  # what validate derived is printed only when the flags are valid
            job = job_from_namespace(args)
            _resolve_resources(job, can_colocate=not prog.endswith("train-async"))
            job = validate(job)
            check_loop_flags(job, asynchronous=prog.endswith("train-async"))
            preflight(job)  # model, datasets, plugins, dumps, output dir: before Ray starts
            _warn_unbounded_response(job)
        if prog.endswith("train-async"):
            from clawrl.loops.async_ import train_async

            train_async(job)
        else:
            from clawrl.loops.sync import train

            train(job)
        print(outputs_summary(job), flush=True)
    except (ConfigError, PlacementError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (DeadlineError, ActorFailure) as e:
        _stop_ray()  # the stacks were printed above; this line is the last
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except MetricCheckError as e:
        _stop_ray()  # no forwarded actor log line may land after the verdict
        print(f"{prog}: check failed: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def outputs_summary(job) -> str:
    """The block printed at the end of a run: where its metrics, report, checkpoints and HF export are."""
    import os

    out, model = job.logging.output_dir, job.model
    rows = [
        ("metrics", f"{os.path.join(out, 'metrics.jsonl')} (config.json beside it)"),
        ("report", f"clawrl report {out}   -> {os.path.join(out, 'report', 'index.html')}"),
        ("checkpoints", f"{model.save} (--save; resume with --load {model.save})" if model.save else
         "none (--save DIR to keep them)"),
        ("HF export", _hf_export_line(job)),
    ]  # fmt: skip
    if job.logging.use_tensorboard:
        rows.append(("tensorboard", os.path.join(out, "tensorboard")))
    return "clawrl: run finished; outputs:\n" + "\n".join(f"  {name:<12} {where}" for name, where in rows)


def _hf_export_line(job) -> str:
    """Where the final weights' HF export is (the template filled for the last rollout, when the run length is known)."""
    from clawrl.config.model import save_hf_path

    template, last = job.model.save_hf, job.rollout.num_rollout
    if not template:
        return "none (--save-hf DIR to write one)"
    if not last:
        return f"{template} (--save-hf)"
    return f"{save_hf_path(template, last - 1)} (the final weights; --save-hf {template})"


def _resolve_resources(job, *, can_colocate: bool) -> None:
    """Fill the GPU counts not given from this machine (or the --ray-address cluster) and say so, once."""
    from clawrl.config.resources import resolve_resource_defaults

    res = job.resources
    if not res.needs_defaults:
        return
    note = resolve_resource_defaults(res, _visible_gpus(res.ray_address), can_colocate=can_colocate)
    if note:
        logging.getLogger("clawrl").info("%s", note)


def _visible_gpus(ray_address: str | None) -> int:
    """GPUs the job can use: the joined cluster's (--ray-address), else this machine's visible ones (the
    count a local Ray instance will offer)."""
    if ray_address:
        from clawrl.cluster.ray_cluster import cluster_gpus, start_ray

        start_ray(ray_address)
        return cluster_gpus()
    import torch

    return torch.cuda.device_count()


def _warn_unbounded_response(job) -> None:
    """slime leaves --rollout-max-response-len unset by default, and so does clawrl; one warning says what
    that costs (a response may run to the context length), instead of a silently slow run."""
    if job.rollout.rollout_max_response_len is not None or job.debug.debug_train_only:
        return
    logging.getLogger("clawrl").warning(
        "--rollout-max-response-len is unset: each response runs until EOS or a stop, at worst to the "
        "context length (%s); set it to bound generation (slime recipes use e.g. 1024-8192)",
        _context_length(job),
    )


def _context_length(job) -> str:
    if job.engine.sglang_context_length:
        return f"--sglang-context-length {job.engine.sglang_context_length}"
    if job.data.rollout_max_prompt_len:
        return f"--rollout-max-prompt-len {job.data.rollout_max_prompt_len} + 1024 tokens"
    import json
    from pathlib import Path

    path = Path(job.model.hf_checkpoint or ".") / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return f"{config.get('max_position_embeddings', '?')} tokens, the model's max_position_embeddings"


def _stop_ray() -> None:
    from clawrl.cluster.ray_cluster import stop_ray  # imported late: Ray is slow to import for a flag error

    stop_ray()


@contextlib.contextmanager
def _held_log_lines():
    """clawrl's INFO lines (what validate derived or turned on, loop phases) go to stderr; those logged in
    the block are held back and printed only if it succeeds, so a flag error stays the one line printed."""
    log = logging.getLogger("clawrl")
    if not log.handlers:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("clawrl: %(message)s"))
        log.addHandler(console)
        log.setLevel(logging.INFO)
        log.propagate = False
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    saved, log.handlers = log.handlers, [held]
    try:
        yield
    except BaseException:
        held.buffer.clear()
        raise
    finally:
        log.handlers = saved
    for record in held.buffer:
        log.handle(record)


def _exit_with_error(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
