"""`clawrl demo`: SFT warm-up then GRPO on arithmetic word problems, through the real stack, on CPU.

    clawrl demo [--output-dir outputs/demo] [--seed 0]

See clawrl/demo/run.py for what it does. On 2 CPU cores it takes a few minutes; the last line prints the
eval accuracy before and after RL and the path of the report.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="Train a tiny model with SFT then GRPO on CPU, through Ray + engine + FSDP2 (a few minutes).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output-dir", default="outputs/demo", help="where the run goes (default outputs/demo)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the problems, the model and sampling")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from clawrl.demo.run import run_demo

    try:
        run_demo(args.output_dir, seed=args.seed)
    except FileExistsError as e:
        print(f"clawrl demo: error: {e}", file=sys.stderr)
        return 2
    return 0
