"""`clawrl convert-checkpoint CKPT_DIR --to-hf OUT`: a `--save` checkpoint as a HF model directory.

    clawrl convert-checkpoint ckpt --to-hf out/model                 # the latest checkpoint in ckpt/
    clawrl convert-checkpoint ckpt --to-hf out/model --step 3 --dtype bfloat16
    clawrl convert-checkpoint ckpt/iter_0000003 --to-hf out/model    # one iteration directory

Writes what `--save-hf` writes (config, tokenizer, chat template, safetensors in the source model's dtype
or --dtype, sharded above --max-shard-size), bit for bit: the same trainer weights, the same writer. Runs
on CPU in this process: no Ray, no process group. The source model directory (config and tokenizer) is the
--hf-checkpoint the checkpoint's run recorded in its meta.json, or this command's --hf-checkpoint.

A LoRA checkpoint (--lora-rank) holds only the adapters: they are merged into SOURCE's weights for OUT,
and written as a PEFT adapter directory to OUT/adapter/.

Exit codes: 0 written; 2 a missing directory, not a clawrl checkpoint, no source model, or an architecture
that cannot be exported (one line on stderr naming the path or flag).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "clawrl convert-checkpoint"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from clawrl.models.hf_io import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES

    p = subparsers.add_parser(
        "convert-checkpoint",
        help="write a --save checkpoint as a HF model directory (transformers, clawrl engine load it)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a --save directory, or one iter_* directory in it")
    p.add_argument("--to-hf", required=True, metavar="OUT", help="the HF directory to write (replaced)")
    p.add_argument(
        "--hf-checkpoint",
        metavar="SOURCE",
        help="the model directory training started from (config, tokenizer); default: the one the "
        "checkpoint recorded",
    )
    p.add_argument(
        "--dtype", choices=list(EXPORT_DTYPES), help="dtype of the written weights; default: SOURCE's"
    )
    p.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the iteration to convert (directory iter_000000N, after rollout N-1); default: the latest",
    )
    p.add_argument(
        "--max-shard-size",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="BYTES",
        help=f"split the weights into shards of at most BYTES (default {DEFAULT_MAX_SHARD_BYTES})",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        print(f"{PROG}: {convert(args)}")
    except ValueError as exc:  # CheckpointError and the export's errors: user mistakes, one line each
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def convert(args: argparse.Namespace) -> str:
    """Read the checkpoint, write the export; returns the line that says what was written."""
    from clawrl.models.hf_io import export_hf_dir, parse_dtype, source_dtype
    from clawrl.trainer.checkpoint import find_iteration_dir, read_model_state

    if args.max_shard_size < 1:
        raise ValueError(f"--max-shard-size must be >= 1, got {args.max_shard_size}")
    path = find_iteration_dir(args.ckpt_dir, iteration=args.step)
    state, meta = read_model_state(path)
    source = source_model_dir(meta, args.hf_checkpoint, path)
    dtype = parse_dtype(args.dtype) if args.dtype else source_dtype(source)
    adapter = lora = None
    if "lora" in meta:  # the checkpoint holds adapters only: merge them into SOURCE's weights
        from clawrl.trainer.lora_state import merged_checkpoint_state

        adapter = state
        state, lora = merged_checkpoint_state(adapter, meta, source)
    out = export_hf_dir(
        state, args.to_hf, source_dir=source, dtype=dtype, max_shard_bytes=args.max_shard_size,
        adapter=adapter, lora=lora,
    )  # fmt: skip
    num_files = len(list(out.glob("*.safetensors")))
    after = f" (after rollout {meta['rollout_id']})" if "rollout_id" in meta else ""
    return (
        f"{path}{after} -> {out}: {len(state)} tensors read, written in {str(dtype).removeprefix('torch.')}, "
        f"{num_files} safetensors file(s), config and tokenizer of {source}"
    )


def source_model_dir(meta: dict, flag_value: str | None, path: Path) -> str:
    """--hf-checkpoint if given, else the one recorded in meta.json's job config; it must be a directory."""
    recorded = meta.get("extra", {}).get("job", {}).get("model", {}).get("hf_checkpoint")
    source = flag_value or recorded
    if not source:
        raise ValueError(
            f"{path}: the checkpoint does not record its source model; pass --hf-checkpoint SOURCE "
            "(the model directory its training started from)"
        )
    if not Path(source).is_dir():
        how = "--hf-checkpoint" if flag_value else f"the source model recorded in {path / 'meta.json'}"
        hint = "" if flag_value else "; pass --hf-checkpoint SOURCE"
        raise ValueError(f"{how} {source!r} is not a directory{hint}")
    return source
