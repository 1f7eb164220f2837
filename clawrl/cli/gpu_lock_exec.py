"""`clawrl gpu-lock-exec [options] -- CMD ...`: run CMD while holding exclusive locks on GPUs.

The implementation is the standard-library-only clawrl/ci/gpu_lock_exec.py (also runnable as
`python3 clawrl/ci/gpu_lock_exec.py` on hosts where clawrl is not installed). clawrl/cli/main.py hands this
command its raw arguments through `run_argv`, because argparse subparsers cannot pass a wrapped command
line (`-- CMD --its-own-flags`) through verbatim; `add_parser` registers the name for `clawrl --help`.
"""

from __future__ import annotations

import argparse

from clawrl.ci import gpu_lock_exec

PROG = "clawrl gpu-lock-exec"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "gpu-lock-exec",
        help="run a command while holding exclusive locks on N GPUs (shared CI machines)",
        description="Run a command while holding exclusive locks on GPUs; see `clawrl gpu-lock-exec --help`.",
        add_help=False,
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="gpu-lock-exec options, then -- CMD ...")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    return run_argv(args.argv)


def run_argv(argv: list[str]) -> int:
    """Parse gpu-lock-exec's own options from the raw arguments after the command name and run it."""
    return gpu_lock_exec.main(argv, prog=PROG)
