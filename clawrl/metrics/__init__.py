"""Metrics: the per-step logger (metrics.jsonl always; TensorBoard, W&B optional), the console progress
line, phase timers, checks that observe the metric stream (--ci-test), and the run report.

The report (clawrl.metrics.report, matplotlib) is not imported here, so logging stays light.
"""

from clawrl.metrics.checks import CITestChecks, MetricCheck, MetricCheckError, MetricThresholdCheck
from clawrl.metrics.jsonl import METRICS_FILE, MetricsFileError, read_metrics, read_run_info
from clawrl.metrics.logger import MetricLogger, flatten_train_metrics, normalize_metrics
from clawrl.metrics.progress import format_progress, print_progress
from clawrl.metrics.timer import Timers

__all__ = [
    "METRICS_FILE",
    "CITestChecks",
    "MetricCheck",
    "MetricCheckError",
    "MetricLogger",
    "MetricThresholdCheck",
    "MetricsFileError",
    "Timers",
    "flatten_train_metrics",
    "format_progress",
    "normalize_metrics",
    "print_progress",
    "read_metrics",
    "read_run_info",
]
