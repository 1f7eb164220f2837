"""The PPO critic (`--advantage-estimator ppo`): a value model trained beside the policy, in the same ranks.

    critic = Critic(job, mesh=actor.mesh, device=device, world_size=W, total_optimizer_steps=T)
    values = critic.values(batch, steps, rank)                      # {sample: [R] V}, no autograd
    metrics = critic.train_step(batch, step, rank, values, returns)  # one optimizer step of the value loss
    critic.save(save_dir, rollout_id, meta); critic.load(load_dir)  # <dir>/critic/, the policy's layout

Value model: the policy's architecture (the same decoder, HF parameter names under `model.`) with a scalar
head `value_head = nn.Linear(hidden_size, 1)` instead of the LM head. The value of response token t is the
head's output at the position that PREDICTS token t (the row whose hidden state the policy turns into token
t's log-prob): V(prompt + response[:t]), the state before the action is taken. Values are read without the
rollout temperature. Each trainer rank builds it next to its policy shard ("critic placement beside the
actor"): FSDP2 over the same mesh (or, like the policy, the single-rank fast path), its own AdamW at
--critic-lr (default --lr) and its own schedule (--critic-lr-warmup-iters, the policy's --lr-decay-style and
--min-lr).

Initial weights, `--critic-load` (default --hf-checkpoint): an HF model directory gives the trunk; a clawrl
--save directory of a critic (`<save>/critic`) gives trunk and head; one of a policy gives the trunk. A new
head starts at zero (weight and bias): every value is 0 before the first update, so the first advantages are
the plain (KL-penalised) returns instead of noise from a random head, and runs do not depend on the head's
random draw. The trunk gets gradients once the head's weight has left zero (from the second optimizer step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from clawrl.algo import aggregate_loss
from clawrl.algo.value_loss import clipped_value_loss, explained_variance
from clawrl.config.job import JobConfig
from clawrl.models.config import ModelArgs, load_model_args
from clawrl.models.decoder import DecoderModel
from clawrl.models.hf_io import load_model
from clawrl.trainer import checkpoint as ckpt
from clawrl.trainer.distributed import all_reduce_sum
from clawrl.trainer.loss import aggregation_mode
from clawrl.trainer.optim import LRSchedule, build_adamw, clip_grad_norm
from clawrl.trainer.rl_step import micro_batches, per_sample_mean
from clawrl.trainer.single_rank import wrap_for_training


class ValueModel(nn.Module):
    """Decoder trunk (HF names under `model.`) + scalar value head."""

    def __init__(self, decoder: DecoderModel, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = decoder
        self.value_head = nn.Linear(args.hidden_size, 1, device=decoder.norm.weight.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, positions, attn, rows_M: torch.Tensor) -> torch.Tensor:
        """Packed tokens [N] -> the values [M] fp32 at `rows_M` (the rows predicting the response tokens)."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, attn)
        hidden = self.model.norm(hidden)
        # mv, not the Linear then a squeeze: FSDP warns about (and mishandles in-place ops on) a view output.
        values_M = torch.mv(hidden[rows_M], self.value_head.weight[0]) + self.value_head.bias
        return values_M.float()


def build_value_model(source: str, policy_dir: str, device: torch.device) -> ValueModel:
    """An fp32, unsharded ValueModel on `device` initialised from `source` (see the module docstring);
    `policy_dir` (--hf-checkpoint) gives the architecture when `source` is a clawrl checkpoint."""
    path = Path(source)
    if (path / "config.json").is_file():
        policy = load_model(path, fused=False, device=device, dtype=torch.float32)
        return ValueModel(policy.model, policy.args)
    try:
        state, _ = ckpt.read_model_state(ckpt.find_iteration_dir(path))
    except ckpt.CheckpointError as e:
        raise ValueError(
            f"--critic-load {source!r} is neither an HF model directory (config.json) nor a clawrl "
            f"checkpoint: {e}"
        ) from None
    args = load_model_args(policy_dir)
    with torch.device("meta"):
        model = ValueModel(DecoderModel(args, fused=False), args)
    model.to_empty(device=device)
    model.model.rotary_emb.reset_cache()
    nn.init.zeros_(model.value_head.weight)
    nn.init.zeros_(model.value_head.bias)
    _load_state(model, state, source)
    return model


def _load_state(model: ValueModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy the trunk (required) and the value head (when the checkpoint is a critic's) into `model`."""
    own = model.state_dict()
    wanted = {k: v for k, v in state.items() if k in own}
    missing = sorted(k for k in own if k.startswith("model.") and k not in wanted)
    wrong = sorted(k for k, v in wanted.items() if tuple(v.shape) != tuple(own[k].shape))
    if missing or wrong:
        raise ValueError(
            f"--critic-load {source!r} does not fit the --hf-checkpoint architecture: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, other shapes {wrong[:3]}"
        )
    model.load_state_dict(wanted, strict=False)


class Critic:
    """The critic of one trainer rank: the ValueModel (FSDP2 or single-rank), its optimizer and LR schedule."""

    def __init__(self, job: JobConfig, *, mesh, device: torch.device, world_size: int,
                 total_optimizer_steps: int | None, single_rank: bool = False):  # fmt: skip
        self.job, self.device, self.world_size = job, device, world_size
        train = job.train
        source = train.critic_load or job.model.hf_checkpoint
        model = build_value_model(source, job.model.hf_checkpoint, device)
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # The policy's choice (clawrl/trainer/single_rank.py): FSDP2, or one rank's bf16 module + fp32 master.
        self.wrapped = wrap_for_training(model, mesh, compute_dtype=compute_dtype, single_rank=single_rank,
                                         activation_checkpointing=job.model.gradient_checkpointing)  # fmt: skip
        self.model, self.master = self.wrapped.compute, self.wrapped.master
        lr = train.lr if train.critic_lr is None else train.critic_lr
        self.optimizer = build_adamw(
            self.master.parameters(), lr=lr, weight_decay=train.weight_decay,
            betas=(train.adam_beta1, train.adam_beta2),
        )  # fmt: skip
        self.schedule = LRSchedule(
            self.optimizer, lr=lr, min_lr=min(train.min_lr, lr), warmup_iters=train.critic_lr_warmup_iters,
            total_iters=total_optimizer_steps or 1, style=train.lr_decay_style,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ values
    @torch.no_grad()
    def values(self, batch, steps, rank: int) -> dict[int, torch.Tensor]:
        """{sample index: [R] values} of this rank's samples with the current critic (the "old" values),
        computed over the same micro-batches as the training pass."""
        self.model.train()
        out: dict[int, torch.Tensor] = {}
        for step in steps:
            for mb in micro_batches(batch, step, rank, self.device):
                values_M = self.model(mb.input_ids_N, mb.positions_N, mb.attn, mb.logit_rows_M)
                if mb.is_dummy:
                    continue
                for sid, part in zip(mb.sample_ids, values_M.split(mb.response_lengths), strict=True):
                    out[sid] = part.detach()
        return out

    def rollout_metrics(self, batch, values, returns) -> dict[str, float]:
        """train/values (per-sample mean of the old values) and train/explained_variance of the returns by
        those values over every rank's masked tokens (left out when undefined: returns without variance)."""
        out = {"train/values": per_sample_mean(values, batch, self.device)}
        ids = sorted(values)
        mask = torch.tensor([m for i in ids for m in batch.loss_masks[i]], dtype=torch.float32)
        cat = (lambda d: torch.cat([d[i].cpu() for i in ids])) if ids else (lambda d: torch.zeros(0))
        ev = explained_variance(cat(returns), cat(values), mask, sum_fn=self._sum_over_ranks)
        if ev is not None:
            out["train/explained_variance"] = ev
        return out

    def _sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(sums.to(self.device)).cpu()

    # ------------------------------------------------------------------------------------------ train
    def train_step(self, batch, step, rank: int, values, returns) -> dict[str, float]:
        """One optimizer step of the clipped value loss over `step`'s samples; the step's metrics
        (train/value_loss, train/value_clipfrac, train/critic_grad_norm, train/critic_lr)."""
        self.model.train()
        self.wrapped.zero_grad(self.optimizer)
        per_token = {"old_values": values, "returns": returns}
        mbs = micro_batches(batch, step, rank, self.device, per_token)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for index, mb in enumerate(mbs):
            self.wrapped.before_backward(is_last=index == len(mbs) - 1)
            loss, clipfrac = self._micro_batch_loss(mb, step.counts)
            # FSDP averages gradients over ranks; the loss is already a global sum, so undo the mean.
            (loss * self.world_size).backward()
            self.wrapped.after_backward(is_first=index == 0)
            sums += torch.stack([loss.detach(), clipfrac]).double()
        value_loss, value_clipfrac = all_reduce_sum(sums).tolist()
        out = {"train/value_loss": value_loss, "train/value_clipfrac": value_clipfrac}
        what = f"critic gradient norm at step {self.schedule.step_count}"
        out["train/critic_grad_norm"] = clip_grad_norm(self.master, self.job.train.clip_grad, what)
        out["train/critic_lr"] = self.schedule.apply()
        self.optimizer.step()
        self.wrapped.after_step()
        self.schedule.advance()
        return out

    def _micro_batch_loss(self, mb, counts) -> tuple[torch.Tensor, torch.Tensor]:
        values_M = self.model(mb.input_ids_N, mb.positions_N, mb.attn, mb.logit_rows_M)
        if mb.is_dummy:  # no samples on this rank: a zero loss that still reaches every parameter
            old_M = returns_M = torch.zeros_like(values_M)
        else:
            old_M, returns_M = mb.per_token["old_values"], mb.per_token["returns"]
        loss_M, extra = clipped_value_loss(values_M, old_M, returns_M, value_clip=self.job.algo.value_clip)

        def reduce(x_M):
            return aggregate_loss(
                x_M, mb.loss_mask_M, mb.response_lengths, aggregation_mode(self.job.algo),
                num_global_tokens=max(counts.num_tokens, 1.0), num_global_samples=counts.num_samples,
                max_response_len=counts.max_response_len,
            )  # fmt: skip

        return reduce(loss_M), reduce(extra["value_clipfrac"]).detach()

    # ------------------------------------------------------------------------------------------ state
    def save(self, root: str, rollout_id: int, meta: dict[str, Any]) -> Path:
        """Collective: the critic's checkpoint under `<root>/critic` (model, optimizer, schedule)."""
        meta = {**meta, "schedule": self.schedule.state_dict()}
        return ckpt.save_checkpoint(ckpt.critic_root(root), rollout_id, self.master, self.optimizer, meta)

    def load(self, root: str, iteration: int) -> None:
        """Collective: resume from `<root>/critic`, which must hold the policy's `iteration` as its latest."""
        critic_dir = ckpt.critic_root(root)
        found = ckpt.latest_iteration(critic_dir)
        if found != iteration:
            what = "no critic checkpoint" if found is None else f"the critic's latest iteration is {found}"
            raise ckpt.CheckpointError(
                f"--load {root}: the policy checkpoint is iteration {iteration} but {critic_dir} has {what} "
                "(--advantage-estimator ppo resumes the critic from the same iteration)"
            )
        meta = ckpt.load_checkpoint(critic_dir, self.master, self.optimizer)
        self.wrapped.after_load()
        self.schedule.load_state_dict(meta["schedule"])

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters + buffers, optimizer state tensors) for offloading to host memory."""
        params = self.wrapped.offload_tensors()
        states = self.optimizer.state.values()
        return params, [v for st in states for v in st.values() if torch.is_tensor(v)]
