"""What the trainer actually consumed, per sample: the records behind `--save-debug-train-data`.

One record per sample this rank trained on, built from the tensors the step already computed (no extra
forward pass): tokens, loss mask, rollout / trainer / reference log-probs, advantages, returns, per-token KL
and entropy, and where the sample ran (rank, optimizer step, micro-batch). Every value is a plain number or
a CPU tensor, so the driver writes them with `torch.save` and they load with `weights_only=True`.

    recorder = TrainDataRecorder(rank, kl_type)
    recorder.add_micro_batch(step_index, mb_index, mb, entropy_M)   # during each optimizer step
    records = recorder.records(batch, log_probs=..., ref_log_probs=..., advantages=..., returns=...)

Entropy is that of the training forward of the sample's own optimizer step (the first step of a rollout
runs with the weights that computed `log_probs`, later steps with updated ones).
"""

from __future__ import annotations

from typing import Any

import torch

from clawrl.algo import kl_estimate
from clawrl.data.train_batch import TrainBatch

TRAIN_RECORDS_KEY = "debug/train_records"
"""Key of `TrainActor.train()`'s per-sample records in its result; not a metric: the driver pops it."""


class TrainDataRecorder:
    """Collects one rank's per-sample training data for one rollout."""

    def __init__(self, rank: int, kl_type: str) -> None:
        self.rank, self.kl_type = rank, kl_type
        self._placement: dict[int, tuple[int, int]] = {}  # sample index -> (optimizer step, micro-batch)
        self._entropy: dict[int, torch.Tensor] = {}

    def add_micro_batch(self, step_index: int, mb_index: int, mb, entropy_M: torch.Tensor | None) -> None:
        """Record where the micro-batch's samples ran and their per-token entropy in that forward."""
        if mb.is_dummy:
            return
        parts = entropy_M.detach().float().cpu().split(mb.response_lengths) if entropy_M is not None else None
        for j, sid in enumerate(mb.sample_ids):
            self._placement[sid] = (step_index, mb_index)
            if parts is not None:
                self._entropy[sid] = parts[j].clone()

    def records(self, batch: TrainBatch, *, log_probs: dict, ref_log_probs: dict | None, advantages: dict,
                returns: dict) -> list[dict[str, Any]]:  # fmt: skip
        """One plain record per sample this rank trained on, in rollout order."""
        out = []
        for sid in sorted(log_probs):
            step, mb = self._placement.get(sid, (-1, -1))
            ref = _cpu(ref_log_probs[sid]) if ref_log_probs is not None else None
            lp = _cpu(log_probs[sid])
            out.append({
                "rollout_position": sid,
                "sample_index": _at(batch.sample_indices, sid),
                "group_index": _at(batch.group_indices, sid),
                "rank": self.rank, "optimizer_step": step, "micro_batch": mb,
                "tokens": torch.tensor(batch.tokens[sid], dtype=torch.long),
                "response_length": batch.response_lengths[sid],
                "loss_mask": torch.tensor(batch.loss_masks[sid], dtype=torch.int8),
                "reward": float(batch.rewards[sid]), "raw_reward": float(batch.raw_rewards[sid]),
                "rollout_log_probs": (
                    torch.tensor(batch.rollout_log_probs[sid], dtype=torch.float32)
                    if batch.rollout_log_probs is not None else None
                ),
                "log_probs": lp, "ref_log_probs": ref,
                "advantages": _cpu(advantages[sid]), "returns": _cpu(returns[sid]) if sid in returns else None,
                "kl": kl_estimate(lp, ref, self.kl_type).float() if ref is not None else None,
                "entropy": self._entropy.get(sid),
            })  # fmt: skip
        return out


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().cpu().clone()


def _at(values: list | None, i: int):
    return None if values is None else values[i]
