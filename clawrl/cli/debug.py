"""`clawrl debug`: tools for the dump/replay debugging workflow, one module per subcommand in clawrl/debug/.

    clawrl debug show DUMP|TEMPLATE|DIR [--html OUT]      # look at rollout dumps
    clawrl debug replay-reward DUMP --rm-type math        # re-score saved samples, old vs new reward
    clawrl debug send --url URL --prompt-data FILE        # prompts -> any OpenAI-compatible server -> jsonl
    clawrl debug align ...                                # engine vs trainer log-probs and hidden states

Each tool module defines `add_arguments(parser)` and `run(args) -> int` and is imported only when its
subcommand runs (or for --help). A user mistake (a bad file, flag value or URL) prints one line
`clawrl debug TOOL: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from clawrl.engine.http.client import EngineClientError

# subcommand -> module under clawrl.debug, and its one-line help
TOOLS: dict[str, tuple[str, str]] = {
    "show": ("show", "show rollout dumps in the terminal or as HTML"),
    "replay-reward": ("replay_reward", "re-score a rollout dump's samples and compare the rewards"),
    "send": ("send", "send prompts to an OpenAI-compatible server and write the responses as JSON lines"),
    "align": ("align", "compare engine and trainer log-probs and hidden states on the same tokens"),
}
# What a user mistake raises in the tools (ConfigError, DumpError, DatasetError and PluginError are
# ValueErrors; a missing file is an OSError); anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, EngineClientError)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("debug", help="debugging tools: show, replay-reward, send, align",
                                   description=__doc__.split("\n\n")[0])  # fmt: skip
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", action=_LazyTools)
    for name, (module_name, help_text) in TOOLS.items():
        sub = tools.add_parser(name, help=help_text)
        sub.set_defaults(tool_module=module_name)
    parser.set_defaults(func=lambda args: _no_tool(parser))
    return parser


class _LazyTools(argparse._SubParsersAction):
    """Imports a tool's module (torch, the engine, ...) only when its subcommand is chosen: every `clawrl`
    command builds this parser, and importing all tools up front would add seconds to each of them."""

    def __call__(self, parser, namespace, values, option_string=None):
        sub = self._name_parser_map.get(values[0]) if values else None
        if sub is not None and not getattr(sub, "_tool_loaded", False):
            _load_tool(sub)
        super().__call__(parser, namespace, values, option_string)


def _load_tool(sub: argparse.ArgumentParser) -> None:
    sub._tool_loaded = True
    module_name = sub.get_default("tool_module")
    try:
        module = importlib.import_module(f"clawrl.debug.{module_name}")
    except ImportError as err:  # one broken tool must not take the others down
        sub.set_defaults(func=_unavailable(sub, err))
        return
    module.add_arguments(sub)
    sub.set_defaults(func=_runner(sub, module))


def _runner(sub: argparse.ArgumentParser, module):
    def run(args: argparse.Namespace) -> int:
        try:
            return int(module.run(args) or 0)
        except USER_ERRORS as err:
            print(f"{sub.prog}: error: {err}", file=sys.stderr)
            return 2

    return run


def _unavailable(sub: argparse.ArgumentParser, err: ImportError):
    def run(args: argparse.Namespace) -> int:
        print(f"{sub.prog}: error: this tool cannot be imported: {err}", file=sys.stderr)
        return 2

    return run


def _no_tool(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2
