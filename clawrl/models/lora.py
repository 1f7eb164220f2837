"""LoRA for the decoder's linear layers: low-rank adapters trained on top of frozen base weights.

    spec = LoraSpec(rank=16, alpha=32, dropout=0.0, target_modules=("q_proj", "v_proj"))
    names = apply_lora(model, spec)          # replaces the targeted nn.Linear modules in model.model.layers
    y = module(x)                            # x @ W.T + b + scaling * dropout(x) @ A.T @ B.T
    W_merged = module.merged_weight()        # W + scaling * B @ A: what the inference engine loads
    with adapters_disabled(model): ...       # the base model (the reference policy of the KL terms)

A `LoRALinear` keeps the replaced layer's own `weight` and `bias` parameters under the same names, so
loading HF safetensors, reference weights and weight sync see the base layer unchanged; it adds
`lora_A.weight` [rank, in] and `lora_B.weight` [out, rank]. B starts at zero, so a freshly adapted model
computes exactly what the base model does; A starts Kaiming-uniform (the usual LoRA initialisation).
scaling = alpha / rank. Dropout applies to the adapter's input, not to the base path, and only in passes
that train (training mode, gradients on): the trainer's no-grad log-prob passes see no dropout.

PEFT adapter directories (`write_peft_adapter`) follow PEFT's documented checkpoint format:
`adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path, ...) and
`adapter_model.safetensors` whose keys are `base_model.model.<module path>.lora_A.weight` /
`.lora_B.weight` -- the module path being the HF one, which the native decoder's names already are.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ALL_LINEAR = "all-linear"
"""--target-modules value that adapts every linear layer of the decoder blocks (not the LM head)."""

PEFT_PREFIX = "base_model.model."
"""Prefix PEFT puts before a module path in adapter_model.safetensors."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(kw_only=True, frozen=True)
class LoraSpec:
    """What `apply_lora` does to a model (from --lora-rank, --lora-alpha, --lora-dropout, --target-modules)."""

    rank: int
    """Rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: float
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input (training mode only)."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """Last names of the linear modules to adapt (e.g. q_proj, v_proj), or ("all-linear",)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        """Plain types, for meta.json."""
        out = asdict(self)
        out["target_modules"] = list(self.target_modules)
        return out

    @classmethod
    def from_dict(cls, values: Mapping) -> LoraSpec:
        return cls(
            rank=int(values["rank"]),
            alpha=float(values["alpha"]),
            dropout=float(values.get("dropout", 0.0)),
            target_modules=tuple(values["target_modules"]),
        )


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: y = x W^T + b + s * drop(x) A^T B^T."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        # The base layer's own Parameter objects, under the same names: nothing is copied.
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)
        self.dropout = dropout
        self.adapter_enabled = True
        """False inside `adapters_disabled`: the layer is its base layer."""
        self.reset_adapter()

    def reset_adapter(self) -> None:
        """A Kaiming-uniform, B zero: the adapted layer starts equal to the base layer."""
        if self.lora_A.weight.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        # Dropout only in a training pass that builds a graph: the no-grad log-prob passes measure the
        # policy itself, so the first step of a rollout stays exactly on-policy (ppo_kl 0) with dropout on.
        drop = self.dropout > 0 and self.training and torch.is_grad_enabled()
        x = F.dropout(x, self.dropout, training=True) if drop else x
        return out + self.lora_B(self.lora_A(x)) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B @ A, computed in W's dtype (a new tensor; the layer is not changed)."""
        return merge_weight(self.weight, self.lora_A.weight, self.lora_B.weight, self.scaling)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def merge_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float):
    """W [out, in] + scaling * B [out, r] @ A [r, in]: the weight of the merged (adapter-free) layer."""
    with torch.no_grad():
        delta = lora_B.to(torch.float32) @ lora_A.to(torch.float32)
        return (weight.to(torch.float32) + scaling * delta).to(weight.dtype)


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Replace the targeted linear layers of `model.model.layers` by LoRALinear, freeze every other
    parameter; returns the adapted module paths. ValueError naming --target-modules when a target name
    matches no linear layer (the message lists the names that exist)."""
    candidates = _linear_layers(model)
    wanted = set(spec.target_modules)
    if ALL_LINEAR in wanted:
        chosen = list(candidates)
    else:
        available = sorted({path.rsplit(".", 1)[-1] for path in candidates})
        unknown = sorted(wanted - set(available))
        if unknown:
            raise ValueError(
                f"--target-modules {','.join(spec.target_modules)}: {unknown} match no linear layer of the "
                f"model's decoder blocks; its linear layers are {available}"
            )
        chosen = [path for path in candidates if path.rsplit(".", 1)[-1] in wanted]
    for param in model.parameters():
        param.requires_grad_(False)
    for path in chosen:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        adapted = LoRALinear(getattr(parent, attr), rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout)
        setattr(parent, attr, adapted)
    return chosen


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """{module path: nn.Linear} inside the decoder blocks (the LM head and embeddings are never adapted)."""
    layers = model.model.layers
    prefix = _path_of(model, layers)
    return {
        f"{prefix}.{name}": module
        for name, module in layers.named_modules()
        if isinstance(module, nn.Linear) and name
    }


def _path_of(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    raise AssertionError("model.model.layers is not a submodule of the model")


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(module path, LoRALinear) of every adapted layer, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def is_adapter_param(name: str) -> bool:
    """True for a LoRA parameter name (`....lora_A.weight` / `....lora_B.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run the body with every adapter switched off: the model computes its base weights' outputs."""
    modules = [m for _, m in lora_modules(model)]
    for module in modules:
        module.adapter_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.adapter_enabled = True


def merge_adapter_state(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], spec: LoraSpec
) -> dict[str, torch.Tensor]:
    """Full HF-named tensors with each adapted weight replaced by W + scaling * B @ A (on CPU, no model).

    `adapter` holds the trainer's names (`<path>.lora_A.weight`, `<path>.lora_B.weight`); ValueError
    when an adapter has no base weight of the right shape in `base`."""
    merged = dict(base)
    for path in sorted({name.rsplit(".lora_", 1)[0] for name in adapter}):
        key = f"{path}.weight"
        a, b = adapter[f"{path}.lora_A.weight"], adapter[f"{path}.lora_B.weight"]
        if key not in base or tuple(base[key].shape) != (b.shape[0], a.shape[1]):
            found = list(base[key].shape) if key in base else "no such tensor"
            raise ValueError(
                f"the adapter of {path!r} ({list(b.shape)} @ {list(a.shape)}) does not fit the base model's "
                f"{key!r} ({found}) -- is it the base model the adapter was trained on?"
            )
        merged[key] = merge_weight(base[key], a, b, spec.scaling)
    return merged


def peft_config(spec: LoraSpec, base_model: str, adapted_paths: list[str]) -> dict:
    """adapter_config.json's content for `spec` (PEFT's LoraConfig fields for a causal LM)."""
    targets = sorted({p.rsplit(".", 1)[-1] for p in adapted_paths})
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }


def write_peft_adapter(
    adapter: Mapping[str, torch.Tensor], out_dir: str | Path, *, spec: LoraSpec, base_model: str
) -> Path:
    """Write the trainer-named adapter tensors as a PEFT LoRA directory (config + safetensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        PEFT_PREFIX + name: t.detach().to("cpu", copy=True).contiguous() for name, t in adapter.items()
    }
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    paths = sorted({name.rsplit(".lora_", 1)[0] for name in adapter})
    config = peft_config(spec, base_model, paths)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
