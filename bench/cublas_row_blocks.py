"""--true-on-policy-mode's matmuls on cuBLAS: the set-up check's verdicts and what they buy, per model shape.

For each group of a Qwen2.5-shaped model's matmuls (qkv with bias, o, gate_up, down, the LM head), runs
clawrl.models.cublas_rows.group_kernel (the set-up check) on this GPU in bf16 (timed: it runs at every engine
and trainer start in the mode), then times at each row count, inside CUDA graphs as the engine's decode runs
them:
    default   F.linear (what the default mode's engine runs),
    cublas    cublas_rows.cublas_linear_forward (rows padded to 64, blocks of block_rows),
    triton    the batch-invariant Triton linear (the mode's kernel for a group that fails the check).
Printed: ms per call, and per forward (each layer's groups x layers + the LM head) with the ratios.

Run from the repository root on a GPU (about a minute):
    PYTHONPATH=. python bench/cublas_row_blocks.py --shape 0.5b --rows 64 256 8192 --json-out /tmp/crb.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from clawrl.models import batch_invariant as bi
from clawrl.models import cublas_rows as cr

SHAPES = {  # hidden, heads, kv heads, intermediate, layers (head_dim 128), vocab 151936
    "0.5b": (896, 14, 2, 4864, 24),
    "1.5b": (1536, 12, 2, 8960, 28),
}
VOCAB = 151936


def groups_of(shape: str) -> dict[str, tuple[cr.LinearGroup, int]]:
    """Group name -> (group, how many a forward runs)."""
    hidden, heads, kv_heads, inter, layers = SHAPES[shape]
    head_dim = hidden // heads
    return {
        "qkv": (
            cr.LinearGroup(hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), True),
            layers,
        ),
        "o": (cr.LinearGroup(heads * head_dim, (hidden,), False), layers),
        "gate_up": (cr.LinearGroup(hidden, (inter, inter), False), layers),
        "down": (cr.LinearGroup(inter, (hidden,), False), layers),
        "lm_head": (cr.LinearGroup(hidden, (VOCAB,), False), 1),
    }


def graph_ms(fn, reps: int) -> float:
    """ms per call of `fn`, `reps` calls captured in one CUDA graph, median of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    torch.cuda.empty_cache()
    return sorted(times)[2]


def time_kinds(x, weight, bias, block: int, reps: int) -> dict[str, float]:
    """ms per call of the default, the checked-cuBLAS and the Triton product of x and weight."""
    ms = {
        "default": graph_ms(lambda: F.linear(x, weight, bias), reps),
        "cublas": graph_ms(lambda: cr.cublas_linear_forward(x, weight, bias, block), reps),
        "triton": graph_ms(lambda: bi.linear_forward(x, weight, bias), reps),
    }
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 8192], help="row counts to time")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "groups": {},
    }
    generator = torch.Generator(device=device).manual_seed(0)
    per_forward = {rows: {"default": 0.0, "cublas": 0.0, "triton": 0.0, "mode": 0.0} for rows in args.rows}
    for name, (group, count) in groups_of(args.shape).items():
        start = time.perf_counter()
        kernel = cr.group_kernel(group, torch.bfloat16, device)
        check_s = time.perf_counter() - start
        cols = sum(group.widths)
        block = cr.block_rows(cols)
        weight = (
            torch.randn(cols, group.k_dim, generator=generator, device=device)
            .div(group.k_dim**0.5)
            .bfloat16()
        )
        bias = torch.randn(cols, generator=generator, device=device).bfloat16() if group.has_bias else None
        entry = {"group": group._asdict(), "kernel": kernel, "check_s": round(check_s, 3),
                 "block_rows": block, "ms": {}}  # fmt: skip
        for rows in args.rows:
            x = torch.randn(rows, group.k_dim, generator=generator, device=device).bfloat16()
            reps = max(2, min(50, int(2e11 // (rows * cols * group.k_dim * 2) or 1)))
            ms = time_kinds(x, weight, bias, block, reps)
            ms["mode"] = ms[kernel]
            entry["ms"][rows] = {k: round(v, 4) for k, v in ms.items()}
            for k in per_forward[rows]:
                per_forward[rows][k] += ms[k] * count
            del x
        result["groups"][name] = entry
        print(f"{name:8s} {str(group):60s} kernel {kernel} (check {check_s:.2f} s), "
              f"blocks of {block}: " + ", ".join(
                  f"{rows} rows " + " / ".join(f"{k} {v:.4f}" for k, v in m.items()) + " ms"
                  for rows, m in entry["ms"].items()))  # fmt: skip
    result["per_forward_ms"] = {
        rows: {**{k: round(v, 4) for k, v in t.items()}, "mode_over_default": round(t["mode"] / t["default"], 3),
               "triton_over_default": round(t["triton"] / t["default"], 3)}
        for rows, t in per_forward.items()
    }  # fmt: skip
    for rows, t in result["per_forward_ms"].items():
        print(
            f"forward's matmuls at {rows} rows: default {t['default']:.3f} ms, the mode now {t['mode']:.3f} ms "
            f"({t['mode_over_default']:.2f}x), Triton everywhere {t['triton']:.3f} ms ({t['triton_over_default']:.2f}x)"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
