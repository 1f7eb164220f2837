"""`clawrl train` and `clawrl train-async`: parse and validate a training job's flags, then run its loop.

    clawrl train --hf-checkpoint DIR --prompt-data train.jsonl --rollout-batch-size 8 --num-rollout 10 ...
    clawrl train --help          # every flag, grouped by component (model, data, rollout, eval, train, ...)

`train` is slime's synchronous loop; `train-async` generates rollout k+1 while training on rollout k.
Both take the same flags (clawrl/config). A flag mistake, or a placement the cluster cannot hold, prints one
line, `clawrl train: error: ...`, and exits with code 2.
"""

from __future__ import annotations

import argparse
import functools
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
    from clawrl.cluster.placement import PlacementError

    try:
        job = validate(job_from_namespace(args))
        if prog.endswith("train-async"):
            from clawrl.loops.async_ import train_async

            train_async(job)
        else:
            from clawrl.loops.sync import train

            train(job)
    except (ConfigError, PlacementError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _exit_with_error(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
