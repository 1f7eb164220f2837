"""The trainer's side of LoRA (`--lora-rank N`): adapters on the policy, its reference, its checkpoint meta.

    spec = lora_spec_of(job.train)                    # None when --lora-rank is 0
    apply_lora(model, spec)                           # before FSDP: frozen base, trainable A/B
    ref = lora_reference(model, job.model)            # the base weights: adapters off, no second copy
    meta["lora"] = lora_meta(spec, job.model.hf_checkpoint)

Weight sync and HF export see merged weights (clawrl/trainer/weights.py); checkpoints hold only the
adapters and their optimizer state (clawrl/trainer/checkpoint.py, `trainable_only`), with the base model's
path and the LoRA settings in meta.json so `clawrl convert-checkpoint` can rebuild the merged model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from clawrl.config.model import ModelConfig
from clawrl.config.train import TrainConfig, parse_target_modules
from clawrl.models.loader import iter_safetensors
from clawrl.models.lora import LoraSpec, adapters_disabled, is_adapter_param, merge_adapter_state
from clawrl.trainer.weights import WeightBank, full_shapes


def lora_spec_of(train: TrainConfig) -> LoraSpec | None:
    """The policy's LoRA adapters from the --lora-* flags; None when --lora-rank is 0."""
    if train.lora_rank == 0:
        return None
    return LoraSpec(rank=train.lora_rank, alpha=train.lora_alpha, dropout=train.lora_dropout,
                    target_modules=parse_target_modules(train.target_modules))  # fmt: skip


class AdapterFreeReference:
    """The reference policy of a LoRA model whose reference is its base model: the adapters switched
    off. It holds no tensors (the frozen base weights are the reference weights)."""

    def __init__(self):
        self.shards: list[torch.Tensor] = []  # WeightBank's interface (offload moves these): none here

    def swapped_into(self, model: nn.Module):
        return adapters_disabled(model)


def lora_reference(model: nn.Module, model_cfg: ModelConfig):
    """The KL terms' reference for a LoRA policy: its base model (adapters off) when --ref-load is unset or
    names --hf-checkpoint; else a WeightBank holding --ref-load's weights with zero adapters."""
    ref_dir = model_cfg.ref_load
    if not ref_dir or Path(ref_dir).resolve() == Path(model_cfg.hf_checkpoint).resolve():
        return AdapterFreeReference()
    bank = WeightBank(model)
    named = dict(iter_safetensors(ref_dir))
    # B = 0 makes every adapter's output exactly 0 whatever A holds: the reference is --ref-load itself.
    named.update({n: torch.zeros(shape) for n, shape in full_shapes(model).items() if is_adapter_param(n)})
    bank.load_(named, model, source=f"--ref-load {ref_dir}")
    return bank


def lora_meta(spec: LoraSpec, base_model: str) -> dict[str, Any]:
    """meta.json's "lora" entry: the settings and the base model the adapters belong to."""
    return {**spec.to_dict(), "base_model": str(Path(base_model).resolve())}


def merged_checkpoint_state(
    adapter: dict[str, torch.Tensor], meta: dict[str, Any], source: str | Path
) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """A LoRA checkpoint's model as full HF-named tensors: `source`'s base weights (read from its
    safetensors) with each adapter merged in; and the adapters' spec (from meta.json)."""
    spec = LoraSpec.from_dict(meta["lora"])
    base = dict(iter_safetensors(source))
    return merge_adapter_state(base, adapter, spec), spec
