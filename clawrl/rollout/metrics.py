"""Rollout and evaluation metrics (slime's names where slime has them), from finished samples.

Rollout (one dict per `RolloutManager.generate`):
    rollout/raw_reward                    mean reward as the reward function returned it
    rollout/response_len/{mean,median,max,min}   effective response length (trained tokens)
    rollout/truncated_ratio               share of samples that hit the length limit
    rollout/zero_std/count_<reward>       kept groups whose rewards are all equal to <reward> (not for ppo)
    rollout/dynamic_filter/drop_<reason>  groups dropped by the dynamic filter, per reason
    rollout/aborted_samples               leftover samples aborted on the engines after the batch was full
    rollout/weight_version{,_max}         oldest / newest engine weight version that produced the batch
                                          (numeric versions only; the loop's versions are rollout counts)
    rollout/weight_staleness/{max,mean}   per sample: rollout id - its oldest weight version (versions the
                                          trainer is ahead; added by the manager, clawrl/rollout/partial.py)
    rollout/partial/{requeued_groups,resumed_samples,dropped_stale_groups}   --partial-rollout (same module)
    rollout/text/{empty_ratio,bad_char_ratio,repetition}   does the decoded text look like language?
                                          (clawrl/debug/language.py; judged by the text check in
                                          clawrl/metrics/checks.py: a warning, or a failure under --ci-test)
    multi_turn/*                          turns and tool calls/errors/timeouts of multi-turn tool rollouts
                                          (clawrl/rollout/multi_turn.py: multi_turn_metrics)
    perf/rollout_time                     seconds for the whole rollout
    perf/tokens_per_gpu_per_sec           response tokens of the batch / rollout time / rollout devices
                                          (GPUs; on CPU, engine processes: "tok/s/engine" on the console)
    perf/longest_sample_tokens_per_sec    longest response / rollout time
Evaluation (per dataset <name>):
    eval/<name>                           mean reward
    eval/<name>-truncated_ratio           share of truncated responses
    eval/<name>/response_len/mean         mean response length (when samples are known)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from clawrl.data.sample import Sample, Status
from clawrl.debug.language import text_metrics
from clawrl.rollout.multi_turn import multi_turn_metrics


def rollout_metrics(
    groups: list[list[Sample]],
    raw_rewards: list[float],
    *,
    estimator: str,
    drops: Mapping[str, int],
    num_aborted_samples: int,
    rollout_time_s: float,
    num_rollout_devices: int,
) -> dict[str, float]:
    """The metrics of one training rollout; `raw_rewards` are in the order of the flattened `groups`."""
    samples = [s for group in groups for s in group]
    lengths = [s.effective_response_length for s in samples]
    metrics: dict[str, float] = {
        "rollout/raw_reward": statistics.fmean(raw_rewards),
        "rollout/response_len/mean": statistics.fmean(lengths),
        "rollout/response_len/median": float(statistics.median(lengths)),
        "rollout/response_len/max": float(max(lengths)),
        "rollout/response_len/min": float(min(lengths)),
        "rollout/truncated_ratio": statistics.fmean(s.status == Status.TRUNCATED for s in samples),
        "rollout/aborted_samples": float(num_aborted_samples),
        "perf/rollout_time": rollout_time_s,
    }
    metrics.update(_weight_versions(samples))
    metrics.update(multi_turn_metrics(samples))  # {} unless clawrl.rollout.multi_turn.generate ran
    metrics.update({f"rollout/text/{k}": v for k, v in text_metrics([s.response for s in samples]).items()})
    if estimator != "ppo":
        metrics.update(_zero_std_counts(groups, raw_rewards))
    for reason, count in sorted(drops.items()):
        metrics[f"rollout/dynamic_filter/drop_{reason}"] = float(count)
    elapsed = max(rollout_time_s, 1e-9)
    response_tokens = sum(s.response_length for s in samples)
    metrics["perf/tokens_per_gpu_per_sec"] = response_tokens / elapsed / max(num_rollout_devices, 1)
    metrics["perf/longest_sample_tokens_per_sec"] = max(s.response_length for s in samples) / elapsed
    return metrics


def _weight_versions(samples: list[Sample]) -> dict[str, float]:
    versions = [v for s in samples for v in s.weight_versions]
    try:
        numeric = [float(v) for v in versions]
    except ValueError:  # an external engine's version names (e.g. "default") carry no order
        return {}
    if not numeric:
        return {}
    return {"rollout/weight_version": min(numeric), "rollout/weight_version_max": max(numeric)}


def _zero_std_counts(groups: list[list[Sample]], raw_rewards: list[float]) -> dict[str, float]:
    counts: dict[str, float] = {}
    start = 0
    for group in groups:
        rewards = raw_rewards[start : start + len(group)]
        start += len(group)
        if len(group) > 1 and len(set(rewards)) == 1:
            key = f"rollout/zero_std/count_{rewards[0]}"
            counts[key] = counts.get(key, 0.0) + 1.0
    return counts


def eval_metrics(name: str, data: Mapping[str, Any]) -> dict[str, float]:
    """eval/<name> metrics from {"rewards": [...], "truncated": [...] (optional), "samples": [...] (optional)}."""
    rewards = [float(r) for r in data["rewards"]]
    samples = data.get("samples") or []
    truncated = data.get("truncated")
    if truncated is None:
        truncated = [s.status == Status.TRUNCATED for s in samples]
    metrics = {f"eval/{name}": statistics.fmean(rewards) if rewards else 0.0}
    if truncated:
        metrics[f"eval/{name}-truncated_ratio"] = statistics.fmean(bool(t) for t in truncated)
    if samples:
        metrics[f"eval/{name}/response_len/mean"] = statistics.fmean(s.response_length for s in samples)
    return metrics
