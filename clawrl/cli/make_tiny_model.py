"""`clawrl make-tiny-model OUT_DIR`: write a tiny random HF checkpoint with a locally trained tokenizer.

No download: the tokenizer is trained on a built-in corpus in about a second and the weights are random
(seeded). The directory loads with `transformers.AutoModelForCausalLM.from_pretrained` offline.

    clawrl make-tiny-model /tmp/tiny-qwen3 --arch qwen3 --vocab-size 4096 --hidden-size 64 --num-layers 2
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# Weight files that would be loaded next to (or instead of) ours if left behind by an earlier model.
_STALE_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin*")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from clawrl.models.tiny import TINY_ARCHS

    p = subparsers.add_parser(
        "make-tiny-model",
        help="write a tiny random HF checkpoint + tokenizer (offline)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "out_dir", metavar="OUT_DIR", help="directory to write (must be empty or absent unless --force)"
    )
    p.add_argument("--arch", choices=TINY_ARCHS, default="qwen2", help="model_type of the checkpoint")
    p.add_argument(
        "--vocab-size", type=int, default=4096, help="embedding rows; tokenizer is trained up to it"
    )
    p.add_argument("--hidden-size", type=int, default=64, help="model width")
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers")
    p.add_argument("--num-heads", type=int, default=4, help="attention (query) heads")
    p.add_argument("--num-kv-heads", type=int, default=2, help="key/value heads (GQA); divides --num-heads")
    p.add_argument("--intermediate-size", type=int, default=128, help="MLP hidden size")
    p.add_argument("--max-position-embeddings", type=int, default=2048, help="context length in config.json")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="rotary base frequency")
    p.add_argument("--untied", action="store_true", help="separate lm_head instead of tied embeddings")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the random weight init")
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty OUT_DIR (replaces its weights)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from clawrl.models.tiny import build_tiny_model, check_tiny_model_args

    out = Path(args.out_dir)
    try:
        check_tiny_model_args(
            arch=args.arch,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            intermediate_size=args.intermediate_size,
        )
        _prepare_out_dir(out, force=args.force)
    except ValueError as exc:
        # check_tiny_model_args names Python arguments ("num_heads=3"); show them as this command's flags.
        message = re.sub(r"\b([a-z_]+)=", lambda m: "--" + m[1].replace("_", "-") + "=", str(exc))
        print(f"clawrl make-tiny-model: error: {message}", file=sys.stderr)
        return 2
    path = build_tiny_model(
        out,
        arch=args.arch,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        tie_word_embeddings=not args.untied,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        seed=args.seed,
    )
    print(f"wrote {args.arch} checkpoint with {_count_parameters(path):,} parameters to {path}")
    return 0


def _prepare_out_dir(out: Path, *, force: bool) -> None:
    """Refuse a non-empty directory unless `force`; with `force`, drop old weight files first."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {out} exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    if not force:
        raise ValueError(f"OUT_DIR {out} is not empty; pass --force to write into it")
    for pattern in _STALE_WEIGHT_PATTERNS:
        for stale in out.glob(pattern):
            stale.unlink()


def _count_parameters(path: Path) -> int:
    """Number of stored parameters (a tied lm_head is stored once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(path / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            numel = 1
            for dim in f.get_slice(name).get_shape():
                numel *= dim
            total += numel
    return total
