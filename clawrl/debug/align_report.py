"""Numbers and text of `clawrl debug align`: engine vs trainer, per response position and per layer.

    stats = AlignStats(layer_names(num_layers), tolerance=1e-5)
    stats.add(sample_id, sample, engine_trace, trainer_trace)     # once per sample
    summary = stats.summary(decode=tokenizer.decode)               # plain dict, what --json-out writes
    print(format_report(summary))

Log-probs: |logp_engine - logp_trainer| over every response position (max, mean, p50/p90/p99, how many
exceed the tolerance, the worst five). Hidden states: per captured module, max and mean of
|h_engine - h_trainer| over every element at the positions both sides computed (all but each sample's last
token). The first module in forward order whose max exceeds the tolerance is named as the first divergence:
a difference that starts there and grows downstream points at that module's weights or kernels.

When the samples carry the log-probs recorded at rollout time (`rollout_log_probs`), each side is also
compared with them over the trained (loss-mask 1) tokens; |trainer - recorded| is the quantity training logs
as train/train_rollout_logprob_abs_diff.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from clawrl.data.sample import Sample
from clawrl.debug.align_capture import describe_layer
from clawrl.debug.align_engine import SideTrace

NUM_WORST = 5


class AlignStats:
    """Accumulates the engine/trainer differences of many samples."""

    def __init__(self, names: list[str], *, tolerance: float) -> None:
        self.names, self.tolerance = names, tolerance
        self._lp_diffs: list[np.ndarray] = []
        self._lp_where: list[tuple[int, int, int, float, float]] = []  # sample, response pos, token, e, t
        self._layer_max = np.zeros(len(names))
        self._layer_sum = np.zeros(len(names))
        self._layer_count = 0  # elements (positions x hidden size) per module
        self._num_hidden_positions = 0
        self._recorded: dict[str, list[np.ndarray]] = {"engine": [], "trainer": []}

    def add(self, sample_id: int, sample: Sample, engine: SideTrace, trainer: SideTrace) -> None:
        """Add one sample's two traces (same tokens, same positions)."""
        assert engine.hidden_KPH.shape == trainer.hidden_KPH.shape, (
            engine.hidden_KPH.shape,
            trainer.hidden_KPH.shape,
        )
        engine_lp = engine.log_probs_R.double().numpy()
        trainer_lp = trainer.log_probs_R.double().numpy()
        self._lp_diffs.append(np.abs(engine_lp - trainer_lp))
        response = sample.tokens[len(sample.tokens) - sample.response_length :]
        for j, token in enumerate(response):
            self._lp_where.append((sample_id, j, int(token), float(engine_lp[j]), float(trainer_lp[j])))
        diff_KPH = (engine.hidden_KPH.double() - trainer.hidden_KPH.double()).abs()
        self._layer_max = np.maximum(self._layer_max, diff_KPH.amax(dim=(1, 2)).numpy())
        self._layer_sum += diff_KPH.sum(dim=(1, 2)).numpy()
        self._layer_count += diff_KPH.shape[1] * diff_KPH.shape[2]
        self._num_hidden_positions += diff_KPH.shape[1]
        if sample.rollout_log_probs is not None:
            mask = np.array(sample.loss_mask or [1] * sample.response_length, dtype=bool)
            recorded = np.array(sample.rollout_log_probs, dtype=np.float64)
            self._recorded["engine"].append(np.abs(engine_lp - recorded)[mask])
            self._recorded["trainer"].append(np.abs(trainer_lp - recorded)[mask])

    def summary(self, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
        """Every number of the report as plain types; `decode` adds each worst token's text."""
        diffs = np.concatenate(self._lp_diffs) if self._lp_diffs else np.zeros(0)
        layers = [
            {"name": name, "max": float(mx), "mean": float(total / max(self._layer_count, 1))}
            for name, mx, total in zip(self.names, self._layer_max, self._layer_sum, strict=True)
        ]
        first = next((layer for layer in layers if layer["max"] > self.tolerance), None)
        return {
            "tolerance": self.tolerance,
            "num_samples": len(self._lp_diffs),
            "num_positions": int(diffs.size),
            "logprob": self._logprob_summary(diffs, decode),
            "layers": layers,
            "num_hidden_positions": self._num_hidden_positions,
            "first_divergence": None if first is None else {"layer": first["name"], "max": first["max"]},
            "recorded": self._recorded_summary(),
        }

    def _logprob_summary(self, diffs: np.ndarray, decode) -> dict[str, Any]:
        if not diffs.size:
            return {}
        order = np.argsort(-diffs, kind="stable")[:NUM_WORST]
        worst = []
        for i in order:
            sample_id, position, token, engine_lp, trainer_lp = self._lp_where[i]
            entry = {"sample": sample_id, "position": position, "token": token, "abs_diff": float(diffs[i]),
                     "engine": engine_lp, "trainer": trainer_lp}  # fmt: skip
            if decode is not None:
                entry["text"] = decode([token])
            worst.append(entry)
        return {
            "max": float(diffs.max()), "mean": float(diffs.mean()),
            "p50": float(np.percentile(diffs, 50)), "p90": float(np.percentile(diffs, 90)),
            "p99": float(np.percentile(diffs, 99)),
            "num_above_tolerance": int((diffs > self.tolerance).sum()), "worst": worst,
        }  # fmt: skip

    def _recorded_summary(self) -> dict[str, Any] | None:
        if not self._recorded["engine"]:
            return None
        out = {}
        for side, parts in self._recorded.items():
            values = np.concatenate(parts)
            out[side] = {"max": float(values.max()) if values.size else 0.0,
                         "mean": float(values.mean()) if values.size else 0.0, "count": int(values.size)}  # fmt: skip
        return out


def format_report(summary: dict[str, Any]) -> str:
    """The terminal report of a `summary`."""
    tol = summary["tolerance"]
    lp = summary["logprob"]
    lines = [
        f"samples {summary['num_samples']}, response positions {summary['num_positions']}, tolerance {tol:.0e}",
        "",
        "|logp_engine - logp_trainer| over response positions:",
        f"  max {lp['max']:.3e}  mean {lp['mean']:.3e}  p50 {lp['p50']:.3e}  p90 {lp['p90']:.3e}  "
        f"p99 {lp['p99']:.3e}  above tolerance {lp['num_above_tolerance']}/{summary['num_positions']}",
        "  worst positions (sample, response position, token):",
    ]
    for w in lp["worst"]:
        text = f" {w['text']!r}" if "text" in w else ""
        lines.append(
            f"    sample {w['sample']:>3}  pos {w['position']:>4}  token {w['token']:>6}{text:<12}  "
            f"|d| {w['abs_diff']:.3e}  engine {w['engine']:.6f}  trainer {w['trainer']:.6f}"
        )
    lines += [
        "",
        f"|h_engine - h_trainer| per layer over {summary['num_hidden_positions']} positions (max, mean):",
    ]
    for layer in summary["layers"]:
        flag = "  <-- above tolerance" if layer["max"] > tol else ""
        lines.append(
            f"  {describe_layer(layer['name']):<12} max {layer['max']:.3e}  mean {layer['mean']:.3e}{flag}"
        )
    lines.append("")
    first = summary["first_divergence"]
    if first is None:
        lines.append(f"no divergence above {tol:.0e}")
    else:
        lines.append(
            f"first divergence: {describe_layer(first['layer'])} (max |dh| {first['max']:.1e} > {tol:.0e})"
        )
    check = summary.get("sampler_check")
    if check is not None and check["num_steps"]:
        lines.append(
            f"engine self-check: at the {check['num_steps']} steps where the engine's sampler drew the recorded "
            f"token again, |forced log-prob - sampler's log-prob| max {check['max_abs_diff']:.3e}"
        )
    recorded = summary["recorded"]
    if recorded is not None:
        lines.append(
            f"recorded rollout log-probs ({recorded['engine']['count']} trained tokens): "
            f"|engine now - recorded| max {recorded['engine']['max']:.3e} mean {recorded['engine']['mean']:.3e}; "
            f"|trainer - recorded| max {recorded['trainer']['max']:.3e} mean {recorded['trainer']['mean']:.3e}"
        )
    return "\n".join(lines)
