"""Trainer throughput: clawrl's trainer (TrainActor) against plain transformers, on one GPU.

A random-weight Qwen2 checkpoint of the chosen shape is written locally (no download; default Qwen2.5-1.5B:
hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings). Phases:

  ours comes in two paths (--path, default both, measured one after the other in the same process):
      fast:  the world-size-1 default -- no FSDP2: a bf16 module, an fp32 master copy in flat buffers,
             bf16 gradients cast once into fp32 ones, fused AdamW on the master (clawrl/trainer/single_rank.py)
      fsdp:  `--no-fast-single-rank` -- 1-rank FSDP2 with MixedPrecisionPolicy(bf16 params, fp32 reduce)
  (a) fixed batch, 4 sequences x 2048 tokens, one optimizer step per iteration
      ours:  TrainActor.train() -- bf16 compute, fp32 master weights and gradient sums,
             GRPO loss through the fused chunked LM-head log-prob function, grad-norm clip, fused AdamW;
             timed part = the optimizer step (`perf/actor_train_time`: micro-batch build, fwd, bwd, clip,
             AdamW); the log-prob pass that an RL step runs first is reported separately
      hf:    AutoModelForCausalLM in pure bf16 (model.to(bf16)), sdpa, loss = cross-entropy on all tokens
             (`labels=`), fused AdamW on the bf16 parameters
  (b) variable lengths, uniform in 64..4096 (fixed seed, ~25k tokens), one optimizer step per iteration
      ours:  the same TrainActor, micro-batches packed by `--max-tokens-per-gpu` (varlen attention, no pad)
      hf:    the same sequences right-padded to the longest, micro-batched to the same token budget
             (rows = budget // longest), gradient accumulation, one AdamW step
      tokens/s counts real (non-pad) tokens on both sides.

MFU = model FLOPs / time / 738 TFLOP/s (the H200's measured dense bf16 peak), with
  FLOPs = 6 * (N_nonembed + V * D) * tokens  +  6 * L * (H * d_head) * sum_i S_i^2
i.e. 6 FLOPs per parameter per token for forward + backward (the LM head counted as a V x D matmul, the
embedding lookup free) plus causal attention (QK^T and PV: 2 * S^2 * H * d_head forward per layer, x3 for
fwd + bwd). Only useful work counts: padding and recomputation (our LM-head backward, activation
checkpointing) are not FLOPs of the model.

Run (H200, from the repository root, < 8 min with both paths; prints a summary table, writes JSON):
    PYTHONPATH=. python bench/train_throughput.py --json-out $OUT/train.json
Run (CPU smoke test, here; --shape tiny uses 4 x 256 and lengths 8..512, both sides in fp32 on CPU):
    .venv/bin/python bench/train_throughput.py --device cpu --shape tiny --steps 2 --warmup 1
Options: --shape 1.5b|0.5b|tiny, --path fast|fsdp|both, --steps N (timed), --warmup N, --skip-hf, --profile
(torch.profiler table of one step of ours (a), per path), --gradient-checkpointing, --max-tokens-per-gpu N
(default 8192). JSON keys: fast_fixed, fast_varlen, fsdp_fixed, fsdp_varlen, hf_fixed, hf_varlen and the
ratios ratio_<path>_<phase> (ours / hf; goals 1.2x fixed, 2.5x varlen) and ratio_fast_over_fsdp_<phase>.

LM head alone (--lm-head-only, < 1 min on the H200): forward and forward + backward of
clawrl.trainer.logprobs.linear_log_probs at --lm-head-tokens x hidden x vocab (default 8192 x 1536 x 151936),
bf16, on the PyTorch path and (CUDA) the Triton path, for the log-prob-only pass (no grad), a loss on the
log-probs with the entropy detached (--entropy-coef 0, the default) and one with an entropy gradient; plus the
max difference between the two paths and the GEMM-only ideal (4 GEMMs of 2 M D V FLOPs at the peak):
    PYTHONPATH=. python bench/train_throughput.py --lm-head-only --json-out $OUT/lm_head.json

Imports only clawrl.{trainer,models,algo,config,data} (+ torch, safetensors; transformers in the hf phases):
the GPU image has no ray/fastapi/uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

PEAK_TFLOPS = 738.0
SHAPES = {
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                 vocab_size=151936),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                 vocab_size=151936),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512),
}  # fmt: skip
FIXED_BATCH = (4, 2048)
VARLEN_RANGE = (64, 4096)
VARLEN_COUNT = 12
# --shape tiny is a CPU smoke test: 8x shorter sequences keep it to about a minute on 2 cores.
TINY_FIXED_BATCH, TINY_VARLEN_RANGE = (4, 256), (8, 512)


# ---------------------------------------------------------------------------------------------- model
def write_checkpoint(shape: dict, out: Path, device: torch.device, seed: int = 0) -> Path:
    """config.json (the classic Qwen2.5 layout every transformers version reads) + bf16 safetensors."""
    from safetensors.torch import save_file

    d, ff, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_kv_heads"] * d // shape["num_heads"]
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": d, "intermediate_size": ff, "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"],
        "vocab_size": v, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "use_sliding_window": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size):
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {
        "model.embed_tokens.weight": normal(v, d),
        "model.norm.weight": torch.ones(d, dtype=torch.bfloat16),
    }
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": normal(d, d), p + "self_attn.q_proj.bias": normal(d),
            p + "self_attn.k_proj.weight": normal(kv, d), p + "self_attn.k_proj.bias": normal(kv),
            p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.v_proj.bias": normal(kv),
            p + "self_attn.o_proj.weight": normal(d, d),
            p + "mlp.gate_proj.weight": normal(ff, d), p + "mlp.up_proj.weight": normal(ff, d),
            p + "mlp.down_proj.weight": normal(d, ff),
        })  # fmt: skip
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def model_flops(shape: dict, lengths: list[int]) -> float:
    """Training FLOPs of one pass over sequences of `lengths` (module docstring formula)."""
    d, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    kv = shape["num_kv_heads"] * d // shape["num_heads"]
    per_layer = d * d * 2 + 2 * kv * d + 3 * d * ff  # q, o, k, v, gate, up, down (biases/norms negligible)
    params = layers * per_layer + shape["vocab_size"] * d
    return 6.0 * params * sum(lengths) + 6.0 * layers * d * sum(s * s for s in lengths)


def varlen_lengths(seed: int, length_range: tuple[int, int]) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*length_range) for _ in range(VARLEN_COUNT)]


def random_tokens(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------------ ours
def build_actor(model_dir: Path, device: torch.device, args, path: str = "fast"):
    from clawrl.config.algo import AlgoConfig
    from clawrl.config.job import JobConfig
    from clawrl.config.model import ModelConfig
    from clawrl.config.rollout import RolloutConfig
    from clawrl.config.train import TrainConfig
    from clawrl.trainer.actor import TrainActor

    job = JobConfig(
        model=ModelConfig(hf_checkpoint=str(model_dir), gradient_checkpointing=args.gradient_checkpointing),
        rollout=RolloutConfig(rollout_batch_size=1, rollout_max_response_len=VARLEN_RANGE[1]),
        train=TrainConfig(
            lr=1e-6,
            use_dynamic_batch_size=True,
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            train_kernels=args.train_kernels,
            fast_single_rank=path == "fast",
        ),
        algo=AlgoConfig(),  # GRPO, no KL term: no reference weights
    )
    actor = TrainActor(job, device=str(device))
    actor.init(total_optimizer_steps=1000)
    return actor


def train_batch(tokens: list[list[int]], rollout_id: int = 0):
    """Every token but the first is a response token: the loss covers the same positions as the HF loss."""
    from clawrl.data.train_batch import TrainBatch

    responses = [len(t) - 1 for t in tokens]
    rewards = [1.0 if i % 2 else -1.0 for i in range(len(tokens))]
    return TrainBatch(rollout_id=rollout_id, tokens=tokens, response_lengths=responses,
                      loss_masks=[[1] * r for r in responses], rewards=rewards, raw_rewards=rewards)  # fmt: skip


def run_ours(actor, tokens: list[list[int]], args) -> dict:
    batch = train_batch(tokens)
    step_times, logprob_times, whole = [], [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        metrics = actor.train(batch)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            step_times.append(metrics["perf/actor_train_time"])
            logprob_times.append(metrics["perf/log_probs_time"])
            whole.append(elapsed)
    step, logprob, total = (statistics.median(x) for x in (step_times, logprob_times, whole))
    num_tokens = sum(len(t) for t in tokens)
    return {
        "step_time_s": step, "tokens_per_s": num_tokens / step, "log_probs_time_s": logprob,
        "train_call_time_s": total, "train_call_tokens_per_s": num_tokens / total,
        "loss": metrics["train"][-1]["train/loss"], "num_micro_batches": _num_micro_batches(actor, batch),
        **_memory(actor.device),
    }  # fmt: skip


def _num_micro_batches(actor, batch) -> int:
    return sum(step.plan.num_micro_batches for step in actor._plan(batch))


def profile_ours(actor, tokens: list[list[int]]) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if actor.device.type == "cuda" else [])
    batch = train_batch(tokens)
    with profile(activities=activities) as prof:
        actor.train(batch)
    averages = prof.key_averages()
    # By self CPU time too: a step whose wall time exceeds its CUDA time is bound by the host (hooks, launches).
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    keys = ("self_device_time_total", "self_cuda_time_total") if actor.device.type == "cuda" else ()
    for key in keys:  # the CUDA column's name changed across torch releases
        try:
            tables.insert(0, averages.table(sort_by=key, row_limit=45))
            break
        except (KeyError, AttributeError, ValueError):
            continue
    return "\n".join(tables)


# -------------------------------------------------------------------------------------------- lm head
LM_HEAD_MODES = ("logp_only_no_grad", "logp_grad_entropy_detached", "logp_and_entropy_grad")


def lm_head_inputs(shape: dict, num_tokens: int, device: torch.device, seed: int):
    """Final-norm-like hidden states [M, D] (unit scale), an LM head [V, D] at the checkpoint's 0.02 scale."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    d, v = shape["hidden_size"], shape["vocab_size"]
    hidden = torch.randn(num_tokens, d, generator=gen, device=device).to(dtype)
    weight = (torch.randn(v, d, generator=gen, device=device) * 0.02).to(dtype)
    targets = torch.randint(0, v, (num_tokens,), generator=gen, device=device)
    return hidden, weight, targets


def lm_head_step(hidden, weight, targets, mode: str):
    """One call of the fused LM-head function as the trainer makes it; returns (logp, entropy, grads)."""
    from clawrl.trainer.logprobs import linear_log_probs

    if mode == "logp_only_no_grad":  # compute_log_probs: the pass before the optimizer steps
        with torch.no_grad():
            logp, ent = linear_log_probs(hidden, weight, targets, temperature=0.7)
        return logp, ent, ()
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logp, ent = linear_log_probs(h, w, targets, temperature=0.7, with_entropy=True)
    entropy_term = ent if mode == "logp_and_entropy_grad" else ent.detach()
    (logp.mean() - 0.01 * entropy_term.mean()).backward()
    return logp.detach(), ent.detach(), (h.grad, w.grad)


def run_lm_head(shape: dict, device: torch.device, args, results: dict) -> None:
    """--lm-head-only: results["lm_head"] gets the median ms and peak memory of each mode on each path (filled
    as it goes, so the PyTorch numbers survive a Triton failure) and the paths' max differences."""
    from clawrl.trainer import logprobs

    hidden, weight, targets = lm_head_inputs(shape, args.lm_head_tokens, device, args.seed)
    out = results["lm_head"] = {
        "tokens": args.lm_head_tokens,
        "ideal_gemm_ms": _lm_head_ideal_ms(hidden, weight),
    }
    last: dict = {}
    for path in ("never", "auto") if device.type == "cuda" else ("never",):
        logprobs.TRITON_PATH = path
        name = "triton" if path == "auto" else "torch"
        for mode in LM_HEAD_MODES:
            times = []
            for i in range(args.warmup + args.steps):
                last[f"{name}/{mode}"] = None  # free the previous call's gradients before timing the next
                _sync(device)
                start = time.perf_counter()
                last[f"{name}/{mode}"] = lm_head_step(hidden, weight, targets, mode)
                _sync(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            out[f"{name}/{mode}"] = {"ms": 1e3 * statistics.median(times), **_memory(device)}
    logprobs.TRITON_PATH = "auto"
    if device.type == "cuda":
        out["max_abs_diff"] = _lm_head_diffs(last)


def _lm_head_ideal_ms(hidden, weight) -> float:
    """4 GEMMs (forward logits; backward: recomputed logits, d hidden, d W) of 2 M D V FLOPs at the peak."""
    return 4 * 2.0 * hidden.shape[0] * hidden.shape[1] * weight.shape[0] / (PEAK_TFLOPS * 1e12) * 1e3


def _lm_head_diffs(results: dict) -> dict:
    """Max |triton - torch| of logp, entropy, d hidden, d W (relative to max |torch| for the gradients)."""
    diffs = {}
    for mode in LM_HEAD_MODES:
        (t_logp, t_ent, t_grads), (r_logp, r_ent, r_grads) = (
            results[f"triton/{mode}"],
            results[f"torch/{mode}"],
        )
        diffs[mode] = {
            "logp": (t_logp - r_logp).abs().max().item(),
            "entropy": (t_ent - r_ent).abs().max().item(),
        }
        names = ("grad_hidden_rel", "grad_weight_rel") if t_grads else ()  # no gradients without autograd
        for name, a, b in zip(names, t_grads, r_grads, strict=True):
            diffs[mode][name] = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    return diffs


def _print_lm_head(r: dict) -> None:
    print(
        f"\n=== LM head alone: {r['tokens']} tokens; GEMM-only ideal fwd+bwd {r['ideal_gemm_ms']:.1f} ms ==="
    )
    for key, value in r.items():
        if isinstance(value, dict) and "ms" in value:
            print(
                f"{key:42s} {value['ms']:8.2f} ms  peak {value.get('peak_memory_gib', float('nan')):6.2f} GiB"
            )
    for mode, diff in r.get("max_abs_diff", {}).items():
        print(f"max |triton - torch| {mode}: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))


# ------------------------------------------------------------------------------------------------- hf
def build_hf(model_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmuls crawl on CPU
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=device.type == "cuda")
    return model, optimizer


def padded_micro_batches(tokens: list[list[int]], budget: int, device: torch.device):
    """Right-pad every sequence to the longest; rows per micro-batch = budget // longest (at least 1)."""
    longest = max(len(t) for t in tokens)
    rows = max(1, budget // longest)
    ids = torch.zeros(len(tokens), longest, dtype=torch.long)
    mask = torch.zeros(len(tokens), longest, dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return [
        (ids[s : s + rows].to(device), mask[s : s + rows].to(device), labels[s : s + rows].to(device))
        for s in range(0, len(tokens), rows)
    ]


def run_hf(model, optimizer, micro_batches, num_real_tokens: int, args, device) -> dict:
    times = []
    # HF's loss is a mean over each micro-batch's label tokens: reweight to the step's token mean
    # (computed once here: reading counts back from the GPU inside the timed loop would sync it).
    counts = [int((labels[:, 1:] != -100).sum()) for _, _, labels in micro_batches]
    weights = [c / sum(counts) for c in counts]
    for i in range(args.warmup + args.steps):
        _sync(device)
        start = time.perf_counter()
        for (ids, mask, labels), weight in zip(micro_batches, weights, strict=True):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            (out.loss * weight).backward()
            del out
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    padded = sum(ids.numel() for ids, _, _ in micro_batches)
    return {"step_time_s": step, "tokens_per_s": num_real_tokens / step, "padded_tokens": padded,
            "num_micro_batches": len(micro_batches), **_memory(device)}  # fmt: skip


# ----------------------------------------------------------------------------------------------- main
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gib": round(peak, 2)}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@contextlib.contextmanager
def phase(name: str, results: dict, device: torch.device):
    """Run one phase; a failure prints a clear message and the traceback, and the benchmark goes on."""
    print(f"\n=== {name} ===", flush=True)
    start = time.perf_counter()
    try:
        yield
        print(f"--- {name}: done in {time.perf_counter() - start:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001 -- one phase's failure must not hide the others' numbers
        results.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        print(
            f"!!! {name} FAILED after {time.perf_counter() - start:.1f} s: {type(e).__name__}: {e}",
            flush=True,
        )
        traceback.print_exc()
    finally:
        _free(device)


def add_mfu(result: dict, flops: float) -> None:
    result["model_tflops_per_step"] = flops / 1e12
    result["achieved_tflops"] = flops / result["step_time_s"] / 1e12
    result["mfu"] = result["achieved_tflops"] / PEAK_TFLOPS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per phase (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, cuBLAS heuristics)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192, help="token budget of one micro-batch")
    p.add_argument("--gradient-checkpointing", action="store_true", help="ours: recompute block activations")
    p.add_argument(
        "--train-kernels",
        choices=("triton", "torch"),
        default="triton",
        help="ours: fused Triton RMSNorm/SiLU/RoPE, or torch (eager ops); clawrl train's flag",
    )
    p.add_argument(
        "--path",
        choices=("fast", "fsdp", "both"),
        default="both",
        help="ours: the world-size-1 fast path (no FSDP2), 1-rank FSDP2 (--no-fast-single-rank), or both",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of one step of ours (a)"
    )
    p.add_argument(
        "--lm-head-only", action="store_true", help="time only the fused LM-head log-prob function"
    )
    p.add_argument("--lm-head-tokens", type=int, default=8192, help="rows M of the --lm-head-only benchmark")
    p.add_argument("--json-out", help="write all results to this JSON file")
    p.add_argument("--model-dir", help="reuse a checkpoint written by an earlier run (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    (rows, length), length_range = FIXED_BATCH, VARLEN_RANGE
    if args.shape == "tiny":
        (rows, length), length_range = TINY_FIXED_BATCH, TINY_VARLEN_RANGE
    fixed = random_tokens([length] * rows, shape["vocab_size"], args.seed)
    lengths = varlen_lengths(args.seed, length_range)
    varlen = random_tokens(lengths, shape["vocab_size"], args.seed + 1)
    results: dict = {"shape": args.shape, **shape, "device": str(device), "torch": torch.__version__,
                     "steps": args.steps, "warmup": args.warmup, "max_tokens_per_gpu": args.max_tokens_per_gpu,
                     "fixed_batch": [rows, length], "varlen_lengths": lengths,
                     "peak_tflops": PEAK_TFLOPS}  # fmt: skip
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    print(
        f"shape {args.shape} {shape}; device {device}; varlen batch {len(lengths)} seqs, {sum(lengths)} tokens"
    )
    if args.lm_head_only:
        with phase("LM head alone", results, device):
            run_lm_head(shape, device, args, results)
            _print_lm_head(results["lm_head"])
        return _finish(results, args)
    with tempfile.TemporaryDirectory(prefix="clawrl-bench-") as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "model"
        with phase("write checkpoint", results, device):
            if not (model_dir / "model.safetensors").is_file():
                write_checkpoint(shape, model_dir, device, seed=args.seed)
        for path in ("fast", "fsdp") if args.path == "both" else (args.path,):
            _run_ours(model_dir, device, args, shape, fixed, varlen, results, path)
        if not args.skip_hf:
            _run_hf(model_dir, device, args, shape, fixed, varlen, results)
    _summarise(results)
    return _finish(results, args)


def _finish(results: dict, args) -> int:
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json_out}")
    return 1 if results.get("errors") else 0


def _run_ours(model_dir, device, args, shape, fixed, varlen, results, path: str) -> None:
    """One of ours' paths ("fast" or "fsdp"): results[f"{path}_fixed"] and results[f"{path}_varlen"]."""
    actor = None
    with phase(f"ours {path}: build TrainActor", results, device):
        start = time.perf_counter()
        actor = build_actor(model_dir, device, args, path)
        results[f"{path}_init_s"] = time.perf_counter() - start
    if actor is None:
        return
    try:
        with phase(f"ours {path} (a) fixed batch", results, device):
            results[f"{path}_fixed"] = run_ours(actor, fixed, args)
            add_mfu(results[f"{path}_fixed"], model_flops(shape, [len(t) for t in fixed]))
        with phase(f"ours {path} (b) varlen packed", results, device):
            results[f"{path}_varlen"] = run_ours(actor, varlen, args)
            add_mfu(results[f"{path}_varlen"], model_flops(shape, [len(t) for t in varlen]))
        if args.profile:
            with phase(f"ours {path} (a) profile", results, device):
                print(profile_ours(actor, fixed))
    finally:
        with phase(f"ours {path}: shutdown", results, device):
            actor.shutdown()
            del actor


def _run_hf(model_dir, device, args, shape, fixed, varlen, results) -> None:
    model = optimizer = None
    with phase("hf: load transformers model", results, device):
        model, optimizer = build_hf(model_dir, device)
    if model is None:
        return
    with phase("hf (a) fixed batch", results, device):
        ids = torch.tensor(fixed, device=device)
        batches = [(ids, None, ids)]  # no padding: no mask, so sdpa runs its causal flash kernel
        results["hf_fixed"] = run_hf(model, optimizer, batches, ids.numel(), args, device)
        add_mfu(results["hf_fixed"], model_flops(shape, [len(t) for t in fixed]))
    with phase("hf (b) varlen padded", results, device):
        batches = padded_micro_batches(varlen, args.max_tokens_per_gpu, device)
        results["hf_varlen"] = run_hf(model, optimizer, batches, sum(len(t) for t in varlen), args, device)
        add_mfu(results["hf_varlen"], model_flops(shape, [len(t) for t in varlen]))
    del model, optimizer


SUMMARY_ROWS = (
    ("fast_fixed", "ours fast (a) fixed fwd+bwd+AdamW"), ("fsdp_fixed", "ours fsdp (a) fixed"),
    ("hf_fixed", "hf (a) fixed"), ("fast_varlen", "ours fast (b) varlen packed"),
    ("fsdp_varlen", "ours fsdp (b) varlen packed"), ("hf_varlen", "hf (b) varlen padded"),
)  # fmt: skip
GOALS = {"fixed": 1.2, "varlen": 2.5}
"""issue 17's goals for ours / transformers at 1.5B: (a) fixed 4 x 2048, (b) RL-length batches."""
WHOLE_TRAIN_GOAL = 35_000
"""issue 17's goal for the whole RL train() call (with its no-grad log-prob pass), tokens/s."""


def _summarise(results: dict) -> None:
    print(f"\n=== summary (tokens/s of real tokens; MFU vs {PEAK_TFLOPS:.0f} TFLOP/s) ===")
    print(f"{'phase':34s} {'tok/s':>10s} {'step s':>8s} {'MFU':>7s} {'mbs':>4s} {'peak GiB':>9s}")
    for key, label in SUMMARY_ROWS:
        r = results.get(key)
        if r is None:
            print(f"{label:34s} {'--':>10s}")
            continue
        print(f"{label:34s} {r['tokens_per_s']:10.0f} {r['step_time_s']:8.3f} {r['mfu']:7.1%} "
              f"{r['num_micro_batches']:4d} {r.get('peak_memory_gib', float('nan')):9.1f}")  # fmt: skip
    for path in ("fast", "fsdp"):
        for phase_name, label in (("fixed", "(a)"), ("varlen", "(b)")):
            r = results.get(f"{path}_{phase_name}")
            if r is not None:
                print(f"ours {path} {label} whole RL train() incl. log-prob pass: {r['train_call_tokens_per_s']:.0f} "
                      f"tok/s (goal >= {WHOLE_TRAIN_GOAL}; log-prob pass {r['log_probs_time_s']:.3f} s)")  # fmt: skip
    _ratios(results)
    if "hf_fixed" in results:
        print("issue author's baseline for hf (a): 37.7k tok/s")
    for name, error in results.get("errors", {}).items():
        print(f"FAILED {name}: {error}")


def _ratios(results: dict) -> None:
    """ratio_<path>_<phase> = ours / hf, and ratio_fast_over_fsdp_<phase>, printed and stored."""
    for phase_name, label in (("fixed", "(a)"), ("varlen", "(b)")):
        hf = results.get(f"hf_{phase_name}")
        for path in ("fast", "fsdp"):
            ours = results.get(f"{path}_{phase_name}")
            if ours is not None and hf is not None:
                ratio = results[f"ratio_{path}_{phase_name}"] = ours["tokens_per_s"] / hf["tokens_per_s"]
                print(
                    f"ratio ours {path}/hf {label} {phase_name}: {ratio:.2f}x (goal >= {GOALS[phase_name]:.1f}x)"
                )
        fast, fsdp = results.get(f"fast_{phase_name}"), results.get(f"fsdp_{phase_name}")
        if fast is not None and fsdp is not None:
            ratio = results[f"ratio_fast_over_fsdp_{phase_name}"] = (
                fast["tokens_per_s"] / fsdp["tokens_per_s"]
            )
            print(f"ratio fast/fsdp {label} {phase_name}: {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
