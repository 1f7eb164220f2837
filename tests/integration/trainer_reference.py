"""Helpers for the trainer checks: tiny checkpoints, jobs, batches, a TrainActor that always shuts down, and
the plain reference computation (transformers, one sample at a time, full log_softmax, fp64).

Used by test_trainer_checks.py and test_trainer_hf_impl.py (1 rank, in-process: a process group is created
by TrainActor.init and destroyed by `running_actor` on exit, so tests do not leak it into each other).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from clawrl.config.algo import AlgoConfig
from clawrl.config.job import JobConfig
from clawrl.config.model import ModelConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.train import TrainConfig
from clawrl.data.train_batch import TrainBatch
from clawrl.trainer.actor import TrainActor
from clawrl.trainer.fsdp import reshard_all
from clawrl.trainer.weights import iter_full_tensors

VOCAB = 512
TEMPERATURE = 0.8


def tiny_checkpoint(path: Path, *, seed: int = 0, arch: str = "qwen2", hidden_size: int = 64,
                    scale: float | None = None) -> str:  # fmt: skip
    """A tiny random HF checkpoint; `scale` redraws every matrix as N(0, scale^2) (peaked distributions)."""
    from clawrl.models.tiny import build_tiny_model

    build_tiny_model(path, arch=arch, vocab_size=VOCAB, hidden_size=hidden_size, num_layers=2, num_heads=4,
                     num_kv_heads=2, intermediate_size=2 * hidden_size, seed=seed)  # fmt: skip
    if scale is not None:
        weights = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(seed)
        for name, tensor in weights.items():
            if tensor.dim() == 2:
                weights[name] = torch.randn(tensor.shape, generator=gen) * scale
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def make_job(model_dir: str, *, train: dict | None = None, algo: dict | None = None, **model) -> JobConfig:
    train_cfg = dict(lr=1e-2, clip_grad=0.0, global_batch_size=4, use_dynamic_batch_size=True,
                     max_tokens_per_gpu=24)  # fmt: skip
    algo_cfg = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01,
                    eps_clip=0.2, eps_clip_high=0.28)  # fmt: skip
    return JobConfig(
        model=ModelConfig(hf_checkpoint=model_dir, **model),
        rollout=RolloutConfig(
            rollout_batch_size=4,
            n_samples_per_prompt=2,
            rollout_max_response_len=16,
            rollout_temperature=TEMPERATURE,
        ),  # fmt: skip
        train=TrainConfig(**{**train_cfg, **(train or {})}),
        algo=AlgoConfig(**{**algo_cfg, **(algo or {})}),
    )


def make_batch(rollout_id: int = 0, num_samples: int = 8) -> TrainBatch:
    """Samples of 5..20 tokens, responses of 1..len-1, a masked-out tool token, one removed sample."""
    gen = torch.Generator().manual_seed(1000 + rollout_id)
    lengths = torch.randint(5, 21, (num_samples,), generator=gen).tolist()
    responses = [int(torch.randint(1, n, (1,), generator=gen)) for n in lengths]
    tokens = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    masks = [[1] * r for r in responses]
    longest = max(range(num_samples), key=lambda i: responses[i])
    masks[longest][0] = 0  # a tool-output token inside a response
    removed = (longest + 1) % num_samples
    masks[removed] = [0] * responses[removed]  # a removed sample: counts as a sample, contributes 0
    rewards = torch.randn(num_samples, generator=gen).tolist()
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=responses, loss_masks=masks,
                      rewards=rewards, raw_rewards=rewards)  # fmt: skip


@contextlib.contextmanager
def running_actor(job: JobConfig, total_optimizer_steps: int = 10):
    actor = TrainActor(job, device="cpu")
    try:
        actor.init(total_optimizer_steps=total_optimizer_steps)
        yield actor
    finally:
        actor.shutdown()


def full_weights(actor: TrainActor) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in iter_full_tensors(actor.model)}


class StepRecorder:
    """Records, through the optimizer's step hooks, each step's gradients (before) and weights (after)."""

    def __init__(self, actor: TrainActor):
        reshard_all(actor.model)  # after a forward the root's parameters are the gathered ones
        self.names = {id(p): n for n, p in actor.model.named_parameters()}
        self.grads: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        actor.optimizer.register_step_pre_hook(lambda opt, *_: self.grads.append(self._collect(opt, True)))
        actor.optimizer.register_step_post_hook(
            lambda opt, *_: self.weights.append(self._collect(opt, False))
        )

    def _collect(self, optimizer, grads: bool) -> dict[str, torch.Tensor]:
        out = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                t = p.grad if grads else p.detach()
                out[self.names[id(p)]] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
        return out


# ------------------------------------------------------------------------------------- plain reference
def load_reference_model(model_dir: str, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


def sample_log_probs(model, tokens: list[int], response_length: int, temperature: float = TEMPERATURE):
    """One sample, unpacked: (log p(response token), entropy) per response token from the full log_softmax."""
    logits = model(torch.tensor([tokens])).logits[0] / temperature
    logp_all = torch.log_softmax(logits[len(tokens) - response_length - 1 : -1], dim=-1)
    targets = torch.tensor(tokens[len(tokens) - response_length :])
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def reference_step_loss(model, batch: TrainBatch, ids: list[int], old, ref, *, per_token: bool):
    """The GRPO step loss written out: PPO clip (0.2 / 0.28) + 0.1 low_var_kl - 0.01 entropy, aggregated
    per sample (mean over samples of each sample's masked token mean) or per token (masked token mean)."""
    total_mask = sum(sum(batch.loss_masks[i]) for i in ids)
    loss = torch.zeros((), dtype=torch.float64)
    for i in ids:
        logp, entropy = sample_log_probs(model, batch.tokens[i], batch.response_lengths[i])
        ratio = torch.exp(logp - old[i])
        advantage = batch.rewards[i]
        pg = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - 0.2, 1 + 0.28))
        d = logp - ref[i]
        kl = (torch.exp(-d) - 1 + d).clamp(-10, 10)
        per_token_loss = pg + 0.1 * kl - 0.01 * entropy
        mask = torch.tensor(batch.loss_masks[i], dtype=torch.float64)
        if per_token:
            loss = loss + (per_token_loss * mask).sum() / total_mask
        else:
            loss = loss + (per_token_loss * mask).sum() / mask.sum().clamp(min=1) / len(ids)
    return loss


def reference_grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def set_weights(model, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name].to(p.dtype))


def max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over entries |got - want| / max over entries |want| (one scale for the whole model, so that
    nearly-zero gradients such as k_proj.bias under RoPE are held to the model's gradient scale)."""
    assert got.keys() == want.keys()
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[n].double() - want[n].double()).abs().max().item() for n in want) / scale
