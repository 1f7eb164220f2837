"""TrainActor: one data-parallel rank of the FSDP2 policy trainer, usable in-process or as a Ray actor.

    actor = TrainActor(job, rank=0, world_size=1, master_port=free_port())
    start_rollout_id = actor.init()                # builds model (+ FSDP2) + AdamW, loads --load if present
    metrics = actor.train(train_batch)             # log-probs, ref log-probs, advantages, optimizer steps
    actor.save(rollout_id)                          # --save checkpoint (collective)
    for bucket in actor.weight_buckets(): ...      # (HF name, full tensor) buckets for weight sync
    actor.offload(); ...; actor.onload()           # --colocate: free the GPU while the engines generate

With --advantage-estimator ppo each rank also holds the critic (clawrl/trainer/critic.py): train() computes
its values, GAE advantages and returns, trains it, then the policy (not during --num-critic-only-steps);
save/load and offload/onload include it.

With --lora-rank N the policy's targeted linear layers get LoRA adapters (clawrl/models/lora.py): only
they train and have optimizer state; weight sync, checksums and HF export see the merged weights; the
checkpoint holds the adapters (clawrl/trainer/lora_state.py); the reference is the base (adapters off).

With one rank (and without --no-fast-single-rank) there is no FSDP2: `actor.model` is a plain module in the
compute dtype (bf16 on GPU) and `actor.master` its fp32 master copy, which the optimizer steps and
checkpoints, exports and weight sync read (clawrl/trainer/single_rank.py); with FSDP2 both are the one
sharded module.

All ranks of a job call the same methods in the same order (they run collectives).
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clawrl.algo.tis import vanilla_tis_function
from clawrl.config.engine import engine_dtype
from clawrl.config.job import JobConfig
from clawrl.config.plugins import load_function
from clawrl.data.train_batch import TrainBatch
from clawrl.metrics.timer import Timers
from clawrl.models.config import load_model_args
from clawrl.models.decoder import CausalLM
from clawrl.models.hf_io import DEFAULT_MAX_SHARD_BYTES, export_hf_dir, load_model, source_dtype
from clawrl.models.layers import enable_train_kernels
from clawrl.models.loader import iter_safetensors, load_weights
from clawrl.models.lora import apply_lora
from clawrl.models.moe import moe_aux_loss_metric, record_router_logits
from clawrl.trainer import checkpoint as ckpt
from clawrl.trainer.critic import Critic
from clawrl.trainer.distributed import all_reduce_sum, free_port, init_distributed
from clawrl.trainer.fsdp import build_mesh
from clawrl.trainer.lora_state import lora_meta, lora_reference, lora_spec_of
from clawrl.trainer.loss import LossFunction
from clawrl.trainer.offload import HostOffload, device_memory, device_reserved
from clawrl.trainer.optim import LRSchedule, build_adamw, clip_grad_norm
from clawrl.trainer.rl_step import (
    compute_advantages,
    compute_log_probs,
    forward_log_probs,
    forward_logits,
    micro_batches,
    per_sample_mean,
    plan_steps,
)
from clawrl.trainer.single_rank import use_single_rank, wrap_for_training
from clawrl.trainer.train_dump import TRAIN_RECORDS_KEY, TrainDataRecorder
from clawrl.trainer.weights import (
    WeightBank,
    iter_adapter_tensors,
    iter_full_tensors,
    iter_weight_buckets,
    tensor_checksum,
)


class TrainActor:
    """One trainer rank. Construction is cheap; `init()` does the work (so Ray can place actors first)."""

    def __init__(self, job: JobConfig, *, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, device: str | None = None):  # fmt: skip
        self.job, self.rank, self.world_size = job, rank, world_size
        self.master_addr, self.master_port = master_addr, master_port or free_port()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.rollout_id_next = 0
        self.loaded_meta: dict[str, Any] | None = None
        self.total_optimizer_steps: int | None = None
        # Host copies while offloaded, per group: parameters can come back alone (weight sync, export).
        self._host = {"params": HostOffload(), "optim": HostOffload(), "ref": HostOffload(),
                      "critic_params": HostOffload(), "critic_optim": HostOffload()}  # fmt: skip
        self._room_beside_engines: tuple[int, float] | None = None
        """(bytes reserved, bytes spare) when `onload_if_room` last onloaded beside generating engines."""
        self.critic: Critic | None = None
        """ppo's value model, in this rank beside the policy (None for the other estimators)."""
        self.lora = lora_spec_of(job.train)
        """The policy's LoRA adapters (--lora-rank > 0): only they train; None trains every weight."""

    # ------------------------------------------------------------------------------------------ setup
    def init(self, total_optimizer_steps: int | None = None) -> int:
        """Build everything; returns the rollout id to start from (0, or the one after the loaded checkpoint)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        init_distributed(rank=self.rank, world_size=self.world_size, master_addr=self.master_addr,
                         master_port=self.master_port, device_type=self.device.type)  # fmt: skip
        torch.manual_seed(self.job.train.seed)
        self.single_rank = use_single_rank(self.job.train.fast_single_rank, self.world_size)
        """Trained without FSDP2: a compute-dtype module and an fp32 master (clawrl/trainer/single_rank.py)."""
        self.wrapped = self._build_model()
        self.model = self.wrapped.compute
        """The module that runs forward and backward (with FSDP2 also the master)."""
        self.master = self.wrapped.master
        """The trained weights at full precision: what the optimizer steps, checkpoints save, exports read."""
        train = self.job.train
        self.optimizer = build_adamw(
            self.master.parameters(), lr=train.lr, weight_decay=train.weight_decay,
            betas=(train.adam_beta1, train.adam_beta2),
        )  # fmt: skip
        self.schedule = LRSchedule(
            self.optimizer, lr=train.lr, min_lr=train.min_lr, warmup_iters=train.lr_warmup_iters,
            total_iters=total_optimizer_steps or 1, style=train.lr_decay_style,
        )  # fmt: skip
        self.ref_bank = self._build_ref_bank() if self._needs_ref() else None
        self.loss_fn = self._build_loss()
        if self.job.algo.advantage_estimator == "ppo":
            self.critic = Critic(self.job, mesh=self.mesh, device=self.device, world_size=self.world_size,
                                 total_optimizer_steps=total_optimizer_steps,
                                 single_rank=self.single_rank)  # fmt: skip
        return self._maybe_load()

    def _build_model(self):
        model_cfg = self.job.model
        if not model_cfg.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required to build the trainer's model")
        if model_cfg.model_impl == "hf":
            from clawrl.trainer.hf_model import load_hf_model

            model = load_hf_model(model_cfg.hf_checkpoint, device=self.device)
        else:
            model = load_model(model_cfg.hf_checkpoint, fused=False, device=self.device, dtype=torch.float32)
            if model_cfg.uses_true_on_policy:  # the engines' batch-invariant kernels (--true-on-policy-mode)
                from clawrl.models.batch_invariant import enable_batch_invariant

                on_gpu = self.device.type == "cuda"  # fp32 master weights, bf16 forward (its cuBLAS check)
                enable_batch_invariant(model, compute_dtype=torch.bfloat16 if on_gpu else None)
            elif self.job.train.train_kernels == "triton":  # fused RMSNorm/SiLU/RoPE on CUDA tensors only
                enable_train_kernels(model)
        if self.lora is not None:  # before wrapping: FSDP2 shards the frozen base and the adapters alike
            apply_lora(model, self.lora)
        compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.mesh = build_mesh(self.device.type, self.world_size)
        return wrap_for_training(model, self.mesh, compute_dtype=compute_dtype, single_rank=self.single_rank,
                                 activation_checkpointing=model_cfg.gradient_checkpointing)  # fmt: skip

    def _needs_ref(self) -> bool:
        algo = self.job.algo
        return algo.use_kl_loss or algo.kl_coef != 0

    def _build_ref_bank(self) -> WeightBank:
        if self.lora is not None:
            return lora_reference(self.model, self.job.model)
        bank = WeightBank(self.model)  # the initial weights, i.e. --hf-checkpoint
        ref_dir = self.job.model.ref_load
        if ref_dir and Path(ref_dir).resolve() != Path(self.job.model.hf_checkpoint).resolve():
            bank.load_(dict(iter_safetensors(ref_dir)), self.model, source=f"--ref-load {ref_dir}")
        return bank

    def _build_loss(self) -> LossFunction:
        train, algo = self.job.train, self.job.algo
        custom = tis = None
        if train.loss_type == "custom_loss":
            custom = load_function(train.custom_loss_function_path, "--custom-loss-function-path")
        if algo.use_tis or algo.get_mismatch_metrics:
            tis = vanilla_tis_function
            if algo.custom_tis_function_path is not None:
                tis = load_function(algo.custom_tis_function_path, "--custom-tis-function-path")
        return LossFunction(algo, train.loss_type, custom, self.job.to_namespace(), tis)

    def _maybe_load(self) -> int:
        if not self.job.model.load or ckpt.latest_iteration(self.job.model.load) is None:
            return 0
        meta = ckpt.load_checkpoint(
            self.job.model.load, self.master, self.optimizer, trainable_only=self.lora is not None,
            check_meta=lambda saved, path: ckpt.check_lora_meta(saved.get("lora"), self.lora, path),
        )  # fmt: skip
        self.wrapped.after_load()
        self.schedule.load_state_dict(meta["schedule"])
        if self.critic is not None:
            self.critic.load(self.job.model.load, int(meta["next_rollout_id"]))
        self.loaded_meta = meta
        self.rollout_id_next = int(meta["next_rollout_id"])
        return self.rollout_id_next

    def loaded_extra(self) -> dict[str, Any]:
        """The `extra` state saved with the checkpoint `init()` resumed from (e.g. the data cursor); {} if none."""
        return (self.loaded_meta or {}).get("extra", {})

    # ------------------------------------------------------------------------------------------ train
    def train(self, batch: TrainBatch) -> dict[str, Any]:
        """Train on one rollout; returns rollout/*, train/* (one dict per optimizer step) and perf/* metrics."""
        if self.is_offloaded:
            raise RuntimeError(
                "TrainActor.train() called while the trainer is offloaded: call onload() first"
            )
        watch = Timers(cuda_sync=self.device.type == "cuda")  # GPU work charged to the phase that queued it
        watch.start("train_actor")  # the whole call inside this process (the driver's Ray call is longer)
        steps = self._plan(batch)
        my_ids = [i for s in steps for i in (s.sample_ids[j] for j in s.plan.samples_of(self.rank))]
        algo = self.job.algo
        self.model.train()
        log_probs, ref_log_probs, rollout_log_probs = self._log_prob_passes(batch, steps, my_ids, watch)
        old_log_probs = rollout_log_probs if algo.use_rollout_logprobs else log_probs
        values = None
        if self.critic is not None:
            with watch("values"):
                values = self.critic.values(batch, steps, self.rank)
        with watch("advantages"):
            advantages, returns = compute_advantages(
                batch, my_ids, algo, old_log_probs, ref_log_probs, self.device, values=values
            )
        per_token = {"old_log_probs": old_log_probs, "advantages": advantages}
        if ref_log_probs is not None:
            per_token["ref_log_probs"] = ref_log_probs
        if rollout_log_probs is not None:
            per_token["rollout_log_probs"] = rollout_log_probs
        if algo.use_rollout_logprobs and log_probs is not None:
            per_token["train_log_probs"] = log_probs
        metrics = self._rollout_metrics(batch, log_probs, ref_log_probs, advantages, rollout_log_probs)
        recorder = (
            TrainDataRecorder(self.rank, self.job.algo.kl_loss_type)
            if self.job.debug.save_debug_train_data
            else None
        )
        critic_steps = []
        if self.critic is not None:  # slime's order: the critic trains first, on the same old values
            metrics.update(self.critic.rollout_metrics(batch, values, returns))
            with watch("critic_train"):
                critic_steps = [self.critic.train_step(batch, s, self.rank, values, returns) for s in steps]
        actor_steps = self._policy_steps(batch, steps, per_token, watch, recorder)
        # One dict per optimizer step: the policy's and the critic's k-th steps share a row.
        metrics["train"] = [
            {**a, **c} for a, c in itertools.zip_longest(actor_steps, critic_steps, fillvalue={})
        ]
        if recorder is not None:  # the driver gathers every rank's records and writes the train dump
            metrics[TRAIN_RECORDS_KEY] = recorder.records(
                batch,
                log_probs=old_log_probs,
                ref_log_probs=ref_log_probs,
                advantages=advantages,
                returns=returns,
            )
        watch.stop("train_actor")
        times = watch.totals()
        metrics.update({f"perf/{k}_time": v for k, v in times.items()})
        num_tokens = sum(batch.total_lengths)
        if "actor_train" in times:  # not in ppo's critic-only rollouts (--num-critic-only-steps)
            metrics["perf/actor_train_tok_per_s"] = num_tokens * len(steps) / max(times["actor_train"], 1e-9)
        self.rollout_id_next = batch.rollout_id + 1
        return metrics

    def _policy_steps(self, batch, steps, per_token, watch, recorder) -> list[dict[str, float]]:
        """The policy's optimizer steps' metrics; none in ppo's first --num-critic-only-steps rollouts."""
        if self.critic is not None and batch.rollout_id < self.job.algo.num_critic_only_steps:
            return []
        temperature = self.job.rollout.rollout_temperature
        with watch("actor_train"):
            return [
                self._optimizer_step(batch, s, per_token, temperature, recorder=recorder, step_index=k)
                for k, s in enumerate(steps)
            ]

    def _plan(self, batch: TrainBatch):
        train = self.job.train
        return plan_steps(
            batch, global_batch_size=train.global_batch_size or len(batch), dp_size=self.world_size,
            max_tokens_per_gpu=train.max_tokens_per_gpu if train.use_dynamic_batch_size else None,
            micro_batch_size=train.micro_batch_size, max_response_len=self.job.rollout.rollout_max_response_len,
        )  # fmt: skip

    def _log_prob_passes(self, batch, steps, my_ids, watch):
        """(recomputed, reference, rollout) {sample index: [R]} log-probs of this rank's samples; each None
        when not needed (--use-rollout-logprobs skips the recompute unless --get-mismatch-metrics)."""
        algo, temperature = self.job.algo, self.job.rollout.rollout_temperature
        rollout_log_probs = self._rollout_log_probs(batch, my_ids)
        log_probs = ref_log_probs = None
        if not algo.use_rollout_logprobs or algo.get_mismatch_metrics:
            with watch("log_probs"):
                log_probs = compute_log_probs(self.model, batch, steps, self.rank, self.device, temperature)
        if self.ref_bank is not None:
            with watch("ref_log_probs"), self.ref_bank.swapped_into(self.model):
                ref_log_probs = compute_log_probs(
                    self.model, batch, steps, self.rank, self.device, temperature
                )
        return log_probs, ref_log_probs, rollout_log_probs

    def _rollout_log_probs(self, batch: TrainBatch, my_ids: list[int]) -> dict[int, torch.Tensor] | None:
        """{sample index: [R] engine log-probs} of this rank's samples; None when the batch has none."""
        if batch.rollout_log_probs is None:
            algo = self.job.algo
            for flag, on in (("--use-rollout-logprobs", algo.use_rollout_logprobs), ("--use-tis", algo.use_tis),
                             ("--get-mismatch-metrics", algo.get_mismatch_metrics)):  # fmt: skip
                if on:
                    raise ValueError(
                        f"{flag} needs the rollout's log-probs, but rollout {batch.rollout_id}'s samples have "
                        "none (a custom generate function must set Sample.rollout_log_probs)"
                    )
            return None
        return {i: torch.tensor(batch.rollout_log_probs[i], dtype=torch.float32) for i in my_ids}

    def _rollout_metrics(
        self, batch, log_probs, ref_log_probs, advantages, rollout_log_probs
    ) -> dict[str, Any]:
        out = {"rollout/advantages": per_sample_mean(advantages, batch, self.device)}
        if log_probs is not None:
            out["rollout/log_probs"] = per_sample_mean(log_probs, batch, self.device)
        if ref_log_probs is not None:
            out["rollout/ref_log_probs"] = per_sample_mean(ref_log_probs, batch, self.device)
        if rollout_log_probs is not None:
            out["rollout/rollout_log_probs"] = per_sample_mean(rollout_log_probs, batch, self.device)
        return out

    def _optimizer_step(self, batch, step, per_token, temperature, *, recorder=None, step_index=0):
        self.wrapped.zero_grad(self.optimizer)
        sums: dict[str, torch.Tensor] = {}
        mbs = micro_batches(batch, step, self.rank, self.device, per_token)
        step_tokens = sum(batch.total_lengths[i] for i in step.sample_ids)
        for mb_index, (mb, is_last) in enumerate(_with_last(mbs)):
            self.wrapped.before_backward(is_last=is_last)
            with record_router_logits(self.model) as router_logits:  # MoE models only; logged, not trained
                if self.loss_fn.wants_logits:
                    entropy = None
                    logits = forward_logits(self.model, mb, temperature)
                    loss, metrics = self.loss_fn.custom(mb, logits, step.counts)
                else:
                    log_probs, entropy = forward_log_probs(self.model, mb, temperature, with_entropy=True)
                    loss, metrics = self.loss_fn(mb, log_probs, entropy, step.counts)
            share = 0.0 if mb.is_dummy else mb.input_ids_N.numel() / step_tokens  # token-weighted step mean
            aux = moe_aux_loss_metric(self.model, router_logits, share)
            if aux is not None:
                metrics["moe_aux_loss"] = aux
            if recorder is not None:
                recorder.add_micro_batch(step_index, mb_index, mb, entropy)
            # FSDP averages gradients over ranks; the loss terms are already global sums, so undo the mean.
            (loss * self.world_size).backward()
            self.wrapped.after_backward(is_first=mb_index == 0)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach().double()
        names = sorted(sums)
        totals = all_reduce_sum(torch.stack([torch.as_tensor(sums[n]) for n in names]).to(self.device))
        out = {f"train/{n}": float(v) for n, v in zip(names, totals.tolist(), strict=True)}
        what = f"gradient norm at optimizer step {self.schedule.step_count}"
        out["train/grad_norm"] = clip_grad_norm(self.master, self.job.train.clip_grad, what)
        out["train/lr"] = self.schedule.apply()
        self.optimizer.step()
        self.wrapped.after_step()
        self.schedule.advance()
        return out

    # ------------------------------------------------------------------------------------------ state
    def save(self, rollout_id: int, extra: dict[str, Any] | None = None) -> str:
        """Checkpoint to --save (collective); `extra` (plain types, e.g. the data cursor) goes into meta.json."""
        if not self.job.model.save:
            raise ValueError("TrainActor.save needs --save")
        meta = {"schedule": self.schedule.state_dict(), "extra": extra or {}}
        if self.lora is not None:  # the adapters only: their base model is named in meta.json
            meta["lora"] = lora_meta(self.lora, self.job.model.hf_checkpoint)
        with self._onloaded("params", "optim", "critic_params", "critic_optim"):
            if self.critic is not None:  # first: the policy's tracker, written last, vouches for both
                self.critic.save(self.job.model.save, rollout_id, {"extra": extra or {}})
            path = ckpt.save_checkpoint(self.job.model.save, rollout_id, self.master, self.optimizer, meta,
                                        trainable_only=self.lora is not None)  # fmt: skip
        return str(path)

    def export_hf(
        self,
        out_dir: str,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> str:
        """Write the current weights as a HF directory (`--save-hf`): safetensors in `dtype` (default: that
        of --hf-checkpoint), sharded above `max_shard_bytes`, its config, tokenizer and generation files.
        Rank 0 writes (atomically: OUT.tmp-* renamed); every rank must call (the gather is collective).
        Each tensor is cast on its own device, then goes to host memory as soon as it is gathered, so no
        device holds a second full model. With LoRA: the merged model, and its adapters in OUT/adapter/
        (PEFT's format). Returns `out_dir`."""
        source = self.job.model.hf_checkpoint
        dtype = dtype or source_dtype(source)
        state: dict[str, torch.Tensor] = {}
        adapter: dict[str, torch.Tensor] | None = {} if self.lora is not None else None
        try:
            with self._onloaded("params"):
                for name, tensor in iter_full_tensors(self.master, dtype):  # LoRA: the merged weights
                    if self.rank == 0:
                        state[name] = tensor.to("cpu")
                for name, tensor in iter_adapter_tensors(self.master) if adapter is not None else ():
                    if self.rank == 0:
                        adapter[name] = tensor.to("cpu")
            if self.rank == 0:
                export_hf_dir(state, out_dir, source_dir=source, dtype=dtype, max_shard_bytes=max_shard_bytes,
                              adapter=adapter, lora=self.lora)  # fmt: skip
        finally:
            dist.barrier()  # also when rank 0 failed to write: no rank is left waiting in a later collective
        return out_dir

    @property
    def engine_dtype(self) -> torch.dtype:
        """Dtype the engines run in (clawrl.config.engine.engine_dtype): weights are converted to it before
        they are sent."""
        return getattr(torch, engine_dtype(self.device.type))

    def weight_buckets(self, dtype: torch.dtype | None = None):
        """Buckets of (HF name, full tensor) of at most --update-weight-buffer-size bytes (collective).

        Works while offloaded: the parameter shards come back for the gather and leave again at the end."""
        with self._onloaded("params"):
            yield from iter_weight_buckets(
                iter_full_tensors(self.master, dtype), self.job.model.update_weight_buffer_size
            )

    def checksums(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        """sha256 per HF tensor of the current weights (collective; every rank returns the same dict)."""
        with self._onloaded("params"):
            return {name: tensor_checksum(t) for name, t in iter_full_tensors(self.master, dtype)}

    # ------------------------------------------------------------------------------------------ memory
    def offload(self, *, keep_weights: bool = False) -> int:
        """Free this rank's device memory for colocated engines (--colocate): parameter shards, optimizer
        state, reference shards and (ppo) the critic's shards and optimizer state move to host memory
        (pinned on GPU); gradients are dropped (every optimizer step starts from zero). Returns the bytes
        moved; what is offloaded already is left as it is.

        keep_weights: the policy's parameters stay on the device (everything else goes), so the weight sync
        that follows reads them there instead of bringing them back for it; a later `offload()` moves them.
        Not collective. `train()` needs `onload()` first; save/export/weight sync work either way."""
        moved = 0
        if not self._host["optim"].is_offloaded:
            self._drop_gradients()
            states = self.optimizer.state.values()
            moved += self._host["optim"].offload(
                [v for st in states for v in st.values() if torch.is_tensor(v)]
            )
            if self.ref_bank is not None:
                moved += self._host["ref"].offload(self.ref_bank.shards)
            if self.critic is not None:
                self.critic.wrapped.release()
                params, optim_state = self.critic.tensors()
                moved += self._host["critic_params"].offload(params)
                moved += self._host["critic_optim"].offload(optim_state)
        if not keep_weights and not self._host["params"].is_offloaded:
            self.wrapped.release()  # first: the host offload hands every freed block back to the driver
            moved += self._host["params"].offload(self.wrapped.offload_tensors())
        return moved

    def onload(self) -> None:
        """Bring everything `offload()` moved back to the device, bit for bit (a no-op when not offloaded)."""
        for host in self._host.values():
            if host.is_offloaded:
                host.onload()
        self.wrapped.restore()  # the fast path's compute copies, rebuilt from the onloaded master
        if self.critic is not None:
            self.critic.wrapped.restore()

    def offload_after_step(self) -> bool:
        """After a train step of a colocated trainer that `onload_if_room` found room for: free the step's
        gradients and cached blocks, then keep the state on the device if it grew by no more than the room
        that was spare beside the generating engines then (the first step creates the optimizer state, for
        one), so the engines can take back what they released and generate beside it again. Otherwise do
        `offload(keep_weights=True)`. Returns whether the state stayed."""
        self._drop_gradients()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's activations go back to the driver
        room, self._room_beside_engines = self._room_beside_engines, None
        if room is not None and device_reserved(self.device) - room[0] <= room[1]:
            return True
        self.offload(keep_weights=True)
        return False

    def _drop_gradients(self) -> None:
        """Free the policy's (and the critic's) gradients: every optimizer step starts from zero anyway."""
        for optimizer, wrapped in [(self.optimizer, self.wrapped)] + (
            [(self.critic.optimizer, self.critic.wrapped)] if self.critic is not None else []
        ):
            optimizer.zero_grad(set_to_none=True)
            wrapped.release_grads()

    def onload_if_room(self, headroom_fraction: float) -> bool:
        """`onload()` now if the device has room for it beside what else holds memory there (a colocated
        engine that is still generating) with `headroom_fraction` of the device's memory left free; else
        leave everything where it is. Returns whether the trainer is onloaded afterwards. The colocated loop
        calls it as a rollout starts, so the copies run while the engine generates instead of after it
        released its memory; the room left then is what `offload_after_step` may keep. Off CUDA (no device
        memory to run out of) it always onloads."""
        self._room_beside_engines = None
        memory = device_memory(self.device)
        if self.is_offloaded:
            if memory is not None and memory[0] < self.onload_nbytes() + headroom_fraction * memory[1]:
                return False
            self.onload()
            memory = device_memory(self.device)
        spare = float("inf") if memory is None else memory[0] - headroom_fraction * memory[1]
        self._room_beside_engines = (device_reserved(self.device), spare)
        return True

    def onload_nbytes(self) -> int:
        """Device bytes `onload()` would allocate: the offloaded storages and the compute copies it rebuilds."""
        wrapped = [self.wrapped] + ([self.critic.wrapped] if self.critic is not None else [])
        return sum(h.offloaded_nbytes for h in self._host.values()) + sum(w.restore_nbytes() for w in wrapped)

    @property
    def is_offloaded(self) -> bool:
        return any(host.is_offloaded for host in self._host.values())

    @contextlib.contextmanager
    def _onloaded(self, *groups: str):
        """Run the body with these offloaded groups on the device; they leave again afterwards."""
        back = [self._host[g] for g in groups if self._host[g].is_offloaded]
        for host in back:
            host.onload()
        try:
            yield
        finally:
            for host in back:
                host.offload_again()

    def shutdown(self) -> None:
        """Leave the process group; the barrier keeps rank 0 (the rendezvous store's host) alive until the
        others are done, so no rank tears down a group a peer still uses."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def native_model_from(state: dict[str, torch.Tensor], model_dir: str) -> CausalLM:
    """A CPU CausalLM of `model_dir`'s architecture holding the HF-named full tensors `state` (no weights
    are read from disk; a tied lm_head, absent from `state`, follows the embedding)."""
    with torch.device("meta"):
        model = CausalLM(load_model_args(model_dir))
    model.to_empty(device="cpu")
    load_weights(model, state.items())
    return model


def _with_last(items):
    """(item, is_last) pairs of an iterable, looking one item ahead."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True
