"""Run report: PNG plots and an index.html from a run's metrics.jsonl and config.json.

    clawrl report outputs/run1                 # writes outputs/run1/report/{*.png, index.html}
    build_report("outputs/run1", out_dir=None) # the same from Python; returns the index.html path

Plots (clawrl/metrics/plots.py): reward, eval, KL to the reference, trainer vs engine log-probs, entropy,
response length, step-time breakdown. A plot whose metrics were never logged, or were 0 at every step, is
skipped and the page says why; a missing or empty metrics.jsonl, or a malformed line, raises
MetricsFileError naming the file (and line).
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clawrl.metrics.jsonl import METRICS_FILE, read_metrics, read_run_info
from clawrl.metrics.plots import PLOTS, Run

# Config fields shown in the summary table, in this order (the full config is on the page too, folded).
SUMMARY_FIELDS = (
    "run_name", "hf_checkpoint", "prompt_data", "advantage_estimator", "loss_type", "num_rollout",
    "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "rollout_max_response_len",
    "rollout_temperature", "lr", "use_kl_loss", "kl_loss_coef", "entropy_coef", "eps_clip", "eps_clip_high",
    "colocate", "actor_num_gpus_per_node", "rollout_num_gpus",
)  # fmt: skip
_STYLE = """body{font-family:sans-serif;margin:2em;max-width:70em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
td.num{text-align:right;font-family:monospace}.skipped{color:#777;font-style:italic}img{max-width:100%}"""


def build_report(output_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and index.html for the run in `output_dir` (default out: <output_dir>/report)."""
    output_dir = Path(output_dir)
    records = read_metrics(output_dir / METRICS_FILE)
    info = read_run_info(output_dir)
    out = Path(out_dir) if out_dir is not None else output_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    run = Run(records=sorted(records, key=lambda r: r["step"]))
    sections = []
    for spec in PLOTS:
        png = out / f"{spec.name}.png"
        drawn = spec.draw(run)
        if isinstance(drawn, str):
            png.unlink(missing_ok=True)  # an image left by an earlier report would contradict the note
            sections.append((spec.title, None, drawn))
        else:
            drawn.savefig(png)
            sections.append((spec.title, png.name, None))
    index = out / "index.html"
    index.write_text(render_html(output_dir, run, info, sections), encoding="utf-8")
    return index


def render_html(output_dir: Path, run: Run, info: Mapping[str, Any] | None, sections) -> str:
    """The report page: run name, plots (or skip notes), final values, config summary and full config."""
    config = info.get("config", info) if isinstance(info, Mapping) else None
    run_name = info.get("run_name") if isinstance(info, Mapping) and info.get("run_name") else output_dir.name
    steps = [r["step"] for r in run.records]
    parts = [
        f"<h1>{_esc(run_name)}</h1>",
        f"<p>{len(steps)} logged step(s), steps {steps[0]}..{steps[-1]}, from "
        f"<code>{_esc(output_dir / METRICS_FILE)}</code>; report made "
        f"{_esc(time.strftime('%Y-%m-%d %H:%M:%S'))}.</p>",
        "<h2>Plots</h2>",
        *(_plot_section(title, png, note) for title, png, note in sections),
        "<h2>Final values</h2>",
        _table(("metric", "last value", "at step"), _final_values(run)),
        "<h2>Config</h2>",
        _config_section(config),
    ]
    body = "\n".join(parts)
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>clawrl report: {_esc(run_name)}</title>'
        f"<style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def _plot_section(title: str, png: str | None, note: str | None) -> str:
    if png is None:
        return f'<h3>{_esc(title)}</h3>\n<p class="skipped">skipped: {_esc(note)}</p>'
    return f'<h3>{_esc(title)}</h3>\n<img src="{_esc(png)}" alt="{_esc(title)}">'


def _final_values(run: Run) -> list[tuple[str, str, str]]:
    last: dict[str, tuple[Any, int]] = {}
    for record in run.records:
        for key, value in record.items():
            if key not in ("step", "time"):
                last[key] = (value, record["step"])
    return [(key, _format(value), str(step)) for key, (value, step) in sorted(last.items())]


def _config_section(config: Any) -> str:
    if not isinstance(config, Mapping):
        return '<p class="skipped">no config.json in the output directory: config not shown</p>'
    flat = _flatten(config)
    by_field = {key.rsplit(".", 1)[-1]: (key, value) for key, value in flat.items()}
    summary = [(by_field[f][0], _format(by_field[f][1])) for f in SUMMARY_FIELDS if f in by_field]
    full = [(key, _format(value)) for key, value in flat.items()]
    return (
        _table(("field", "value"), summary)
        + f"\n<details><summary>full config ({len(full)} fields)</summary>\n"
        + _table(("field", "value"), full)
        + "\n</details>"
    )


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"rollout": {"lr": 1}} -> {"rollout.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _table(header: tuple[str, ...], rows) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td{_num_class(cell)}>{_esc(cell)}</td>" for cell in row) + "</tr>\n"
        for row in rows
    )
    return f"<table>\n<tr>{head}</tr>\n{body}</table>"


def _num_class(cell: str) -> str:
    try:
        float(cell)
    except ValueError:
        return ""
    return ' class="num"'


def _format(value: Any) -> str:
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)
