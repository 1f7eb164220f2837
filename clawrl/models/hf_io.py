"""Load a native CausalLM from a HF model directory, and save one back as a HF directory.

    model = load_model("ckpt/Qwen2.5-0.5B", device="cuda", dtype=torch.bfloat16)
    save_hf(model, "out/step_10", source_dir="ckpt/Qwen2.5-0.5B")   # transformers and clawrl load it
    export_hf_dir(state, "out/step_10", source_dir="ckpt/Qwen2.5-0.5B")  # HF-named tensors, atomically

Saved directories hold HF-named, un-fused safetensors (one `model.safetensors`, or
`model-0000i-of-0000n.safetensors` shards + `model.safetensors.index.json` above `max_shard_bytes`), a
config.json (the source's, with the dtype updated) and every non-weight file of the source directory
(generation_config.json, tokenizer files, chat template).

`export_hf_dir` is what `--save-hf` and `clawrl convert-checkpoint` write: the tensors in the source's
dtype (or the one asked for), a tied LM head stored or left out as the source stores it, and the directory
built under `OUT.tmp-*` and renamed into place, so a crash never leaves a half-written export at OUT.
Architectures clawrl/models implements are written by clawrl; others (trained with `--model-impl hf`) by
transformers' own `save_pretrained`, which knows their on-disk names. A LoRA policy's export is its merged
model plus, in `OUT/adapter/`, the adapters as a PEFT directory (adapter_config.json,
adapter_model.safetensors) for `PeftModel.from_pretrained(base, OUT/adapter)`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from clawrl.models.config import SUPPORTED_ARCHS, load_model_args
from clawrl.models.decoder import CausalLM
from clawrl.models.loader import (
    INDEX_FILE,
    SINGLE_FILE,
    PackedWeightLoader,
    iter_safetensors,
    load_weights,
    safetensors_weight_map,
)
from clawrl.models.lora import LoraSpec, write_peft_adapter

ADAPTER_SUBDIR = "adapter"
"""Where a LoRA export's PEFT adapter directory goes inside the (merged) HF export."""

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
    no copy); a tied model's lm_head.weight left out, as transformers' own save does. A transformers model
    (the engine's path for other architectures) gives its parameters, a tied head once, under its names."""
    if not isinstance(model, CausalLM):
        return {name: param.detach() for name, param in model.named_parameters()}
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
    _set_dtype(cfg, model.model.embed_tokens.weight.dtype)
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


EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""Dtypes an export can be written in (`clawrl convert-checkpoint --dtype`)."""

_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_BUFFERS_NOT_EXPORTED = ("rotary_emb.inv_freq",)


def parse_dtype(name: str, *, flag: str = "--dtype") -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; anything else than EXPORT_DTYPES is one error naming `flag`."""
    if name not in EXPORT_DTYPES:
        raise ValueError(f"{flag} {name!r} is not supported; expected one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def source_dtype(source_dir: str | Path) -> torch.dtype:
    """The dtype a HF checkpoint is stored in: its config's `dtype` (transformers 5) or `torch_dtype`
    (4.x), else the dtype of its first floating-point tensor, else float32."""
    cfg = _read_config(Path(source_dir))
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and name in EXPORT_DTYPES:
        return EXPORT_DTYPES[name]
    return _stored_float_dtype(Path(source_dir)) or torch.float32


def _stored_float_dtype(source_dir: Path) -> torch.dtype | None:
    try:
        files = sorted(set(safetensors_weight_map(source_dir).values()))
    except ValueError:  # no safetensors at all: nothing to read the dtype from
        return None
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    return None


def export_hf_dir(
    state: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    source_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    adapter: Mapping[str, torch.Tensor] | None = None,
    lora: LoraSpec | None = None,
) -> Path:
    """Write the HF-named full tensors `state` as a HF directory of `source_dir`'s architecture at
    `out_dir` (in `dtype`, default the source's), replacing an earlier export there. Returns `out_dir`.

    A LoRA model passes its merged weights as `state` and its adapters (trainer names, with their `lora`
    spec): they go, in the same dtype, to `OUT/adapter/` as a PEFT adapter directory whose base model is
    `source_dir` -- a subdirectory, because transformers would try to apply an adapter_config.json
    found beside config.json on top of the (already merged) weights.

    The directory is complete before it appears: it is built as a sibling `OUT.tmp-*` and renamed.
    """
    source, out = Path(source_dir), Path(out_dir)
    _check_replaceable(out, source)
    dtype = dtype or source_dtype(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        tensors = _native_export_tensors(state, source)
        if tensors is not None:
            _write_weights({n: t.to(dtype) for n, t in tensors.items()}, staging, max_shard_bytes)
            cfg = _set_dtype(_read_config(source), dtype)
            (staging / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        else:
            _save_with_transformers(state, staging, source, dtype, max_shard_bytes)
        _copy_non_weight_files(source, staging)
        if adapter is not None:
            assert lora is not None, "an adapter export needs its LoraSpec"
            tensors = {name: t.to(dtype) for name, t in adapter.items()}
            write_peft_adapter(tensors, staging / ADAPTER_SUBDIR, spec=lora, base_model=str(source.resolve()))
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _check_replaceable(out: Path, source: Path) -> None:
    """An export replaces only an earlier export (or an empty directory), never the source or other data."""
    if not (source / "config.json").is_file():
        raise ValueError(
            f"{source}: not a HF model directory (no config.json) to take the export's config from"
        )
    if not out.exists():
        return
    if out.resolve() == source.resolve():
        raise ValueError(f"{out}: is the source model directory itself; export to another directory")
    if not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(f"{out}: exists and is not a HF model directory (no config.json); not replacing it")


def _native_export_tensors(state: Mapping[str, torch.Tensor], source: Path) -> dict | None:
    """`state` as clawrl writes it for the source's architecture (a tied LM head stored only if the source
    stores one), or None when clawrl/models does not implement it or the names are not the native ones."""
    try:
        args = load_model_args(source)
    except ValueError:  # an architecture only transformers implements
        return None
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in hf_state_dict(CausalLM(args)).items()}
    tensors = {n: t for n, t in state.items() if not n.endswith(_BUFFERS_NOT_EXPORTED)}
    if args.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # an alias of the embedding, when the state carries it
    if {n: tuple(t.shape) for n, t in tensors.items()} != expected:
        return None
    if args.tie_word_embeddings and "lm_head.weight" in _stored_names(source):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def _stored_names(source: Path) -> set[str]:
    try:
        return set(safetensors_weight_map(source))
    except ValueError:  # a source without weight files: store the tied head as transformers would (not)
        return set()


def _save_with_transformers(state, staging: Path, source: Path, dtype: torch.dtype, max_shard_bytes: int):
    """Architectures outside clawrl/models: transformers maps module names to on-disk names itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source)
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError):  # transformers' own message spans lines and suggests upgrading
        import transformers

        model_type = _read_config(source).get("model_type")
        raise ValueError(
            f"{source}: unsupported architecture for a HF export: model_type {model_type!r} is neither one "
            f"clawrl implements ({', '.join(SUPPORTED_ARCHS)}) nor one transformers {transformers.__version__} "
            "knows as a causal LM"
        ) from None
    expected = {n: tuple(t.shape) for n, t in shell.state_dict().items()}
    found = {n: tuple(t.shape) for n, t in state.items()}
    wrong = sorted(n for n, shape in found.items() if expected.get(n) != shape)
    if wrong:
        raise ValueError(
            f"{source}: the weights do not fit its architecture ({config.model_type}): tensor {wrong[0]!r} "
            f"has shape {list(found[wrong[0]])}, expected {list(expected.get(wrong[0], ())) or 'no such tensor'}"
        )
    shell.load_state_dict({n: t.to(dtype) for n, t in state.items()}, strict=False, assign=True)
    shell.tie_weights()  # a tied head is absent from the trainer's (deduplicated) parameters
    missing = [n for n, p in shell.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{source}: the weights have no tensor for {missing[:4]}")
    shell.save_pretrained(staging, max_shard_size=max_shard_bytes)
    if not (source / "generation_config.json").is_file():
        (staging / "generation_config.json").unlink(missing_ok=True)  # the source has none: neither do we


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished `staging` to `out`; an earlier export there is moved aside first, then removed."""
    if not out.exists():
        os.rename(staging, out)
        return
    old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found (a HF model directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _set_dtype(cfg: dict, dtype: torch.dtype) -> dict:
    """transformers 5 reads "dtype", 4.x "torch_dtype": update whichever the config has."""
    name = str(dtype).removeprefix("torch.")
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    return cfg
