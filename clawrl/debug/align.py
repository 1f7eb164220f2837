"""`clawrl debug align`: run the engine and the trainer on the same tokens and show where they disagree.

    clawrl debug align --hf-checkpoint ckpt --dump dumps/rollout_0.pt --num-samples 8
    clawrl debug align --hf-checkpoint ckpt --prompt "1 + 2 =" --max-new-tokens 16 --temperature 0
    clawrl debug align --hf-checkpoint trained --engine-checkpoint synced --prompt-data p.jsonl --json-out a.json

Token sequences come from a rollout dump (`--save-debug-rollout-data` output) or are generated now by the
engine from prompts. The real engine then replays each response through its own scheduler, paged KV cache,
model runner and sampler (teacher forcing, align_engine.py) and the trainer's model scores the same packed
sequences with the training step's own functions (align_trainer.py). The report (align_report.py) gives the
distribution of |log p_engine - log p_trainer| over response positions, the per-layer max / mean difference of
the hidden states (embedding output, every decoder block, final norm) and the first layer whose difference
exceeds --tolerance. With the same fp32 checkpoint on CPU on both sides everything should be within 1e-5; a
layer named as the first divergence is where to look (its weights on one side, or its kernels).

Exit status: 0 whatever the differences (a diagnostic), 2 on bad input (missing checkpoint, empty dump, ...).
`add_arguments` / `run` are the hooks `clawrl debug` dispatches to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from clawrl.data.sample import Sample
from clawrl.debug.align_capture import layer_names
from clawrl.debug.align_engine import TeacherForcedEngine, build_align_engine, generate_samples
from clawrl.debug.align_report import AlignStats, format_report
from clawrl.debug.align_trainer import TrainerSide
from clawrl.engine.config import check_same_shapes
from clawrl.engine.core.engine import Engine
from clawrl.models.config import load_model_args
from clawrl.trainer.packing import plan_micro_batches

PROG = "clawrl debug align"


class AlignInputError(ValueError):
    """Bad input to `clawrl debug align`; the message names the flag or file and the bad value."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `clawrl debug align`."""
    parser.add_argument("--hf-checkpoint", required=True, help="HF model directory of the trainer side")
    parser.add_argument("--engine-checkpoint", default=None,
                        help="HF model directory of the engine side (default: --hf-checkpoint)")  # fmt: skip
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dump", help="rollout dump file (--save-debug-rollout-data output) to align on")
    source.add_argument("--prompt-data", help="jsonl/parquet prompts; the engine generates the responses")
    source.add_argument("--prompt", action="append", help="a prompt text (repeatable); the engine answers it")
    parser.add_argument("--input-key", default="input", help="--prompt-data field holding the prompt")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="render --prompt-data / --prompt prompts with the tokenizer's chat template")  # fmt: skip
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="response length limit when generating"
    )
    parser.add_argument("--num-samples", type=int, default=None,
                        help="align only the first N samples (dump) or prompts (default: all)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature the log-probs refer to (0: greedy, log-probs at T=1); default: "
                        "the dump's, else 1.0")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="engine dtype and trainer compute dtype")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument(
        "--train-kernels",
        choices=("triton", "torch"),
        default="triton",
        help="trainer side on CUDA: fused Triton RMSNorm/SiLU/RoPE or eager torch ops (as clawrl train)",
    )
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest difference counted as aligned")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192,
                        help="tokens per packed trainer forward (a longer sample gets one of its own)")  # fmt: skip
    parser.add_argument("--json-out", default=None, help="also write the report's numbers to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Align, print the report; 0 on success, 2 (one error line on stderr) on bad input."""
    try:
        summary = align(args)
    except AlignInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(summary))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


def align(args: argparse.Namespace) -> dict[str, Any]:
    """Load both sides, run them on the same tokens, return the report's numbers (align_report.summary)."""
    device = _check_args(args)
    engine_path = args.engine_checkpoint or args.hf_checkpoint
    num_layers = _check_checkpoints(args.hf_checkpoint, engine_path)
    dumped = _read_dump(args) if args.dump else None  # before the engine starts: a bad dump fails fast
    try:
        engine = build_align_engine(engine_path, device=str(device), dtype=args.dtype)
    except ValueError as exc:
        raise AlignInputError(f"--engine-checkpoint {engine_path}: {exc}") from None
    samples, temperature, seeds = dumped if dumped else _generate(args, engine)
    samples, seeds = _usable(samples, seeds, f"--dump {args.dump}" if args.dump else "the generated samples")
    stats = AlignStats(layer_names(num_layers), tolerance=args.tolerance)
    forced = TeacherForcedEngine(engine, temperature=temperature)
    compute_dtype = getattr(torch, args.dtype)
    try:
        with TrainerSide(args.hf_checkpoint, device=device, compute_dtype=compute_dtype,
                         train_kernels=args.train_kernels) as trainer:  # fmt: skip
            for chunk in _chunks(samples, args.max_tokens_per_gpu):
                engine_traces = [_engine_trace(forced, samples[i], i, seeds[i]) for i in chunk]
                # Greedy log-probs are reported at T = 1 by the engine; the trainer divides by the same.
                trainer_traces = trainer.trace([samples[i] for i in chunk], temperature=temperature or 1.0)
                for i, e, t in zip(chunk, engine_traces, trainer_traces, strict=True):
                    stats.add(i, samples[i], e, t)
    finally:
        forced.close()
    decode = engine.tokenizer.decode if engine.tokenizer is not None else None
    summary = stats.summary(decode=decode)
    summary.update(temperature=temperature, hf_checkpoint=args.hf_checkpoint, engine_checkpoint=engine_path,
                   dtype=args.dtype, device=str(device), sampler_check=vars(forced.sampler_check))  # fmt: skip
    return summary


def _check_args(args: argparse.Namespace) -> torch.device:
    for flag, value, ok, must in (
        ("--tolerance", args.tolerance, args.tolerance >= 0, ">= 0"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
        ("--num-samples", args.num_samples, args.num_samples is None or args.num_samples >= 1, ">= 1"),
        ("--temperature", args.temperature, args.temperature is None or args.temperature >= 0, ">= 0"),
        ("--max-tokens-per-gpu", args.max_tokens_per_gpu, args.max_tokens_per_gpu >= 1, ">= 1"),
    ):
        if not ok:
            raise AlignInputError(f"{flag} {value}: must be {must}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise AlignInputError(f"--device {args.device!r}: not a torch device (cpu, cuda, cuda:1)") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        raise AlignInputError(f"--device {args.device!r}: only cpu, or cuda on a machine with a GPU")
    return device


def _check_checkpoints(hf_checkpoint: str, engine_checkpoint: str) -> int:
    """Both directories hold a HF config of the same shapes; returns the number of decoder layers."""
    models = {}
    for flag, path in (("--hf-checkpoint", hf_checkpoint), ("--engine-checkpoint", engine_checkpoint)):
        if not (Path(path) / "config.json").is_file():
            raise AlignInputError(f"{flag} {path}: not a HF model directory (no config.json there)")
        try:
            models[flag] = load_model_args(path)
        except ValueError as exc:
            raise AlignInputError(f"{flag} {path}: {exc}") from None
    try:
        check_same_shapes(models["--hf-checkpoint"], models["--engine-checkpoint"], engine_checkpoint)
    except ValueError as exc:
        raise AlignInputError(f"--engine-checkpoint: {exc}") from None
    return models["--hf-checkpoint"].num_layers


def _generate(args: argparse.Namespace, engine: Engine) -> tuple[list[Sample], float, list[int | None]]:
    """(samples the engine generates now from the prompts, their temperature, their sampling seeds)."""
    temperature = 1.0 if args.temperature is None else args.temperature
    prompts = _prompt_ids(args, engine)[: args.num_samples]
    samples = generate_samples(
        engine, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed
    )
    return samples, temperature, [args.seed + i for i in range(len(samples))]


def _usable(samples: list[Sample], seeds: list, source: str) -> tuple[list[Sample], list]:
    """The samples with both prompt and response tokens (and their seeds); an error when none are."""
    keep = [i for i, s in enumerate(samples) if 0 < s.response_length < len(s.tokens)]
    if not keep:
        raise AlignInputError(f"{source}: no sample with both prompt and response tokens to align on")
    if len(keep) < len(samples):
        print(f"{PROG}: skipping {len(samples) - len(keep)} sample(s) of {source} without a response "
              "or without a prompt", file=sys.stderr)  # fmt: skip
    return [samples[i] for i in keep], [seeds[i] for i in keep]


def _read_dump(args: argparse.Namespace) -> tuple[list[Sample], float, list[int | None]]:
    """(the dump's first --num-samples samples, the temperature they were sampled at, no seeds). The
    temperature is --temperature, else the dump's sampling params', else 1.0 (a slime dump records none)."""
    from clawrl.debug.dump import load_rollout_dump

    try:
        dump = load_rollout_dump(args.dump)
    except (ValueError, OSError) as exc:  # DumpError is a ValueError, FileNotFoundError an OSError
        raise AlignInputError(f"--dump: {exc}") from None
    if not dump.samples:
        raise AlignInputError(f"--dump {args.dump}: the dump holds no samples")
    params = dump.meta.get("sampling_params")
    temperature = args.temperature
    if temperature is None and isinstance(params, dict) and params.get("temperature") is not None:
        temperature = float(params["temperature"])
    samples = list(dump.samples)[: args.num_samples]
    return samples, 1.0 if temperature is None else temperature, [None] * len(samples)


def _prompt_ids(args: argparse.Namespace, engine: Engine) -> list[list[int]]:
    """Token ids of the --prompt texts or the --prompt-data rows (rendered like a rollout renders them)."""
    from clawrl.data.chat import ChatTemplateError, encode_text, render_chat
    from clawrl.data.dataset import DatasetError, PromptDataset

    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise AlignInputError(
            f"--engine-checkpoint {engine.config.model_path}: no tokenizer to encode prompts"
        )
    try:
        if args.prompt_data:
            dataset = PromptDataset(args.prompt_data, tokenizer, input_key=args.input_key,
                                    apply_chat_template=args.apply_chat_template)  # fmt: skip
            texts = [s.prompt for s in dataset.samples]
        else:
            texts = list(args.prompt)
            if args.apply_chat_template:
                texts = [render_chat(tokenizer, [{"role": "user", "content": t}], add_generation_prompt=True)
                         for t in texts]  # fmt: skip
    except (DatasetError, ChatTemplateError, OSError) as exc:
        raise AlignInputError(str(exc)) from None
    where = f"--prompt-data {args.prompt_data}" if args.prompt_data else "--prompt"
    if any(not isinstance(t, str) for t in texts):
        raise AlignInputError(f"{where}: prompts are chat messages; pass --apply-chat-template")
    ids = [encode_text(tokenizer, t) for t in texts]
    if not ids or any(not i for i in ids):
        raise AlignInputError(f"{where}: no prompts, or a prompt that encodes to no tokens")
    return ids


def _chunks(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Sample indices per packed trainer forward, planned like the trainer's dynamic batches (in order)."""
    lengths = [len(s.tokens) for s in samples]
    plan = plan_micro_batches(lengths, 1, max_tokens_per_gpu=max(max_tokens, max(lengths)))
    return [sorted(mb) for mb in plan.per_rank[0] if mb]


def _engine_trace(forced: TeacherForcedEngine, sample: Sample, sample_id: int, seed: int | None):
    try:
        return forced.trace(sample, seed=seed)
    except ValueError as exc:  # the engine's request checks: a token id out of range, too long for context
        raise AlignInputError(f"sample {sample_id}: the engine refuses its tokens: {exc}") from None
