"""The `clawrl` command: one subcommand per module in clawrl/cli/.

Each subcommand module defines `add_parser(subparsers) -> argparse.ArgumentParser` and sets
`func=<callable(args) -> int>` on it. Modules are imported only when their command runs (or for --help),
so `clawrl gpu-lock-exec` stays fast and a broken optional dependency only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module under clawrl.cli defining add_parser(subparsers)
COMMANDS: dict[str, str] = {
    "convert-checkpoint": "convert_checkpoint",
    "engine": "engine",
    "gpu-lock-exec": "gpu_lock_exec",
    "make-tiny-model": "make_tiny_model",
    "report": "report",
    "demo": "demo",
    "train": "train",  # also registers train-async
    "train-async": "train",
    "debug": "debug",
}
# Commands handed their raw arguments (module function `run_argv(argv) -> int`): gpu-lock-exec wraps a whole
# command line (`-- CMD --its-flags`), which argparse subparsers cannot pass through verbatim.
RAW_ARGV_COMMANDS = {"gpu-lock-exec"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `clawrl` parser; `only` builds just that subcommand's (so `clawrl train` does not import what
    the other commands need, e.g. torch for convert-checkpoint)."""
    parser = argparse.ArgumentParser(prog="clawrl", description="RL post-training for LLMs and LLM agents.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMANDS[only]] if only in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module_name in modules:
        importlib.import_module(f"clawrl.cli.{module_name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in RAW_ARGV_COMMANDS:
        return int(importlib.import_module(f"clawrl.cli.{COMMANDS[argv[0]]}").run_argv(argv[1:]))
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
