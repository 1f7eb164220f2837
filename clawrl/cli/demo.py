"""`clawrl demo`: SFT warm-up then GRPO on arithmetic word problems, through the real stack, on CPU.

    clawrl demo [--output-dir outputs/demo] [--seed 0]

Builds a tiny tokenizer and a random tiny Qwen2-style model locally (no download), writes arithmetic word
problems with gsm8k-style labels, warms the model up with the SFT loss, then runs GRPO through the real
stack: Ray, an engine actor serving HTTP, an FSDP2 trainer actor, weight sync after every step, eval on 200
held-out problems before RL and every 5 rollouts. On 2 CPU cores it takes about 3 minutes; the last line
prints the eval accuracy before and after RL and the path of the report (PNG plots + index.html).
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
