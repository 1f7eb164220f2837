"""Worker process for the trainer integration tests: runs TrainActor steps on fixed batches, writes results.

    python tests/integration/trainer_worker.py --model DIR --rank R --world-size W --port P --out OUT.pt \
        [--steps 3] [--save DIR --save-after K] [--load DIR]

Writes {"metrics": [per-rollout metrics], "weights": {name: full tensor}} with torch.save (rank 0 only).
"""

import argparse

import torch

from clawrl.config.algo import AlgoConfig
from clawrl.config.job import JobConfig
from clawrl.config.model import ModelConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.train import TrainConfig
from clawrl.data.train_batch import TrainBatch
from clawrl.trainer.actor import TrainActor
from clawrl.trainer.weights import iter_full_tensors


def make_batch(rollout_id: int, vocab: int = 500) -> TrainBatch:
    """Six samples of different lengths; deterministic per rollout id."""
    gen = torch.Generator().manual_seed(100 + rollout_id)
    lengths, responses = [11, 6, 14, 9, 8, 12], [5, 2, 6, 3, 1, 4]
    tokens = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]
    masks = [[1] * r for r in responses]
    masks[2][1] = 0  # a tool-output token inside a response
    rewards = torch.randn(6, generator=gen).tolist()
    rollout_lp = [(-torch.rand(r, generator=gen) * 3).tolist() for r in responses]
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=responses, loss_masks=masks,
                      rewards=rewards, raw_rewards=rewards, rollout_log_probs=rollout_lp)  # fmt: skip


def make_job(model_dir: str, *, save=None, load=None, max_tokens=None, gbs=3, lr=1e-3) -> JobConfig:
    return JobConfig(
        model=ModelConfig(hf_checkpoint=model_dir, save=save, load=load),
        rollout=RolloutConfig(
            rollout_batch_size=3, n_samples_per_prompt=2, rollout_max_response_len=8, rollout_temperature=0.8
        ),  # fmt: skip
        train=TrainConfig(
            lr=lr,
            global_batch_size=gbs,
            use_dynamic_batch_size=max_tokens is not None,
            max_tokens_per_gpu=max_tokens,
            lr_warmup_iters=2,
            lr_decay_style="cosine",
            min_lr=1e-4,
            weight_decay=0.01,
        ),  # fmt: skip
        algo=AlgoConfig(
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="low_var_kl",
            entropy_coef=0.01,
            eps_clip=0.2,
            eps_clip_high=0.28,
        ),  # fmt: skip
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--first-rollout", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--global-batch-size", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    job = make_job(
        a.model, save=a.save, load=a.load, max_tokens=a.max_tokens, gbs=a.global_batch_size, lr=a.lr
    )
    actor = TrainActor(job, rank=a.rank, world_size=a.world_size, master_port=a.port, device="cpu")
    start = actor.init(total_optimizer_steps=20)
    assert start == a.first_rollout, (start, a.first_rollout)
    metrics = []
    for rollout_id in range(start, start + a.steps):
        metrics.append(actor.train(make_batch(rollout_id)))
        if a.save:
            actor.save(rollout_id)
    weights = {name: t.clone() for name, t in iter_full_tensors(actor.model)}
    if a.rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, a.out)
    actor.shutdown()


if __name__ == "__main__":
    main()
