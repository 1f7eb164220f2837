"""MetricLogger: one JSON object per rollout step in <output_dir>/metrics.jsonl, plus TensorBoard and W&B.

    logger = MetricLogger("outputs/run1", run_name="run1", config=job.to_dict(), checks=[CITestChecks()])
    flat = logger.log(0, {"rollout/raw_reward": 0.4, "train": [{"train/loss": 0.1}, {"train/loss": 0.3}]})
    print_progress(0, 20, flat)
    logger.close()

Files under output_dir:
  metrics.jsonl   one line per `log` call, flushed as written (format: clawrl/metrics/jsonl.py)
  config.json     {"run_name", "time", "config"} written once when the logger starts (secrets redacted)
  tensorboard/    event files, with use_tensorboard
  wandb/          the W&B run directory, with use_wandb (offline mode needs no network)

Per-optimizer-step train metrics: the trainer returns `"train": [one dict per optimizer step]`. `log`
flattens that list with `flatten_train_metrics`: each key is logged as its mean over the optimizer steps,
and `<key>@first` holds the value at the first optimizer step that reported it (CI checks such as
`train/ppo_kl@first == 0` need the step before any update).

Steps must increase strictly: log each step once, with all of its metrics. A run started in a directory
whose metrics.jsonl already holds steps is refused unless it resumes. A resumed run continues the file:
lines at or after the resume step are dropped (they were logged after the checkpoint and are logged again)
and TensorBoard events from that step on are purged. The resume step is `resume_step=k` when given, else
(`resume=True`) the first step the resumed run logs. Checks (clawrl/metrics/checks.py) observe every
logged step after its line is written, so a failing run's last line is on disk.

Checks at close: `close()` runs the checks' end-of-run verdicts only when the run is ending well. Once a
check has failed, or while any exception is propagating (the loop's `finally: run.close()`), a verdict such
as "eval/gsm8k was never logged" would only bury the first error under a second one, so it is skipped. Then
the table of every check (measured values, bounds, results, and why a check could not run) is printed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from clawrl.metrics.checks import MetricCheck, MetricCheckError, format_check_table
from clawrl.metrics.jsonl import (
    CONFIG_FILE,
    METRICS_FILE,
    RESERVED_KEYS,
    encode_line,
    iter_lines,
    read_run_info,
)

WANDB_MODES = ("online", "offline", "disabled")
# Config fields never written to config.json, W&B or the report.
SECRET_FIELDS = frozenset({"wandb_key"})
REDACTED = "<redacted>"


def flatten_train_metrics(step_metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-optimizer-step dicts -> {key: mean over the steps that report it, key@first: first such value}.

    [{"train/loss": 1.0}, {"train/loss": 3.0}] -> {"train/loss": 2.0, "train/loss@first": 1.0}
    """
    values: dict[str, list[float]] = {}
    for index, step in enumerate(step_metrics):
        for key, value in step.items():
            values.setdefault(key, []).append(float(to_number(f"train[{index}][{key!r}]", value)))
    out: dict[str, float] = {}
    for key, series in values.items():
        out[key] = math.fsum(series) / len(series)
        out[f"{key}@first"] = series[0]
    return out


def to_number(key: str, value: Any) -> int | float:
    """A metric value as int or float; numpy scalars and one-element tensors are unwrapped."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if callable(getattr(value, "item", None)):
        try:
            item = value.item()
        except (ValueError, RuntimeError):
            raise ValueError(f"metric {key} must be a single number, got {value!r}") from None
        if isinstance(item, (int, float)):
            return to_number(key, item)
    raise ValueError(f"metric {key} must be a number, got {value!r}")


def normalize_metrics(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The flat {name: number} dict that is logged: a "train" list is flattened, values become numbers."""
    flat: dict[str, int | float] = {}
    for key, value in metrics.items():
        if key in RESERVED_KEYS:
            raise ValueError(f"metric name {key!r} is reserved for the metrics.jsonl record itself")
        if key == "train" and isinstance(value, (list, tuple)):
            flat.update(flatten_train_metrics(value))
        else:
            flat[key] = to_number(repr(key), value)
    return flat


def redact(config: Any) -> Any:
    """A copy of a nested config with the values of SECRET_FIELDS replaced by REDACTED."""
    if isinstance(config, Mapping):
        return {
            key: REDACTED if key in SECRET_FIELDS and value is not None else redact(value)
            for key, value in config.items()
        }
    if isinstance(config, (list, tuple)):
        return [redact(item) for item in config]
    return config


class MetricLogger:
    """Writes each step's metrics to metrics.jsonl (always), TensorBoard and W&B (optional); runs checks."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        run_name: str,
        config: Mapping[str, Any] | None = None,
        use_tensorboard: bool = False,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        wandb_group: str | None = None,
        wandb_key: str | None = None,
        wandb_mode: str | None = "offline",
        resume: bool = False,
        resume_step: int | None = None,
        checks: Sequence[MetricCheck] = (),
    ) -> None:
        """output_dir: created if needed; run_name: goes to config.json and W&B; config: the job's config
        (plain types; SECRET_FIELDS redacted); wandb_mode: online | offline | disabled, None = $WANDB_MODE
        or online; resume / resume_step: see the module docstring; checks: observers of every step."""
        # Optional dependencies (and the W&B mode) are checked before any file is touched, so a missing
        # one leaves no trace.
        self._summary_writer_cls = _import_summary_writer() if use_tensorboard else None
        wandb_mode = _resolve_wandb_mode(wandb_mode) if use_wandb else None
        wandb = _import_wandb() if use_wandb else None
        if resume_step is not None and (not isinstance(resume_step, int) or resume_step < 0):
            raise ValueError(f"MetricLogger: resume_step must be an integer >= 0, got {resume_step!r}")
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.run_name = run_name
        self.checks = list(checks)
        self.last_step: int | None = None
        """The last step in metrics.jsonl (None before the first log)."""
        self._resuming, self._resume_step = resume or resume_step is not None, resume_step
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._check_existing_file()
        self.config = redact(dict(config or {}))
        info = {"run_name": run_name, "time": time.time(), "config": self.config}
        _write_json_atomic(self.output_dir / CONFIG_FILE, info)
        self._file: TextIO | None = None  # opened by the first log, once the resume cut is known
        self._sinks: list[_TensorBoardSink | _WandbSink] = []
        self._closed = False
        self.check_failure: MetricCheckError | None = None
        """The first check that failed (then close() runs no end-of-run verdict)."""
        if wandb is not None:
            wandb_args = dict(project=wandb_project, group=wandb_group, key=wandb_key, mode=wandb_mode)
            self._sinks.append(_WandbSink(wandb, self.output_dir, run_name, self.config, **wandb_args))

    def _check_existing_file(self) -> None:
        """Refuse a metrics.jsonl holding steps unless resuming; when resuming, read it through now so a
        malformed line fails at start rather than at the first log."""
        if not self.path.is_file():
            return
        if not self._resuming:
            _refuse_existing(self.path, self.output_dir)
        else:
            for _ in iter_lines(self.path):
                pass

    def _start(self, first_step: int) -> None:
        """At the first log: cut a resumed file at the resume step (resume_step, else this first step),
        open metrics.jsonl for appending and the TensorBoard writer (purging events from the cut on)."""
        cut = self._resume_step if self._resume_step is not None else first_step
        if self._resuming and self.path.is_file():
            self.last_step = _keep_steps_before(self.path, cut)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        if self._summary_writer_cls is not None:
            purge_step = cut if self._resuming else None
            tb_sink = _TensorBoardSink(self._summary_writer_cls, self.output_dir / "tensorboard", purge_step)
            self._sinks.insert(0, tb_sink)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, int | float]:
        """Write one step's metrics (flattening a "train" list); returns the flat dict that was written."""
        if self._closed:
            raise RuntimeError(f"MetricLogger for {self.path} is closed; log(step={step}) came after close()")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"MetricLogger.log: step must be an integer >= 0, got {step!r}")
        if self._file is None:
            self._start(step)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(
                f"MetricLogger.log: step {step} <= last logged step {self.last_step} in {self.path}; "
                "log each step once, with all of its metrics"
            )
        flat = normalize_metrics(metrics)
        self._file.write(encode_line(step, time.time(), flat) + "\n")
        self._file.flush()
        self.last_step = step
        for sink in self._sinks:
            sink.log(step, flat)
        self._run_checks(step, metrics.get("train"), flat)
        return flat

    def _run_checks(self, step: int, train: Any, flat: dict[str, int | float]) -> None:
        per_step = [normalize_metrics(s) for s in train] if isinstance(train, (list, tuple)) else []
        try:
            for check in self.checks:
                if per_step:
                    check.on_train_steps(step, per_step)
                check.on_log(step, flat)
        except MetricCheckError as e:
            self.check_failure = self.check_failure or e
            raise

    def close(self) -> None:
        """Close the files and sinks; when the run ends well, run the checks' end-of-run verdicts; print
        the check table; raise the first verdict that failed."""
        self._finish(run_ended_well=sys.exc_info()[1] is None)

    def _finish(self, *, run_ended_well: bool) -> None:
        if self._closed:
            return
        self._close_outputs()
        failure = None
        if run_ended_well and self.check_failure is None:
            failure = self._close_checks()
        table = format_check_table(self.checks)
        if table:
            print(table, flush=True)
        if failure is not None:
            raise failure

    def _close_checks(self) -> MetricCheckError | None:
        """Every check's on_close (all of them, so the table is complete); returns the first failure."""
        first = None
        for check in self.checks:
            try:
                check.on_close()
            except MetricCheckError as e:
                first = first or e
        self.check_failure = first
        return first

    def _close_outputs(self) -> None:
        self._closed = True
        try:
            if self._file is not None:
                self._file.close()
        finally:
            for sink in self._sinks:
                sink.close()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._finish(run_ended_well=exc_type is None)


def _keep_steps_before(path: Path, cut: int) -> int | None:
    """Rewrite a metrics.jsonl keeping only its lines with step < cut (verbatim); returns their last step."""
    kept = [(line, record) for line, record in iter_lines(path) if record["step"] < cut]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line if line.endswith("\n") else line + "\n" for line, _ in kept), "utf-8")
    os.replace(tmp, path)
    return max((record["step"] for _, record in kept), default=None)


def _refuse_existing(path: Path, output_dir: Path) -> None:
    with open(path, encoding="utf-8") as f:
        num_lines = sum(1 for line in f if line.strip())
    if num_lines == 0:
        return
    try:
        info = read_run_info(output_dir)
    except ValueError:
        info = None
    owner = f"of run {info.get('run_name')!r} " if isinstance(info, dict) else ""
    raise FileExistsError(
        f"{path} already holds {num_lines} logged step(s) {owner}; resume that run (--load with its "
        "checkpoint), or choose another --output-dir / --run-name, or remove the file"
    )


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _import_summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "--use-tensorboard needs the tensorboard package: pip install 'clawrl[tensorboard]'"
        ) from None
    return SummaryWriter


def _resolve_wandb_mode(mode: str | None) -> str:
    """The W&B mode to use: the argument, else $WANDB_MODE, else online (W&B's own default)."""
    mode = mode or os.environ.get("WANDB_MODE") or "online"
    if mode not in WANDB_MODES:
        raise ValueError(f"--wandb-mode must be one of {list(WANDB_MODES)}, got {mode!r}")
    return mode


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise ImportError("--use-wandb needs the wandb package: pip install 'clawrl[wandb]'") from None
    return wandb


class _TensorBoardSink:
    """Scalars under their metric names, x axis = step; a resumed run purges events at steps >= resume."""

    def __init__(self, summary_writer_cls, log_dir: Path, purge_step: int | None) -> None:
        self.writer = summary_writer_cls(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, int | float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a crashed run keeps every step it logged, as metrics.jsonl does

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    """One W&B run per logger; files go to <output_dir>/wandb. Offline mode never touches the network."""

    def __init__(self, wandb, output_dir, run_name, config, *, project, group, key, mode) -> None:
        # The environment variable also reaches W&B's service process and any secondary processes.
        os.environ["WANDB_MODE"] = mode
        if key and mode == "online":
            os.environ["WANDB_API_KEY"] = key
        self.run = wandb.init(
            project=project or "clawrl", group=group, name=run_name, config=config, dir=str(output_dir),
            mode=mode,
        )  # fmt: skip

    def log(self, step: int, metrics: Mapping[str, int | float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
