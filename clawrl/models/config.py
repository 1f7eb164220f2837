"""ModelArgs: the architecture of a Qwen2/Qwen2.5, Qwen3, Llama, Qwen3-MoE or Qwen2-MoE decoder, read from a HF
`config.json`.

`load_model_args(model_dir)` reads `config.json` (and the EOS ids of `generation_config.json`, which is
what `transformers` `generate` stops on). Both the transformers 4.x layout (`rope_theta` + `rope_scaling`,
`torch_dtype`) and the 5.x layout (`rope_parameters`, `dtype`) are accepted. Anything the native model
does not implement (another `model_type`, a RoPE scaling other than Llama-3's, sliding-window attention,
an activation other than SiLU) is one ValueError naming the file and the value, so that the caller can
fall back to `transformers` instead of silently computing something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
"""HF `model_type` values the native decoder implements."""

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
"""The mixture-of-experts members of SUPPORTED_ARCHS (router + experts in place of some MLPs)."""

_HF_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(kw_only=True)
class ModelArgs:
    """Architecture of one decoder-only model (everything needed to build it; no weights)."""

    arch: str
    """HF model_type: "qwen2" (Qwen2 and Qwen2.5), "qwen3", "llama", "qwen3_moe" or "qwen2_moe"."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder layers (HF num_hidden_layers)."""
    num_heads: int
    """Query heads per layer (HF num_attention_heads)."""
    num_kv_heads: int
    """Key/value heads per layer (HF num_key_value_heads); < num_heads means grouped-query attention."""
    head_dim: int
    """Width of one attention head (HF head_dim, default hidden_size // num_heads)."""
    intermediate_size: int
    """Width of the gated SiLU MLP."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """None, or Llama-3 frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}."""
    max_position_embeddings: int = 4096
    """Longest position the RoPE cache covers (positions must be < this)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (no separate lm_head.weight)."""
    qkv_bias: bool = False
    """q/k/v projections have a bias (always for Qwen2; HF attention_bias for Llama/Qwen3)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    attention_bias: bool = False
    """o_proj has a bias (HF attention_bias of Llama/Qwen3; False for Qwen2)."""
    mlp_bias: bool = False
    """gate/up/down projections have a bias (HF mlp_bias of Llama)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the model has one."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (config.json and generation_config.json, in that order)."""
    torch_dtype: str = "float32"
    """Dtype the checkpoint was saved in ("bfloat16", "float16", "float32")."""
    num_experts: int = 0
    """Routed experts per MoE layer (HF num_experts / num_local_experts); 0 = a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's gated SiLU MLP."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1 (else they are the raw softmax values)."""
    decoder_sparse_step: int = 1
    """Layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 (and i is not in mlp_only_layers)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layer indices that keep a dense MLP of intermediate_size in an MoE model."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert of Qwen2-MoE (sigmoid-gated); 0 = none (Qwen3-MoE)."""
    router_aux_loss_coef: float = 0.0
    """HF router_aux_loss_coef: the weight transformers gives the load-balancing loss (clawrl logs it)."""

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"ModelArgs.arch={self.arch!r} is not supported; expected one of {SUPPORTED_ARCHS}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name}={getattr(self, name)} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelArgs.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.arch in MOE_ARCHS:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name}={getattr(self, name)} must be > 0 for arch={self.arch!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"ModelArgs.num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )

    @property
    def is_moe(self) -> bool:
        """True for the mixture-of-experts architectures."""
        return self.arch in MOE_ARCHS

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a router and experts (transformers' rule) or a dense MLP."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelArgs:
        """Build from a parsed HF config.json; `source` names the file in error messages."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"{source}: model_type={arch!r} is not implemented natively (supported: "
                f"{', '.join(SUPPORTED_ARCHS)}); use --model-impl hf for other architectures"
            )
        _reject_unsupported_features(cfg, source)
        missing = [key for key in _REQUIRED_KEYS if cfg.get(key) is None]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {missing}")
        num_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        theta, scaling = _parse_rope(cfg, source)
        try:
            return cls(
                arch=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
                intermediate_size=cfg["intermediate_size"],
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 hard-codes bias on q/k/v (not o), Qwen2-MoE reads it from qkv_bias (default on);
                # Llama, Qwen3 and Qwen3-MoE use attention_bias for all four.
                qkv_bias=_qkv_bias(arch, cfg, attention_bias),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                attention_bias=False if arch in ("qwen2", "qwen2_moe") else attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "llama" else False,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
                torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                **(_moe_fields(cfg) if arch in MOE_ARCHS else {}),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers-5 style config.json dict describing this architecture (used when no source dir)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        cfg = {
            "architectures": [_HF_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _from_id_list(self.eos_token_ids),
            "dtype": self.torch_dtype,
        }
        if self.arch not in ("qwen2", "qwen2_moe"):
            cfg["attention_bias"] = self.attention_bias
        if self.arch == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        if self.is_moe:
            cfg.update(self._moe_hf_fields())
        return cfg

    def _moe_hf_fields(self) -> dict[str, Any]:
        cfg = {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "router_aux_loss_coef": self.router_aux_loss_coef,
        }
        if self.arch == "qwen2_moe":
            cfg["qkv_bias"] = self.qkv_bias
            cfg["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return cfg


def load_model_args(model_dir: str | Path) -> ModelArgs:
    """Read `<model_dir>/config.json` (+ EOS ids from generation_config.json when present)."""
    path = Path(model_dir) / "config.json"
    cfg = _read_json(path, what="a HF model directory needs config.json")
    args = ModelArgs.from_hf_config(cfg, source=str(path))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        gen_eos = _as_id_list(_read_json(gen_path, what="").get("eos_token_id"))
        args.eos_token_ids += [i for i in gen_eos if i not in args.eos_token_ids]
    return args


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: file not found ({what})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _from_id_list(ids: list[int]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _qkv_bias(arch: str, cfg: dict[str, Any], attention_bias: bool) -> bool:
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    return attention_bias


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE keys of a Qwen3-MoE / Qwen2-MoE config.json (transformers 5 writes Qwen3-MoE's expert
    count as `num_local_experts`, 4.x as `num_experts`; both are read)."""
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return {
        "num_experts": int(num_experts or 0),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef") or 0.0),
    }


def _reject_unsupported_features(cfg: dict[str, Any], source: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported (only 1.0)")


def _parse_rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{source}: per-layer-type rope_parameters={params} are not supported")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"{source}: RoPE scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    missing = [k for k in _LLAMA3_KEYS[:3] if k not in params]
    if missing:
        raise ValueError(f"{source}: llama3 rope scaling {params} lacks {missing}")
    scaling = {"rope_type": "llama3", **{k: float(params[k]) for k in _LLAMA3_KEYS[:3]}}
    # transformers falls back to max_position_embeddings when the original context length is absent.
    original = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling
