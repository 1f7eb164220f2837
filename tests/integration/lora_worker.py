"""Worker process of tests/integration/test_lora_fsdp.py: one TrainActor rank with LoRA on fixed batches.

    python tests/integration/lora_worker.py --model DIR --rank R --world-size W --port P --out OUT.pt \
        [--save DIR] [--load DIR] [--rollouts 2]

Writes (rank 0) {"metrics": [per rollout], "merged": [per rollout: {HF name: merged tensor}],
"adapter": {name: tensor}, "base_unchanged": bool} with torch.save.
"""

import argparse

import torch

from clawrl.config.flags import parse_job_args
from clawrl.data.train_batch import TrainBatch
from clawrl.models.loader import iter_safetensors
from clawrl.trainer.actor import TrainActor
from clawrl.trainer.fsdp import reshard_all
from clawrl.trainer.weights import iter_adapter_tensors, iter_full_tensors

RESPONSE_LENGTHS = [4, 3, 5, 2, 6, 1]


def make_batch(rollout_id: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(10 + rollout_id)
    tokens = [torch.randint(1, 500, (3 + r,), generator=gen).tolist() for r in RESPONSE_LENGTHS]
    masks = [[1] * r for r in RESPONSE_LENGTHS]
    rewards = torch.randn(len(RESPONSE_LENGTHS), generator=gen).tolist()
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=RESPONSE_LENGTHS, loss_masks=masks,
                      rewards=rewards, raw_rewards=rewards)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--model", "--out", "--save", "--load"):
        p.add_argument(name)
    for name in ("--rank", "--world-size", "--port"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--rollouts", type=int, default=2)
    a = p.parse_args()
    flags = ["--hf-checkpoint", a.model, "--rollout-batch-size", "6", "--num-rollout", "8", "--global-batch-size", "3", "--lr", "1e-2",
             "--use-kl-loss", "--kl-loss-coef", "0.1", "--lora-rank", "4", "--lora-alpha", "8",
             "--target-modules", "q_proj,v_proj,down_proj"]  # fmt: skip
    flags += ["--save", a.save] if a.save else []
    flags += ["--load", a.load] if a.load else []
    actor = TrainActor(parse_job_args(flags), rank=a.rank, world_size=a.world_size, master_port=a.port,
                       device="cpu")  # fmt: skip
    start = actor.init(total_optimizer_steps=8)
    metrics, merged_by_rollout = [], []
    for k in range(a.rollouts):
        metrics.append(actor.train(make_batch(start + k)))
        merged_by_rollout.append(dict(iter_full_tensors(actor.model)))
    if a.save:
        actor.save(start + a.rollouts - 1)
    adapter = dict(iter_adapter_tensors(actor.model))
    # Frozen base: every parameter but the adapters still equals the checkpoint's tensor exactly.
    reshard_all(actor.model)
    base = dict(iter_safetensors(a.model))
    frozen = [(n, p) for n, p in actor.model.named_parameters() if ".lora_" not in n]
    # A list, not a generator inside all(): every rank must join every gather, whatever the result.
    # (one rank trains without FSDP2: plain tensors there)
    full = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for _, p in frozen]
    equal = [torch.equal(t, base[n]) for t, (n, _) in zip(full, frozen, strict=True)]
    base_unchanged = all(equal)
    if a.rank == 0:
        out = {
            "metrics": metrics,
            "merged": merged_by_rollout,
            "adapter": adapter,
            "base_unchanged": base_unchanged,
        }
        torch.save(out, a.out)
    actor.shutdown()


if __name__ == "__main__":
    main()
