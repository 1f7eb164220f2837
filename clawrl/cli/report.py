"""`clawrl report OUTPUT_DIR`: plots and an HTML page for a run, from its metrics.jsonl and config.json.

    clawrl report outputs/run1                  # -> outputs/run1/report/index.html (+ PNGs)
    clawrl report outputs/run1 --out /tmp/rep   # write the report elsewhere

Exit codes: 0 written; 2 the metrics file is missing, empty or malformed (the error names file:line).
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="plot a run's metrics (reward, eval, KL, entropy, lengths, step times) into an HTML page",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's --output-dir (holds metrics.jsonl)")
    p.add_argument(
        "--out", metavar="DIR", default=None, help="where to write the report (default: OUTPUT_DIR/report)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from clawrl.metrics.jsonl import MetricsFileError
    from clawrl.metrics.report import build_report

    try:
        index = build_report(args.output_dir, args.out)
    except MetricsFileError as exc:
        print(f"clawrl report: error: {exc}", file=sys.stderr)
        return 2
    print(f"clawrl report: wrote {index}")
    return 0
