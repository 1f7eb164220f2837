"""Where one decode step of the engine goes on the GPU: a torch.profiler trace of steady decode, summarised.

The real engine (random-weight checkpoint of bench/engine_throughput.py's shapes, CUDA graphs, overlap
schedule) decodes a full batch; after the batch is admitted and warm, `--steps` engine steps are profiled.
Printed: wall ms per step, the GPU's busy ms per step (the union of kernel intervals on the device), i.e.
how much of the step the GPU idles waiting for the host, and the kernels ranked by device time per step,
grouped into families (matmuls, attention, norms / RoPE / activations, sampling, copies). With the decode
roofline (weights + KV read once per step at the measured 4.19 TB/s copy rate) this says which lever a step
is bound by: host time (busy < wall), a kernel family far above its bytes / bandwidth, or neither.

Run from the repository root on a GPU (about a minute):
    PYTHONPATH=. python bench/engine_decode_profile.py --shape 0.5b --batch 256
    PYTHONPATH=. python bench/engine_decode_profile.py --shape 1.5b --batch 128 --json-out /tmp/p.json
    PYTHONPATH=. python bench/engine_decode_profile.py --shape 0.5b --batch 256 --true-on-policy   # the mode's kernels
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
COPY_BW = 4.19e12  # bytes/s: the H200's measured device-to-device copy rate (docs/benchmarks.md)

FAMILIES = (
    ("attention", ("decode_kernel", "attention", "attn", "prefill_kernel")),
    ("sampling", ("sample", "gumbel", "argmax", "softmax", "topk", "top_k", "top_p", "logprob", "log_prob", "hash")),
    # linear: the batch-invariant matmul of --true-on-policy
    ("matmul", ("gemm", "gemv", "matmul", "cutlass", "sm90", "nvjet", "cublas", "xmma", "ampere", "hopper", "linear")),
    ("norm/rope/act", ("rms", "norm", "rotary", "rope", "silu", "act_and_mul", "fused")),
    ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat", "index", "gather", "scatter", "where")),
)  # fmt: skip


def family(name: str) -> str:
    """The family a kernel name belongs to (first match in FAMILIES order; "other" otherwise)."""
    lowered = name.lower()
    for fam, needles in FAMILIES:
        if any(n in lowered for n in needles):
            return fam
    return "other"


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (overlapping kernels on several streams count
    once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _engine_bench():
    spec = importlib.util.spec_from_file_location("engine_throughput", HERE / "engine_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_throughput"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", choices=("0.5b", "1.5b", "tiny"))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50, help="profiled engine steps (steady decode)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--workdir", default="/tmp/clawrl-bench-engine")
    p.add_argument(
        "--true-on-policy",
        action="store_true",
        help="the engine in batch-invariant mode (EngineConfig.true_on_policy_mode): its kernels' table",
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    et = _engine_bench()
    from clawrl.engine.core.request import SamplingParams

    ckpt = et.build_checkpoint(
        Path(args.workdir) / f"ckpt-{args.shape}", args.shape, init_std=0.02, device="cuda"
    )
    engine = et.make_engine(
        ckpt,
        argparse.Namespace(device="cuda", mem_fraction_static=0.85, true_on_policy=args.true_on_policy),
        max_running=args.batch,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_args.vocab_size
    prompts = [
        torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)
    ]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=args.steps + 64, temperature=1.0,
                                                           seed=i, ignore_eos=True))  # fmt: skip
    for _ in range(24):  # admit and prefill everything, a few decode steps: steady decode from here
        engine.step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy_us = busy_union(intervals)
    per_kernel: dict[str, float] = defaultdict(float)
    per_family: dict[str, float] = defaultdict(float)
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        per_kernel[e.name] += dur
        per_family[family(e.name)] += dur
    a = engine.model_args
    weight_bytes = sum(
        t.numel() * t.element_size() for t in {id(p): p for p in engine.model.parameters()}.values()
    )
    ctx = args.prompt_len + 24 + args.steps / 2
    kv_bytes = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 2 * ctx * args.batch
    roofline_ms = (weight_bytes + kv_bytes) / COPY_BW * 1e3
    steps = args.steps
    result = {
        "shape": args.shape, "batch": args.batch, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
        "gpu_busy_ms_per_step": busy_us / steps / 1e3, "roofline_ms_per_step": roofline_ms,
        "tok_s": args.batch * steps / wall,
        "families_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(per_family.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]},
    }  # fmt: skip
    print(f"{args.shape} x {args.batch}: {result['wall_ms_per_step']:.3f} ms/step wall "
          f"({result['tok_s']:,.0f} tok/s), GPU busy {result['gpu_busy_ms_per_step']:.3f} ms/step, "
          f"roofline (weights + KV once at 4.19 TB/s) {roofline_ms:.3f} ms/step")  # fmt: skip
    for name, ms in result["families_ms_per_step"].items():
        print(f"  {name:<14} {ms:7.3f} ms/step")
    for name, ms in result["top_kernels_ms_per_step"].items():
        print(f"    {ms:7.3f}  {name[:110]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
