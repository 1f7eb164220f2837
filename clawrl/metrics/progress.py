"""The one-line console summary of a rollout step, and the progress bar of a rollout in flight.

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

The progress bar (RolloutCounter, ProgressBar, format_bar) is described where it is defined, below.
"""

from __future__ import annotations

import sys
import threading
import time
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


# ------------------------------------------------------------------------------------------------------------
# The progress bar of a rollout in flight.
#
#   rollout 3/20 |########------------| 12/32 samples 38% | 4.0 samples/s 512 tok/s | 3s, ETA 5s
#
# The rollout manager counts finished samples (RolloutCounter); the driver polls the counts about once a
# second while it waits for the rollout and draws them (ProgressBar). On a terminal the bar is redrawn in
# place (`\r`) at every poll and ends with a newline; elsewhere (CI logs, files) it prints a plain line at
# most every `interval_s` seconds (`--progress-interval`, 30 by default, or "off"
# for no bar), so a short rollout prints none and a long one a few. Lines start with "rollout", not
# "[rollout", so they never read as the summary line above.

DEFAULT_INTERVAL_S = 30.0
BAR_WIDTH = 20


class RolloutCounter:
    """Samples finished in the current rollout, counted by the rollout manager, read from another thread."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._state = (0, 0, 0, clock())  # done, total, response tokens, start time

    def start(self, total: int) -> None:
        """A rollout of `total` samples starts."""
        with self._lock:
            self._state = (0, total, 0, self._clock())

    def add(self, samples) -> None:
        """Samples finished (generated and rewarded); each counts its response tokens."""
        tokens = sum(int(getattr(s, "response_length", 0) or 0) for s in samples)
        with self._lock:
            done, total, num_tokens, started = self._state
            self._state = (done + len(samples), total, num_tokens + tokens, started)

    def snapshot(self) -> dict[str, float]:
        """{"done", "total", "tokens", "elapsed_s"} of the current rollout (plain types, for Ray)."""
        with self._lock:
            done, total, tokens, started = self._state
        return {"done": done, "total": total, "tokens": tokens, "elapsed_s": self._clock() - started}


def format_bar(
    label: str, done: int, total: int, tokens: int, elapsed_s: float, width: int = BAR_WIDTH
) -> str:
    """One progress line (see the section comment). Samples past `total` (over-sampling) show as `total`;
    rates and the ETA appear once a sample has finished."""
    shown = min(done, total)
    fraction = shown / total if total > 0 else 0.0
    filled = round(fraction * width)
    parts = [f"{label} |{'#' * filled}{'-' * (width - filled)}| {shown}/{total} samples {fraction:.0%}"]
    if done > 0 and elapsed_s > 0:
        rate = done / elapsed_s
        eta = (total - shown) / rate
        parts.append(f"{rate:.1f} samples/s {_human(tokens / elapsed_s)} tok/s")
        parts.append(f"{format_duration(elapsed_s)}, ETA {format_duration(eta)}")
    else:
        parts.append(format_duration(elapsed_s))
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """4.4 -> "4s", 125 -> "2m05s", 3725 -> "1h02m"."""
    total = round(max(seconds, 0.0))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


class ProgressBar:
    """Draws a rollout's counts: in place on a terminal, as spaced plain lines elsewhere (section comment)."""

    def __init__(self, label: str, *, file: TextIO | None = None, interval_s: float | None = DEFAULT_INTERVAL_S,
                 tty: bool | None = None, clock=time.monotonic) -> None:  # fmt: skip
        self.label = label
        self.file = file or sys.stdout
        self.tty = self.file.isatty() if tty is None else tty
        self.interval_s = interval_s
        self._clock = clock
        self._last_line_at = clock()  # plain lines: the first comes one interval after the start
        self._drawn = ""

    def update(self, counts: Mapping[str, float], *, final: bool = False) -> None:
        """Show `counts` (RolloutCounter.snapshot()) if it is time to. `final`: the rollout's last counts;
        off a terminal they are printed when the rollout lasted at least one interval (a short rollout
        stays silent, a long one ends with its totals)."""
        if self.interval_s is None:
            return
        line = format_bar(self.label, int(counts["done"]), int(counts["total"]), int(counts["tokens"]),
                          float(counts["elapsed_s"]))  # fmt: skip
        if self.tty:
            pad = " " * max(len(self._drawn) - len(line), 0)  # wipe the rest of a longer earlier line
            self.file.write(f"\r{line}{pad}")
            self.file.flush()
            self._drawn = line
        elif (final and float(counts["elapsed_s"]) >= self.interval_s) or (
            self._clock() - self._last_line_at >= self.interval_s
        ):
            print(line, file=self.file, flush=True)
            self._last_line_at = self._clock()

    def close(self) -> None:
        """End the bar's line on a terminal, so what is printed next starts on a line of its own."""
        if self.tty and self._drawn:
            self.file.write("\n")
            self.file.flush()
            self._drawn = ""


def poll_rollout_progress(manager, bar: ProgressBar, timeout_s: float = 2.0, *, final: bool = False) -> None:
    """Ask the rollout manager actor for its counts and update `bar` (`final`: the rollout has ended); a slow
    or failed answer only skips this update (the wait for the rollout itself has its own deadline)."""
    import ray

    try:
        counts = ray.get(manager.progress.remote(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
        return
    bar.update(counts, final=final)
