"""`clawrl debug show`: look at rollout dumps in the terminal (prompt, response, reward, status, lengths,
per-rollout stats and metrics) or as an HTML page of tokens coloured by loss mask and log-prob mismatch.

    clawrl debug show dumps/3.pt                        # one dump
    clawrl debug show 'dumps/{rollout_id}.pt'           # every dump of a run: 0, eval_0, 1, eval_1, ...
    clawrl debug show run/details --category eval       # a --dump-details directory (train dumps found too)
    clawrl debug show run/details --html page.html      # tokens coloured by loss mask and |logp diff|

Reads clawrl's dumps and slime's ({"rollout_id", "samples"}). With a template, every existing dump is shown,
training rollouts (`rollout_id=N`) and evals (`rollout_id=eval_N`), ordered by N. Metrics come from the
dump itself (a rollout's rollout/* metrics, an eval's eval/* scores) and from the matching train dump
(`--train-data TEMPLATE`; inside a --dump-details directory, DIR/train_data/{rollout_id}.pt).
"""

from __future__ import annotations

import argparse
import glob
import math
import re
import string
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from clawrl.config.errors import ConfigError
from clawrl.config.templates import check_template, template_fields
from clawrl.data.sample import Sample
from clawrl.debug.dump import (
    RolloutDump,
    dump_path,
    load_rollout_dump,
    load_train_dump,
)
from clawrl.debug.shown import Shown, logprob_diff, prompt_text, reward_value

CATEGORIES = ("train", "eval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("target", metavar="DUMP|TEMPLATE|DIR",
                        help="a dump file, a template with {rollout_id}, or a --dump-details directory")  # fmt: skip
    parser.add_argument("--category", action="append", choices=CATEGORIES, default=None,
                        help="show only train rollouts or evals (repeatable; default: both)")  # fmt: skip
    parser.add_argument("--train-data", metavar="TEMPLATE", default=None,
                        help="train dumps (--save-debug-train-data) to take train metrics and log-probs from")  # fmt: skip
    parser.add_argument("--max-samples", type=int, default=4, metavar="N",
                        help="samples shown per dump (default: 4)")  # fmt: skip
    parser.add_argument("--max-chars", type=int, default=300, metavar="N",
                        help="longer prompts and responses are cut (default: 300)")  # fmt: skip
    parser.add_argument("--full", action="store_true", help="every sample, texts uncut")
    parser.add_argument("--no-samples", action="store_true", help="headers, stats and metrics only")
    parser.add_argument("--no-metrics", action="store_true", help="leave out the metrics")
    parser.add_argument("--reward-key", default=None, help="key of the reward to use when rewards are dicts")
    parser.add_argument("--html", metavar="OUT", default=None, help="also write a self-contained HTML page")
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="tokenizer for --html (default: DIR/tokenizer, else the dump's recorded one)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.max_samples < 0 or args.max_chars < 1:
        raise ConfigError("--max-samples must be >= 0 and --max-chars >= 1")
    shown = collect(args.target, args.category or list(CATEGORIES), args.train_data)
    for item in shown:
        print(format_dump(item, args))
    if args.html:
        from clawrl.debug.show_html import write_html

        tokenizer = args.tokenizer or default_tokenizer(args.target, shown)
        path = write_html(args.html, shown, tokenizer, max_samples=None if args.full else args.max_samples)
        print(f"HTML written to {path}")
    return 0


# ---------------------------------------------------------------------------------------------------
# finding the dumps


def collect(target: str, categories: list[str], train_template: str | None) -> list[Shown]:
    """Every dump `target` names (a file, a template or a --dump-details directory), in display order."""
    rollout_template, default_train = _templates(target)
    train_template = train_template or default_train
    if train_template is not None:
        check_template(train_template, "--train-data")
    if rollout_template is None:
        found = [load_rollout_dump(target)]
    else:
        found = [load_rollout_dump(p) for _, p in discover(rollout_template)]
        if not found:
            raise FileNotFoundError(f"{target}: no dump matches {rollout_template}")
    shown = [Shown(dump=d) for d in found if d.category in categories]
    if not shown:
        raise FileNotFoundError(f"{target}: no dump of category {' or '.join(categories)}")
    for item in shown:
        if train_template is not None and item.dump.category == "train":
            _attach_train(item, dump_path(train_template, item.dump.rollout_id))
    return shown


def _templates(target: str) -> tuple[str | None, str | None]:
    """(rollout template or None for a single file, default train template)."""
    path = Path(target)
    if path.is_dir():
        if (path / "rollout_data").is_dir():  # a --dump-details directory
            return str(path / "rollout_data" / "{rollout_id}.pt"), str(
                path / "train_data" / "{rollout_id}.pt"
            )
        return str(path / "{rollout_id}.pt"), None
    if path.is_file():
        return None, None
    try:
        is_template = bool(template_fields(target))
    except ValueError:
        is_template = True  # a malformed template: check_template names the problem
    if not is_template:
        raise FileNotFoundError(f"{target}: no such dump file")
    check_template(target, "template")
    return target, None


def discover(template: str) -> list[tuple[int | str, Path]]:
    """(rollout id, path) of every existing file the template can produce: ids N and eval_N, by N, each
    rollout before its eval."""
    pattern, wildcard = [], []
    seen = False
    for literal, name, _, _ in string.Formatter().parse(template):
        pattern.append(re.escape(literal))
        wildcard.append(glob.escape(literal))
        if name is not None:
            pattern.append("(?P=id)" if seen else r"(?P<id>[^/]+)")
            wildcard.append("*")
            seen = True
    regex = re.compile("".join(pattern))
    found = []
    for candidate in glob.glob("".join(wildcard)):
        match = regex.fullmatch(candidate)
        if match is None or not Path(candidate).is_file():
            continue
        value = match.group("id")
        if value.isdigit():
            found.append(((int(value), 0), int(value), Path(candidate)))
        elif value.startswith("eval_") and value[5:].isdigit():
            found.append(((int(value[5:]), 1), value, Path(candidate)))
    return [(rid, path) for _, rid, path in sorted(found, key=lambda t: t[0])]


def _attach_train(item: Shown, path: Path) -> None:
    if not path.is_file():
        return
    item.train = load_train_dump(path)
    by_index = {r.get("sample_index"): r for r in item.train["samples"] if r.get("sample_index") is not None}
    by_position = {r.get("rollout_position"): r for r in item.train["samples"]}
    for pos, sample in enumerate(item.dump.samples):
        record = by_index.get(sample.index) if sample.index is not None else None
        record = record or by_position.get(pos)
        if record is not None and _as_list(record.get("tokens")) == sample.tokens:
            item.records[pos] = record


def default_tokenizer(target: str, shown: list[Shown]) -> str | None:
    """DIR/tokenizer of a --dump-details directory, else the tokenizer a dump recorded."""
    if (Path(target) / "tokenizer").is_dir():
        return str(Path(target) / "tokenizer")
    for item in shown:
        name = item.dump.meta.get("tokenizer")
        if isinstance(name, str) and name:
            return name
    return None


# ---------------------------------------------------------------------------------------------------
# terminal view


def format_dump(item: Shown, args: argparse.Namespace) -> str:
    """The terminal text of one dump: header, stats, metrics, samples."""
    dump = item.dump
    lines = [_header(dump), *_stats_lines(dump.samples, dump.meta.get("datasets"), args.reward_key)]
    if not args.no_metrics:
        lines += _metric_lines("metrics", dump.meta.get("metrics"))
        if item.train is not None:
            lines += _metric_lines("train metrics", item.train.get("metrics"))
            for k, step in enumerate(item.train.get("optimizer_steps") or []):
                lines += _metric_lines(f"optimizer step {k}", step)
    if not args.no_samples:
        count = len(dump.samples) if args.full else min(args.max_samples, len(dump.samples))
        for pos in range(count):
            lines += _sample_lines(pos, dump.samples[pos], item.records.get(pos), args)
        if count < len(dump.samples):
            lines.append(f"  ... {len(dump.samples) - count} more samples (--max-samples N or --full)")
    return "\n".join(lines) + "\n"


def _header(dump: RolloutDump) -> str:
    meta = dump.meta
    source = "clawrl" if dump.source_format == "clawrl" else "slime layout"
    head = f"=== rollout {dump.rollout_id} ({dump.category}) · {len(dump.samples)} samples · {dump.path} [{source}]"
    details = []
    versions = meta.get("weight_versions") or sorted({v for s in dump.samples for v in s.weight_versions})
    if versions:
        details.append(f"weight versions {', '.join(map(str, versions))}")
    if meta.get("sampling_params"):
        details.append("sampling " + " ".join(f"{k}={v}" for k, v in sorted(meta["sampling_params"].items())))
    if meta.get("tokenizer"):
        details.append(f"tokenizer {meta['tokenizer']}")
    if meta.get("config_hash"):
        details.append(f"config {meta['config_hash']}")
    return head + ("\n    " + " · ".join(details) if details else "")


def _stats_lines(samples: list[Sample], datasets: Any, reward_key: str | None) -> list[str]:
    lines = ["    " + _stats(samples, reward_key)]
    # One line per eval dataset, when there are several (one dataset's line would repeat the total).
    if isinstance(datasets, dict) and len(datasets) > 1:
        for name, positions in datasets.items():
            part = [samples[p] for p in positions if 0 <= p < len(samples)]
            lines.append(f"    [{name}] " + _stats(part, reward_key))
    return lines


def _stats(samples: list[Sample], reward_key: str | None) -> str:
    if not samples:
        return "no samples"
    rewards = [r for r in (reward_value(s, reward_key) for s in samples) if r is not None]
    lengths = [s.response_length for s in samples]
    statuses = Counter(s.status.value if hasattr(s.status, "value") else str(s.status) for s in samples)
    parts = []
    if rewards:
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        parts.append(f"reward mean {mean:.4g} std {std:.4g}")
    else:
        parts.append("reward n/a")
    parts.append(f"response len mean {sum(lengths) / len(lengths):.1f} min {min(lengths)} max {max(lengths)}")
    parts.append("status " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
    parts.append(f"truncated {statuses.get('truncated', 0) / len(samples):.1%}")
    return " · ".join(parts)


def _metric_lines(title: str, metrics: Any) -> list[str]:
    if not isinstance(metrics, dict) or not metrics:
        return []
    items = [f"{k}={_num(v)}" for k, v in sorted(metrics.items()) if isinstance(v, (int, float))]
    lines, line = [f"    {title}:"], "     "
    for item in items:
        if len(line) + len(item) > 110:
            lines.append(line)
            line = "     "
        line += " " + item
    return [*lines, line] if line.strip() else lines


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _sample_lines(pos: int, sample: Sample, record: dict | None, args: argparse.Namespace) -> list[str]:
    status = sample.status.value if hasattr(sample.status, "value") else str(sample.status)
    trained = sample.effective_response_length
    head = (
        f"  --- [{pos}] index {sample.index} group {sample.group_index} · reward {_reward_text(sample.reward)}"
        f" · {status} · response {sample.response_length} tokens ({trained} trained)"
    )
    if sample.label is not None:
        head += f" · label {_cut(repr(sample.label), 60)}"
    lines = [head]
    if record is not None:
        lines.append("      " + _record_summary(record))
    limit = None if args.full else args.max_chars
    lines += _text_block("prompt", prompt_text(sample.prompt), limit)
    lines += _text_block("response", sample.response, limit)
    return lines


def _reward_text(reward: Any) -> str:
    if isinstance(reward, float):
        return f"{reward:.4g}"
    return repr(reward)


def _record_summary(record: dict) -> str:
    parts = [f"step {record.get('optimizer_step')} mb {record.get('micro_batch')} rank {record.get('rank')}"]
    adv = record.get("advantages")
    if isinstance(adv, torch.Tensor) and adv.numel():
        parts.append(f"advantage mean {adv.float().mean().item():+.4g}")
    diff = logprob_diff(record)
    if diff is not None and diff.numel():
        parts.append(f"|train-rollout logp| mean {diff.mean().item():.3g} max {diff.max().item():.3g}")
    return "train: " + " · ".join(parts)


def _text_block(title: str, text: str, limit: int | None) -> list[str]:
    body = text if limit is None else _cut(text, limit)
    rows = body.split("\n") or [""]
    return [f"      {title:<8} | {rows[0]}", *(f"      {'':<8} | {row}" for row in rows[1:])]


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]} ...[+{len(text) - limit} chars]"


def _as_list(value: Any) -> list | None:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value) if isinstance(value, list) else None
