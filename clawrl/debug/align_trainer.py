"""Trainer side of `clawrl debug align`: the TrainActor's model and packed forward on the same tokens.

    with TrainerSide("ckpt", device=torch.device("cpu"), compute_dtype=torch.float32) as trainer:
        traces = trainer.trace(samples, temperature=1.0)     # one SideTrace per sample

The model is built as the TrainActor builds it at world size 1: the native CausalLM loaded in fp32 (the
master weights), the fused training kernels on CUDA unless train_kernels="torch", then FSDP2 over a 1-rank
mesh whose mixed-precision policy casts to `compute_dtype` (bf16 on GPU in training, fp32 on CPU). The
samples are packed into one varlen sequence with `build_micro_batch` and scored by `forward_log_probs`,
the functions the training step itself uses, so the numbers are the trainer's own. A process group is
created (gloo on CPU, NCCL on CUDA, one rank) when the process has none, and destroyed on close.

Shapes: R = response tokens, K = captured modules (align_capture.layer_names), N = packed tokens,
H = hidden size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawrl.data.sample import Sample
from clawrl.data.train_batch import TrainBatch
from clawrl.debug.align_capture import LayerCapture
from clawrl.debug.align_engine import SideTrace
from clawrl.models.hf_io import load_model
from clawrl.models.layers import enable_train_kernels
from clawrl.trainer.distributed import free_port, init_distributed
from clawrl.trainer.fsdp import apply_fsdp, build_mesh
from clawrl.trainer.micro_batch import build_micro_batch
from clawrl.trainer.rl_step import forward_log_probs


class TrainerSide:
    """The trainer's model (FSDP2 over one rank) with hidden-state hooks; a context manager."""

    def __init__(self, model_path: str, *, device: torch.device, compute_dtype: torch.dtype,
                 train_kernels: str = "triton") -> None:  # fmt: skip
        self.device = device
        self._owns_group = not dist.is_initialized()
        init_distributed(
            rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device_type=device.type
        )
        model = load_model(model_path, fused=False, device=device, dtype=torch.float32)
        if device.type == "cuda" and train_kernels == "triton":  # --train-kernels, as the TrainActor reads it
            enable_train_kernels(model)
        self.model = apply_fsdp(model, build_mesh(device.type, 1), compute_dtype=compute_dtype)
        self.capture = LayerCapture(self.model)

    def __enter__(self) -> TrainerSide:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks; destroy the process group if this object created it."""
        self.capture.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    @torch.no_grad()
    def trace(self, samples: list[Sample], *, temperature: float) -> list[SideTrace]:
        """Pack `samples` into one micro-batch and return each one's log-probs and hidden states (all
        positions but the last, which predicts nothing the engine computes)."""
        batch = TrainBatch(
            rollout_id=0, tokens=[list(s.tokens) for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[[1] * s.response_length for s in samples],
            rewards=[0.0] * len(samples), raw_rewards=[0.0] * len(samples),
        )  # fmt: skip
        mb = build_micro_batch(batch, list(range(len(samples))), self.device)
        self.capture.clear()
        log_probs_M, _ = forward_log_probs(self.model, mb, temperature, with_entropy=False)
        hidden_KNH = self.capture.outputs
        log_probs = log_probs_M.float().cpu().split(mb.response_lengths)
        traces, offset = [], 0
        for sample, part in zip(samples, log_probs, strict=True):
            num_tokens = len(sample.tokens)
            hidden = hidden_KNH[:, offset : offset + num_tokens - 1].clone()
            traces.append(SideTrace(log_probs_R=part.clone(), hidden_KPH=hidden))
            offset += num_tokens
        return traces
