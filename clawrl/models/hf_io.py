"""Load a native CausalLM from a HF model directory, and save one back as a HF directory.

    model = load_model("ckpt/Qwen2.5-0.5B", device="cuda", dtype=torch.bfloat16)
    save_hf(model, "out/step_10", source_dir="ckpt/Qwen2.5-0.5B")   # transformers and clawrl load it

Saved directories hold HF-named, un-fused safetensors (one `model.safetensors`, or
`model-0000i-of-0000n.safetensors` shards + `model.safetensors.index.json` above `max_shard_bytes`), a
config.json (the source's, with the dtype updated) and every non-weight file of the source directory
(generation_config.json, tokenizer files, chat template).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from clawrl.models.config import load_model_args
from clawrl.models.decoder import CausalLM
from clawrl.models.loader import (
    INDEX_FILE,
    SINGLE_FILE,
    PackedWeightLoader,
    iter_safetensors,
    load_weights,
    safetensors_weight_map,
)

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""Shard size above which save_hf splits the weights (transformers' historical "5GB")."""

_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def load_model(
    model_dir: str | Path,
    *,
    fused: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """Build the model on the meta device, materialise it on `device` in `dtype`, load the checkpoint."""
    args = load_model_args(model_dir)
    with torch.device("meta"):
        model = CausalLM(args, fused=fused)
    model.to(dtype=dtype)  # still on meta: free, and the real allocation below is already in `dtype`
    model.to_empty(device=device)
    load_weights(model, iter_safetensors(model_dir), files=safetensors_weight_map(model_dir))
    return model


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under HF names: packed parameters split back into q/k/v and gate/up (views,
    no copy); a tied model's lm_head.weight left out, as transformers' own save does."""
    # getattr: parameters replaced by a wrapper (FSDP2's DTensor parameters) no longer carry the hook;
    # only packed parameters need it here, and an FSDP-wrapped trainer model is un-fused.
    loaders = {
        name: getattr(param, "weight_loader", None)
        for name, param in model.named_parameters(remove_duplicate=False)
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            continue
        loader = loaders.get(name)
        if not isinstance(loader, PackedWeightLoader):
            out[name] = tensor
            continue
        prefix, packed, attr = name.rsplit(".", 2)
        for member, shard_id in model.packed_modules[packed]:
            start, size = loader.shard_offsets[shard_id]
            out[f"{prefix}.{member}.{attr}"] = tensor.narrow(0, start, size)
    return out


def save_hf(
    model: CausalLM,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `model` as a HF directory. Earlier weight files of our naming in `out_dir` are replaced."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if _WEIGHT_FILE.match(old.name) or old.name == INDEX_FILE:
            old.unlink()
    _write_weights(hf_state_dict(model), out_dir, max_shard_bytes)
    _write_config(model, out_dir, source_dir)
    if source_dir is not None:
        _copy_non_weight_files(Path(source_dir), out_dir)


def _write_weights(state: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    num_shards = len(shards)
    weight_map = {}
    for i, names in enumerate(shards):
        file = SINGLE_FILE if num_shards == 1 else f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        # A copy per tensor: packed views share storage, which safetensors refuses to write.
        tensors = {name: state[name].detach().to("cpu", copy=True).contiguous() for name in names}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if num_shards > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(model: CausalLM, out_dir: Path, source_dir: str | Path | None) -> None:
    source_config = Path(source_dir) / "config.json" if source_dir is not None else None
    if source_config is not None and source_config.is_file():
        cfg = json.loads(source_config.read_text())
    else:
        cfg = model.args.to_hf_config()
        generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    # transformers 5 reads "dtype", 4.x "torch_dtype": update whichever the source has.
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _copy_non_weight_files(source_dir: Path, out_dir: Path) -> None:
    """Tokenizer files, generation_config.json, chat templates, ...: everything but weights and config."""
    if source_dir.resolve() == out_dir.resolve():
        return
    for path in sorted(source_dir.iterdir()):
        if not path.is_file() or path.name == "config.json" or path.name.startswith("."):
            continue
        if path.name.endswith(_NOT_COPIED):
            continue
        shutil.copy2(path, out_dir / path.name)
