"""HFModelRunner: the engine's generic path, transformers' own forward with a transformers KV cache.

For a checkpoint whose architecture clawrl/models does not implement (Mistral, Gemma, Phi, ... anything
`AutoModelForCausalLM` loads), or for any checkpoint when the engine is asked for `model_impl="hf"`, the
engine serves the transformers model itself. Each sequence keeps its own `DynamicCache`; a step runs the
scheduled sequences one at a time (prefill chunk or decode token, `logits_to_keep=1`), then samples all
rows together with the engine's sampler, so sampling and log-prob semantics are those of the native runners.
Slower than the native runners (no batching across sequences, no paged attention, no CUDA graphs): it is
the path that makes every model run, not the fast one.

The engine core still plans with its block manager: `hf_block_budget` gives it a KV cache on the meta
device with as many blocks as the real memory budget allows, so the block count bounds the tokens held in
the per-sequence caches (the same bytes per token for plain attention) without allocating paged memory.

Cache bookkeeping: the scheduler's `num_computed_tokens` says which leading tokens it considers computed.
A sequence whose cache holds more than that (preempted, or retracted by a weight update) starts a fresh
cache; one whose cache holds less (a prefix-cache hit on blocks this runner never filled) computes the
missing tokens too. Caches of finished sequences are dropped at the next step; all are dropped when the
engine releases memory (`invalidate_cuda_graphs`).

    engine = Engine(EngineConfig(model_path="/tmp/tiny-mistral"))  # picks this runner by itself
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.scheduler import ScheduledBatch
from clawrl.engine.core.sequence import PENDING_TOKEN, Sequence
from clawrl.engine.runner.base import StepHandle, sample_step
from clawrl.engine.runner.kv_cache import KVCache, bytes_per_block, plan_num_blocks
from clawrl.models.config import SUPPORTED_ARCHS, ModelArgs


class HFModelArgs(ModelArgs):
    """ModelArgs of a checkpoint served through transformers: `arch` is any model_type transformers loads as
    a causal LM. Only the fields the engine core reads are filled (sizes, positions, tied head, token ids);
    the rest (RoPE, norms, biases, MoE) keep their defaults, which nothing on this path reads."""

    def __post_init__(self) -> None:
        # ModelArgs' checks guard the native decoder (arch it implements, even head_dim for its RoPE, MoE
        # sizes); transformers already validated this config and runs the model itself.
        pass


def uses_hf_runner(config: EngineConfig) -> bool:
    """True when the engine must serve `config.model_path` through transformers: `model_impl` "hf", or an
    architecture clawrl/models does not implement (with `model_impl` "auto")."""
    impl = getattr(config, "model_impl", "auto")
    if impl == "hf":
        return True
    model_type = _read_json(Path(config.model_path) / "config.json").get("model_type")
    if impl == "native" and model_type not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{config.model_path}/config.json: model_type {model_type!r} has no native implementation "
            f"(native: {', '.join(SUPPORTED_ARCHS)}); use model_impl 'hf' or 'auto'"
        )
    return model_type not in SUPPORTED_ARCHS


def hf_model_args(model_dir: str | Path) -> HFModelArgs:
    """Read a checkpoint's architecture with transformers' AutoConfig (unknown model types: one error
    naming what is supported)."""
    config = _auto_config(model_dir).get_text_config()
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    eos = _id_list(getattr(config, "eos_token_id", None))
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        eos += [i for i in _id_list(_read_json(generation).get("eos_token_id")) if i not in eos]
    return HFModelArgs(
        arch=config.model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        intermediate_size=getattr(config, "intermediate_size", None) or 0,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=getattr(config, "bos_token_id", None), eos_token_ids=eos,
    )  # fmt: skip


def load_hf_engine_model(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """transformers' causal LM of `model_dir` in `dtype` on `device`, eval mode, SDPA attention."""
    from transformers import AutoModelForCausalLM

    _auto_config(model_dir)  # the clear error for unknown architectures
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def hf_block_budget(
    config: EngineConfig, args: HFModelArgs, *, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """A KV cache on the meta device (no memory) with the number of blocks the real budget allows."""
    shape = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    num_blocks = plan_num_blocks(
        num_kv_blocks=config.num_kv_blocks, device=device, mem_fraction_static=config.mem_fraction_static,
        cpu_kv_cache_gib=config.cpu_kv_cache_gib,
        block_bytes=bytes_per_block(block_size=config.block_size, dtype=dtype, **shape),
    )  # fmt: skip
    return KVCache(num_blocks=num_blocks, block_size=config.block_size, dtype=dtype, device="meta", **shape)


@dataclass(kw_only=True, eq=False)
class _SequenceCache:
    seq: Sequence
    cache: Any
    """transformers DynamicCache holding the K/V of the sequence's first `length` tokens."""
    length: int = 0


class HFModelRunner:
    """Runs scheduled steps of a transformers causal LM, one sequence at a time (module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renames past_key_values to cache (the old name is deprecated, then removed).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = "logits_to_keep" in params
        self._caches: dict[int, _SequenceCache] = {}
        self._last_tokens: dict[int, int] = {}  # seq_id -> token sampled by the last launch

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward the batch; returns (sampling sequences, their next tokens, those tokens' logprobs)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Compute the step now (sequence by sequence) and sample; `collect` returns the results."""
        self._caches = {k: c for k, c in self._caches.items() if not c.seq.is_finished}
        seqs, rows = [], []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            logits_V = self._advance(seq, seq.num_computed_tokens + num_new)
            if batch.samples(i):
                seqs.append(seq)
                rows.append(logits_V)
        if not seqs:
            return StepHandle(seqs=[], tokens=[], logprobs=[])
        handle = sample_step(torch.stack(rows), seqs)
        self._last_tokens = {seq.seq_id: token for seq, token in zip(seqs, handle.tokens, strict=True)}
        return handle

    def collect(self, handle: StepHandle) -> tuple[list[Sequence], list[int], list[float]]:
        """(sampling sequences, their next tokens, those tokens' logprobs) of a launched step."""
        return handle.seqs, handle.tokens, handle.logprobs

    def capture_cuda_graphs(self) -> None:
        """No CUDA graphs on this path."""

    def invalidate_cuda_graphs(self) -> None:
        """The engine frees or moves memory: drop every sequence's cache (recomputed when needed)."""
        self._caches.clear()

    def _advance(self, seq: Sequence, end: int) -> torch.Tensor:
        """Feed the sequence's tokens up to `end` through the model; logits [V] of the last one."""
        entry = self._caches.get(seq.seq_id)
        if entry is None or entry.length > seq.num_computed_tokens:
            entry = self._caches[seq.seq_id] = _SequenceCache(seq=seq, cache=self._new_cache())
        start = entry.length
        ids = seq.token_ids(start, end)
        if ids[-1] == PENDING_TOKEN:  # overlap schedule: sampled by the previous launch
            ids[-1] = self._last_tokens[seq.seq_id]
        kwargs = {self._cache_kwarg: entry.cache, "use_cache": True}
        if self._keep_kwarg:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
            position_ids=torch.arange(start, end, device=self.device)[None],
            **kwargs,
        )
        entry.length = end
        return out.logits[0, -1]

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


def _auto_config(model_dir: str | Path):
    """transformers' config of `model_dir`; an architecture it cannot load as a causal LM is one error
    naming what the engine serves."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model_dir) / "config.json"
    model_type = _read_json(path).get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported by the engine: it serves the native "
            f"architectures ({', '.join(SUPPORTED_ARCHS)}) and, through transformers "
            f"{transformers.__version__}, any of its {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} causal-LM "
            "model types (mistral, gemma, gemma2, phi3, llama, ...)"
        )
    return AutoConfig.from_pretrained(model_dir)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found (a HF model directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
