"""The trainer side of the flag-to-loss tests: one rollout of fixed samples through `clawrl train`'s flags,
reward post-processing and the real TrainActor, recording each optimizer step's metrics and gradients.

In-process (1 rank) the test calls `train_rollout`; for several ranks it starts this file once per rank:

    python tests/integration/flag_to_loss_worker.py --spec SPEC.pt --rank R --world-size W --out OUT.pt

SPEC.pt holds {"samples": [Sample dicts], "cases": [{"argv": [...], "port": P}, ...]}; rank 0 writes
OUT.pt = [train_rollout's result per case]. Also home of `custom_loss`, the --custom-loss-function-path
plugin of the custom_loss case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # trainer_reference, when run as a script

from trainer_reference import StepRecorder  # noqa: E402

from clawrl.config.flags import parse_job_args  # noqa: E402
from clawrl.data.sample import Sample, Status  # noqa: E402
from clawrl.rollout.manager import train_batch_from_groups  # noqa: E402
from clawrl.trainer.actor import TrainActor  # noqa: E402

N_SAMPLES_PER_PROMPT = 4
GLOBAL_BATCH_SIZE = 4
MAX_RESPONSE_LEN = 8
TEMPERATURE = 0.8
LAYOUTS = {
    "packed": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"],
    "mbs1": ["--micro-batch-size", "1"],
    "mbs3": ["--micro-batch-size", "3"],
    "mbs4": ["--micro-batch-size", "4"],
}
"""Micro-batching: packed by a token budget (several samples per pass), or a fixed number of samples."""


def job_argv(policy: str, ref: str, layout: str, flags: list[str]) -> list[str]:
    """`clawrl train` flags of a case: 8 samples (2 prompts x 4), 2 optimizer steps of 4 samples."""
    return [
        "--hf-checkpoint", policy, "--ref-load", ref, "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", str(N_SAMPLES_PER_PROMPT),
        "--rollout-max-response-len", str(MAX_RESPONSE_LEN), "--rollout-temperature", str(TEMPERATURE),
        "--global-batch-size", str(GLOBAL_BATCH_SIZE), "--lr", "1e-2", "--clip-grad", "0",
        *LAYOUTS[layout], *flags,
    ]  # fmt: skip


def groups_of(samples: list[dict]) -> list[list[Sample]]:
    """Fresh Sample objects (train_batch_from_groups writes into them), in prompt groups."""
    objs = [Sample.from_dict(s) for s in samples]
    return [objs[i : i + N_SAMPLES_PER_PROMPT] for i in range(0, len(objs), N_SAMPLES_PER_PROMPT)]


def train_rollout(argv: list[str], samples: list[dict], *, rank: int = 0, world_size: int = 1,
                  port: int | None = None) -> dict:  # fmt: skip
    """Parse the flags, build the TrainBatch as the rollout manager does, run one TrainActor.train.

    Returns {"metrics": train()'s dict, "grads": [per step {name: full grad}], "weights": [per step
    {name: full weight after the step}]} (gradients as the optimizer saw them, before its step)."""
    job = parse_job_args(argv)
    batch, _, _ = train_batch_from_groups(job, 0, groups_of(samples), "flag-to-loss test")
    actor = TrainActor(job, rank=rank, world_size=world_size, master_port=port, device="cpu")
    try:
        actor.init(total_optimizer_steps=2)
        recorder = StepRecorder(actor)
        metrics = actor.train(batch)
    finally:
        actor.shutdown()
    return {"metrics": metrics, "grads": recorder.grads, "weights": recorder.weights}


def custom_loss(args, batch, logits, sum_of_sample_mean):
    """--custom-loss-function-path plugin: -A * logp + 0.5 * (logp - old)^2 per token, reduced as given;
    logp from the response logits it receives (already divided by the rollout temperature)."""
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
    per_token = -batch["advantages"] * log_probs + 0.5 * (log_probs - batch["old_log_probs"]).square()
    return sum_of_sample_mean(per_token), {"custom_advantage": sum_of_sample_mean(batch["advantages"])}


def sample(*, index: int, group: int, tokens: list[int], response_length: int, reward: float,
           loss_mask: list[int] | None = None, rollout_log_probs: list[float], removed: bool = False) -> dict:  # fmt: skip
    """A finished, rewarded sample as a plain dict."""
    return Sample(
        index=index, group_index=group, tokens=tokens, response_length=response_length, reward=reward,
        loss_mask=loss_mask, rollout_log_probs=rollout_log_probs, status=Status.COMPLETED,
        remove_sample=removed,
    ).to_dict()  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    spec = torch.load(a.spec, weights_only=True)
    results = [
        train_rollout(case["argv"], spec["samples"], rank=a.rank, world_size=a.world_size, port=case["port"])
        for case in spec["cases"]
    ]
    if a.rank == 0:
        torch.save(results, a.out)


if __name__ == "__main__":
    main()
