"""The run report's plots: one function per PNG, each drawing from a run's metric records.

Each plot function takes a `Run` and returns a matplotlib Figure, or a string saying why the plot was
skipped (its metrics were never logged). Figures are drawn on the Agg canvas directly (no pyplot), so no
display and no global figure state are involved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from clawrl.metrics.progress import eval_names

# Trainer timers that run inside the loop's "train" phase; stacking them on perf/train_time would count
# that time twice, so they are left out of the step-time bars whenever perf/train_time was logged.
TRAIN_INNER_PHASES = ("log_probs", "ref_log_probs", "actor_train", "data_preprocess", "engine_release",
                      "trainer_onload", "trainer_offload")  # fmt: skip
# perf/rollout_<part>_time (clawrl/rollout/timeline.py) split perf/rollout_time the same way: never stacked.
ROLLOUT_INNER_PREFIX = "rollout_"
# Stacking order of the step-time bars (bottom first): the loop's phases in the order they run.
PHASE_ORDER = (
    "rollout",
    "log_probs",
    "ref_log_probs",
    "actor_train",
    "train",
    "update_weights",
    "eval",
    "save",
)
X_LABEL = "rollout step"


@dataclass(kw_only=True)
class Run:
    """A run's logged metrics, in step order."""

    records: list[dict[str, Any]]
    """One dict per logged step: {"step": int, "time": float, metric: value, ...}."""

    def metric_names(self) -> set[str]:
        """Every metric name logged at least once."""
        return {key for record in self.records for key in record} - {"step", "time"}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps that logged `key`."""
        pairs = [(r["step"], float(r[key])) for r in self.records if key in r]
        return [s for s, _ in pairs], [v for _, v in pairs]


@dataclass(kw_only=True)
class PlotSpec:
    """One plot of the report."""

    name: str
    """File stem: <name>.png."""
    title: str
    """Heading in the report and on the figure."""
    draw: Callable[[Run], Figure | str]
    """Draws the figure, or returns why it was skipped."""


def _figure(title: str, y_label: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole rollouts: no 0.5 ticks
    return fig, ax


def _lines(run: Run, title: str, y_label: str, curves: list[tuple[str, str]], marker: str = "") -> Figure:
    """One line per (metric key, legend label)."""
    fig, ax = _figure(title, y_label)
    for key, label in curves:
        ax.plot(*run.series(key), marker=marker, label=label)
    ax.legend(loc="best")
    return fig


REWARD_CURVES = (
    ("rollout/raw_reward", "rollout/raw_reward"),
    ("rollout/rewards", "rollout/rewards (post-processed)"),
)


def plot_reward(run: Run) -> Figure | str:
    curves = [(key, label) for key, label in REWARD_CURVES if key in run.metric_names()]
    if not curves:
        return "neither rollout/raw_reward nor rollout/rewards was logged"
    return _lines(run, "Reward", "mean reward", curves)


def plot_eval(run: Run) -> Figure | str:
    names = eval_names(run.metric_names())
    if not names:
        return "no eval/<name> metric was logged (no eval ran)"
    return _lines(run, "Eval", "score", [(f"eval/{n}", f"eval/{n}") for n in names], marker="o")


def _difference(run: Run, minuend: str, subtrahend: str) -> tuple[list[int], list[float]]:
    """(steps, minuend - subtrahend) of the steps that logged both; ([], []) if none did."""
    rows = [r for r in run.records if minuend in r and subtrahend in r]
    return [r["step"] for r in rows], [float(r[minuend]) - float(r[subtrahend]) for r in rows]


def _always_zero(values: list[float]) -> bool:
    return bool(values) and all(v == 0 for v in values)


def _series_plot(title: str, y_label: str, series: list[tuple[str, tuple[list[int], list[float]]]],
                 missing: str) -> Figure | str:  # fmt: skip
    """Lines for the logged series (label, (steps, values)); a series that is 0 at every step is left out
    and named in the title, since a flat line at 0 shows nothing; if nothing else is left, the plot is
    skipped with the reason (`missing` when no series was logged at all)."""
    logged = [(label, xy) for label, xy in series if xy[0]]
    if not logged:
        return missing
    zero = [label for label, (_, values) in logged if _always_zero(values)]
    drawn = [(label, xy) for label, xy in logged if label not in zero]
    if not drawn:
        return f"{' and '.join(zero)}: 0 at every logged step, nothing to draw"
    fig, ax = _figure(title, y_label)
    if zero:
        ax.set_title(f"{title}\n({', '.join(zero)}: 0 at every step, not drawn)", fontsize="medium")
    for label, (steps, values) in drawn:
        ax.plot(steps, values, label=label)
    ax.legend(loc="best")
    return fig


def plot_kl(run: Run) -> Figure | str:
    """The KL to the reference model. train/ppo_kl (to the weights that generated the rollout) is drawn only
    where it moves: with one optimizer step per rollout it is 0 by construction."""
    to_ref = _difference(run, "rollout/log_probs", "rollout/ref_log_probs")
    series = [
        ("train/kl_loss", run.series("train/kl_loss")),
        ("rollout/log_probs - rollout/ref_log_probs", to_ref),
        ("train/ppo_kl", run.series("train/ppo_kl")),
    ]
    missing = "none of train/kl_loss, rollout/log_probs with rollout/ref_log_probs, train/ppo_kl was logged"
    return _series_plot("KL to the reference", "KL (nats per token)", series, missing)


def plot_mismatch(run: Run) -> Figure | str:
    """How far the trainer's log-probs of the sampled tokens are from the engine's (same weights)."""
    abs_diff = "train/train_rollout_logprob_abs_diff"
    series = [
        (abs_diff, run.series(abs_diff)),
        (
            "rollout/log_probs - rollout/rollout_log_probs",
            _difference(run, "rollout/log_probs", "rollout/rollout_log_probs"),
        ),
    ]
    missing = "neither train/train_rollout_logprob_abs_diff nor rollout/rollout_log_probs was logged"
    return _series_plot("Trainer vs engine log-probs", "log-prob difference (nats)", series, missing)


def plot_entropy(run: Run) -> Figure | str:
    if "train/entropy_loss" not in run.metric_names():
        return "train/entropy_loss was not logged"
    return _lines(run, "Entropy", "mean token entropy (nats)", [("train/entropy_loss", "train/entropy_loss")])


def plot_response_length(run: Run) -> Figure | str:
    keys = run.metric_names()
    if "rollout/response_len/mean" not in keys:
        return "rollout/response_len/mean was not logged"
    fig, ax = _figure("Response length", "tokens")
    if {"rollout/response_len/min", "rollout/response_len/max"} <= keys:
        rows = [r for r in run.records if "rollout/response_len/min" in r and "rollout/response_len/max" in r]
        low = [float(r["rollout/response_len/min"]) for r in rows]
        high = [float(r["rollout/response_len/max"]) for r in rows]
        ax.fill_between([r["step"] for r in rows], low, high, alpha=0.25, label="min - max")
    ax.plot(*run.series("rollout/response_len/mean"), label="rollout/response_len/mean")
    ax.legend(loc="best")
    return fig


def step_time_phases(keys: set[str]) -> list[str]:
    """The perf/<phase>_time keys stacked in the step-time plot, bottom first: loop order, then by name."""
    phases = [k[len("perf/") : -len("_time")] for k in keys if k.startswith("perf/") and k.endswith("_time")]
    phases = [p for p in phases if p != "step" and not p.startswith(ROLLOUT_INNER_PREFIX)]
    if "train" in phases:
        phases = [p for p in phases if p not in TRAIN_INNER_PHASES]
    rank = {phase: i for i, phase in enumerate(PHASE_ORDER)}
    return [f"perf/{p}_time" for p in sorted(phases, key=lambda p: (rank.get(p, len(rank)), p))]


def plot_step_time(run: Run) -> Figure | str:
    keys = run.metric_names()
    phases = step_time_phases(keys)
    if not phases:
        return "no perf/<phase>_time metric was logged"
    fig, ax = _figure("Step time breakdown", "seconds")
    steps = [r["step"] for r in run.records]
    bottom = [0.0] * len(steps)
    for key in phases:
        heights = [float(r.get(key, 0.0)) for r in run.records]
        ax.bar(steps, heights, bottom=bottom, label=key[len("perf/") : -len("_time")])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if "perf/step_time" in keys:
        ax.plot(
            *run.series("perf/step_time"), "k_", markersize=14, markeredgewidth=2, label="step_time (wall)"
        )
    handles, labels = ax.get_legend_handles_labels()
    # legend beside the bars, listed top-down like the stack
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


PLOTS = (
    PlotSpec(name="reward", title="Reward", draw=plot_reward),
    PlotSpec(name="eval", title="Eval", draw=plot_eval),
    PlotSpec(name="kl", title="KL to the reference", draw=plot_kl),
    PlotSpec(name="mismatch", title="Trainer vs engine log-probs", draw=plot_mismatch),
    PlotSpec(name="entropy", title="Entropy", draw=plot_entropy),
    PlotSpec(name="response_length", title="Response length", draw=plot_response_length),
    PlotSpec(name="step_time", title="Step time breakdown", draw=plot_step_time),
)
