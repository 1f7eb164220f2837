"""The one-line console summary of a rollout step.

    [rollout 3/20] reward 0.40 | eval gsm8k 0.55 | kl 1.2e-03 ppo_kl 0.0e+00 | resp 57 tok |
        rollout 12.3s train 4.1s sync 0.2s eval 3.0s | 1.2k tok/s/gpu            (one line on the console)

`step` is the 0-based rollout id logged in metrics.jsonl; the line counts rollouts from 1 ("3/20" is
rollout id 2 of 20). Each part appears only when its metrics were logged, always in this order:
  reward   rollout/raw_reward (the reward functions' output; rollout/rewards is left out because after
           GRPO group normalisation its mean is ~0 and says nothing)
  eval     eval/<name> for each dataset, sorted by name (not eval/<name>-truncated_ratio etc.)
  kl       train/kl_loss as "kl", train/ppo_kl as "ppo_kl" (means over the optimizer steps)
  resp     rollout/response_len/mean
  times    perf/rollout_time, perf/train_time, perf/update_weights_time ("sync"), perf/eval_time
  speed    perf/tokens_per_gpu_per_sec (slime's key): generation throughput per GPU, labelled "tok/s/gpu";
           on a CPU run the same key counts per engine process and is labelled "tok/s/engine"
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

# Per-dataset eval metrics that are not the accuracy itself: eval/<name>-truncated_ratio, ...-pass@k.
_EVAL_SUFFIXES = ("-truncated_ratio", "-aborted_ratio")
_TIME_PARTS = (
    ("perf/rollout_time", "rollout"),
    ("perf/train_time", "train"),
    ("perf/update_weights_time", "sync"),
    ("perf/eval_time", "eval"),
)


def eval_names(keys) -> list[str]:
    """Sorted dataset names <name> of the eval/<name> accuracy metrics among `keys`."""
    names = set()
    for key in keys:
        name = key[len("eval/") :] if key.startswith("eval/") else ""
        if name and "/" not in name and "-pass@" not in name and not name.endswith(_EVAL_SUFFIXES):
            names.add(name)
    return sorted(names)


def format_progress(step: int, num_steps: int, metrics: Mapping[str, float], *, on_gpu: bool = True) -> str:
    """The summary line of rollout `step` (0-based) of `num_steps`; `on_gpu=False` (engines on CPU) labels
    the throughput per engine; see the module docstring."""
    parts = [
        _reward(metrics),
        _evals(metrics),
        _kl(metrics),
        _response_length(metrics),
        _times(metrics),
        _throughput(metrics, on_gpu),
    ]
    body = " | ".join(part for part in parts if part)
    header = f"[rollout {step + 1}/{num_steps}]"
    return f"{header} {body}" if body else header


def print_progress(
    step: int,
    num_steps: int,
    metrics: Mapping[str, float],
    file: TextIO | None = None,
    *,
    on_gpu: bool = True,
) -> str:
    """Print format_progress's line (flushed, to stdout by default) and return it."""
    line = format_progress(step, num_steps, metrics, on_gpu=on_gpu)
    print(line, file=file or sys.stdout, flush=True)
    return line


def _reward(metrics: Mapping[str, float]) -> str:
    value = metrics.get("rollout/raw_reward")
    return "" if value is None else f"reward {value:.2f}"


def _evals(metrics: Mapping[str, float]) -> str:
    names = eval_names(metrics)
    return "eval " + " ".join(f"{name} {metrics[f'eval/{name}']:.2f}" for name in names) if names else ""


def _kl(metrics: Mapping[str, float]) -> str:
    items = [
        (label, metrics.get(key)) for key, label in (("train/kl_loss", "kl"), ("train/ppo_kl", "ppo_kl"))
    ]
    return " ".join(f"{label} {value:.1e}" for label, value in items if value is not None)


def _response_length(metrics: Mapping[str, float]) -> str:
    value = metrics.get("rollout/response_len/mean")
    return "" if value is None else f"resp {value:.0f} tok"


def _times(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{label} {metrics[key]:.1f}s" for key, label in _TIME_PARTS if key in metrics)


def _throughput(metrics: Mapping[str, float], on_gpu: bool) -> str:
    value = metrics.get("perf/tokens_per_gpu_per_sec")
    # The key keeps slime's name; the label says what was counted, so a CPU run does not claim GPUs.
    return "" if value is None else f"{_human(value)} tok/s/{'gpu' if on_gpu else 'engine'}"


def _human(value: float) -> str:
    """1234.5 -> "1.2k", 2.5e6 -> "2.5M", 57.2 -> "57"."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"
