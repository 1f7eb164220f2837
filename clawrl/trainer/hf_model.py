"""`--model-impl hf`: a `transformers.AutoModelForCausalLM` behind the trainer's model interface.

The trainer calls its model as `model(input_ids_N, positions_N, attn) -> hidden [N, D]` (final norm
applied), reads `model.lm_head.weight` for the fused log-prob function, and shards `model.model.layers`
with FSDP2. `HFCausalLM` gives a transformers model that shape without renaming anything: the HF model's
own `model` and `lm_head` submodules become the adapter's, so parameter names are exactly the checkpoint's
(reference weights, DCP checkpoints and weight sync work unchanged).

transformers has no varlen path on every device, so each packed micro-batch runs as a right-padded batch
[B, L_max] with an attention mask; the valid rows are gathered back into packed order. Padding costs
compute: this path is the fallback for architectures clawrl/models does not implement, not the fast path.

    model = load_hf_model("ckpt/SomeModel", device="cuda")
    hidden_N = model(input_ids_N, positions_N, VarlenAttention.from_lengths([5, 3], device="cuda"))

Legend: N = packed tokens, B = sequences in the micro-batch, L = longest sequence, D = hidden size.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
from torch import nn

from clawrl.models.attention import VarlenAttention

# Files a HF export does not copy from the source directory (weights and config are written fresh).
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class HFCausalLM(nn.Module):
    """Adapter around a transformers CausalLM: `model` and `lm_head` are the HF model's own submodules."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        for attr in ("model", "lm_head"):
            if not isinstance(getattr(hf_model, attr, None), nn.Module):
                raise ValueError(
                    f"--model-impl hf needs a causal LM with `.model` (decoder) and `.lm_head` submodules; "
                    f"{type(hf_model).__name__} has no `{attr}`"
                )
        if not isinstance(getattr(hf_model.model, "layers", None), nn.ModuleList):
            raise ValueError(
                f"--model-impl hf shards `model.layers`, which {type(hf_model.model).__name__} does not have"
            )
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.config = hf_model.config

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: VarlenAttention
    ) -> torch.Tensor:
        """input_ids, positions [N] packed as `attn.cu_seqlens` says -> final-normed hidden states [N, D]."""
        lengths = _segment_lengths(attn, input_ids.shape[0])
        valid_BL = _valid_mask(lengths, input_ids.device)
        ids_BL = input_ids.new_zeros(valid_BL.shape)
        ids_BL[valid_BL] = input_ids
        pos_BL = positions.new_zeros(valid_BL.shape)
        pos_BL[valid_BL] = positions
        out = self.model(
            input_ids=ids_BL, attention_mask=valid_BL.long(), position_ids=pos_BL, use_cache=False
        )
        return out.last_hidden_state[valid_BL]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, D] -> logits [M, vocab] (in the model's dtype)."""
        return self.lm_head(hidden)


def _segment_lengths(attn: VarlenAttention, num_tokens: int) -> list[int]:
    bounds = [int(b) for b in attn.cu_seqlens.tolist()]
    if bounds[-1] != num_tokens:
        raise ValueError(f"packed batch has {num_tokens} tokens but cu_seqlens ends at {bounds[-1]}")
    return [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def _valid_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[B, L_max] bool, True on the first lengths[b] positions of row b (right padding)."""
    lengths_B = torch.tensor(lengths, device=device)
    return torch.arange(max(lengths), device=device)[None, :] < lengths_B[:, None]


def load_hf_model(model_dir: str | Path, device: torch.device | str = "cpu") -> HFCausalLM:
    """Load `model_dir` with transformers in fp32 on `device`, dropout off, SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    _disable_dropout(config)
    with _no_progress_bars():
        hf_model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=torch.float32, attn_implementation="sdpa"
        )
    return HFCausalLM(hf_model.to(device))


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' per-load and per-save progress bars are noise in trainer logs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _disable_dropout(config) -> None:
    """Zero every dropout probability of the config (and its sub-configs).

    RL needs the log-probs of the loss to equal those of the log-prob pass bit for bit (step 1 is exactly
    on-policy); random dropout masks would break that, so the trainer never uses dropout.
    """
    for name, value in vars(config).items():
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _disable_dropout(value)


def save_hf_model(state: dict[str, torch.Tensor], out_dir: str | Path, *, source_dir: str | Path) -> None:
    """Write HF-named full tensors `state` as a HF directory of `source_dir`'s architecture (transformers'
    own save), with the source's tokenizer and generation files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source_dir)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _, unexpected = shell.load_state_dict(state, strict=False, assign=True)
    # Tied weights appear once in `state` (named_parameters deduplicates); tie them again after assign.
    shell.tie_weights()
    if unexpected:
        raise ValueError(f"cannot export to {out_dir}: {source_dir} has no parameters {unexpected[:4]}")
    still_meta = [n for n, p in shell.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"cannot export to {out_dir}: no tensors for {still_meta[:4]} of {source_dir}")
    out = Path(out_dir)
    with _no_progress_bars():
        shell.save_pretrained(out)
    _copy_non_weight_files(Path(source_dir), out)


def _copy_non_weight_files(source_dir: Path, out_dir: Path) -> None:
    """Tokenizer files, generation_config.json, chat templates: everything but weights and config.json."""
    if source_dir.resolve() == out_dir.resolve():
        return
    for path in sorted(source_dir.iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(_NOT_COPIED):
            shutil.copy2(path, out_dir / path.name)
