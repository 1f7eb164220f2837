"""`clawrl debug replay-reward`: re-score a rollout dump's samples with a reward function and compare the
new rewards with the saved ones (a changed reward function, a flaky verifier, a wrong --reward-key).

    clawrl debug replay-reward dumps/3.pt --rm-type math
    clawrl debug replay-reward dumps/3.pt --custom-rm-path my_rm.py:reward --json-out rescored.json

The reward function is built exactly as a training run builds it (`--rm-type`, `--custom-rm-path`,
`--rm-url`, `--reward-key`; per-sample overrides in the samples are honoured). Printed per sample: index,
old reward, new reward, status and the prompt + response cut to 200 characters with newlines escaped; then
the disagreement rate (|old - new| > 1e-9 over the samples that have both) and the two means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from clawrl.config.errors import ConfigError
from clawrl.data.sample import Sample
from clawrl.debug.dump import load_rollout_dump
from clawrl.debug.shown import prompt_text
from clawrl.rollout.rewards import RM_TYPES, batched_reward, build_reward_fn

TOLERANCE = 1e-9
"""Old and new rewards further apart than this disagree."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("dump", metavar="DUMP", help="a rollout dump file (clawrl's or slime's)")
    parser.add_argument(
        "--rm-type", default=None, help=f"built-in reward: one of {', '.join(RM_TYPES)} (or boxed_*)"
    )
    parser.add_argument("--custom-rm-path", default=None, metavar="PATH",
                        help="module:function or file.py:function (takes precedence over --rm-type)")  # fmt: skip
    parser.add_argument("--rm-url", default=None, help="reward service URL for --rm-type remote_rm")
    parser.add_argument(
        "--reward-key", default=None, help="key of the reward to compare when rewards are dicts"
    )
    parser.add_argument("--label-key", default=None, metavar="KEY",
                        help="take each sample's label from metadata[KEY] instead of its saved label")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16, help="rewards computed at once (default: 16)")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="also write the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    if not args.rm_type and not args.custom_rm_path:
        raise ConfigError("pass --rm-type or --custom-rm-path (the reward function to replay)")
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {args.concurrency}")
    dump = load_rollout_dump(args.dump)
    samples = [_with_label(s, args.label_key, i, args.dump) for i, s in enumerate(dump.samples)]
    new_rewards = rescore(samples, args)
    rows = [
        _row(i, s, new, args.reward_key) for i, (s, new) in enumerate(zip(samples, new_rewards, strict=True))
    ]
    summary = summarize(rows)
    for row in rows:
        print(_format_row(row))
    print(_format_summary(summary, args.dump))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"dump": str(args.dump), "summary": summary, "samples": rows},
                                                  indent=1, default=str))  # fmt: skip
        print(f"comparison written to {args.json_out}")
    return 0


def rescore(samples: list[Sample], args: argparse.Namespace) -> list[Any]:
    """New rewards of `samples`, by the reward function the flags name, computed concurrently."""
    reward_fn = build_reward_fn(rm_type=args.rm_type, custom_rm_path=args.custom_rm_path, rm_url=args.rm_url,
                                reward_key=args.reward_key, args=args)  # fmt: skip

    async def score() -> list[Any]:
        try:
            return await batched_reward(samples, reward_fn, args=args, max_concurrency=args.concurrency)
        finally:
            await reward_fn.aclose()

    return asyncio.run(score())


def _with_label(sample: Sample, label_key: str | None, position: int, path: str) -> Sample:
    if label_key is None:
        return sample
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    if label_key not in metadata:
        raise ConfigError(
            f"--label-key {label_key!r}: sample {position} of {path} has no metadata[{label_key!r}]"
        )
    sample.label = metadata[label_key]
    return sample


def _scalar(reward: Any, reward_key: str | None) -> float | None:
    if isinstance(reward, dict):
        reward = reward.get(reward_key) if reward_key is not None else None
    return float(reward) if isinstance(reward, (int, float)) else None


def _row(position: int, sample: Sample, new: Any, reward_key: str | None) -> dict[str, Any]:
    old_value, new_value = _scalar(sample.reward, reward_key), _scalar(new, reward_key)
    both = old_value is not None and new_value is not None
    return {
        "position": position, "index": sample.index, "status": getattr(sample.status, "value", sample.status),
        "old_reward": sample.reward, "new_reward": new, "old": old_value, "new": new_value,
        "disagree": both and abs(old_value - new_value) > TOLERANCE,
        "text": _one_line(prompt_text(sample.prompt) + sample.response),
    }  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Disagreement rate and means over the rows whose old and new rewards are both numbers."""
    both = [r for r in rows if r["old"] is not None and r["new"] is not None]
    n = len(both)
    return {
        "num_samples": len(rows), "num_compared": n,
        "num_disagree": sum(r["disagree"] for r in both),
        "disagreement_rate": sum(r["disagree"] for r in both) / n if n else None,
        "mean_old": sum(r["old"] for r in both) / n if n else None,
        "mean_new": sum(r["new"] for r in both) / n if n else None,
    }  # fmt: skip


def _one_line(text: str, limit: int = 200) -> str:
    """The first `limit` characters, newlines and tabs escaped so each sample stays on one line."""
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return cut.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _format_row(row: dict[str, Any]) -> str:
    mark = "  DIFF" if row["disagree"] else ""
    return (
        f"[{row['position']}] index {row['index']} · old {_fmt(row['old_reward'])} · new {_fmt(row['new_reward'])}"
        f" · {row['status']}{mark}\n    {row['text']}"
    )


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def _format_summary(summary: dict[str, Any], path: str) -> str:
    if not summary["num_compared"]:
        return (
            f"{path}: {summary['num_samples']} samples, none with numeric old and new rewards (--reward-key?)"
        )
    return (
        f"{path}: {summary['num_compared']} samples compared · disagreement "
        f"{summary['num_disagree']}/{summary['num_compared']} = {summary['disagreement_rate']:.1%} · "
        f"mean old {summary['mean_old']:.6g} · mean new {summary['mean_new']:.6g}"
    )
