"""The batch-invariant linear of --true-on-policy-mode against cuBLAS, per tile config, on a model's matmuls.

For each launch config of clawrl.models.batch_invariant's linear kernel (BLOCK_M x BLOCK_N x BLOCK_K, warps,
stages) and for cuBLAS (torch.nn.functional.linear), times the matmuls one decode step (or one trainer
micro-batch) of the model runs: qkv_proj, o_proj, gate_up_proj, down_proj per layer and the LM head, at the
given row counts, each layer with its own weights and each chain replayed as a CUDA graph (as the engine's
decode runs). Printed: ms of each matmul over all layers, ms of the whole forward's matmuls in layer order,
and the ratio to cuBLAS. Each config is also checked for what --true-on-policy-mode relies on: a row's bits
do not depend on the row count, the packed qkv weight's columns give the bits of the separate q/k/v
weights, and the config gives the bits of the first row (linear_forward's own choice by shape). The last
must hold since a decode batch and a trainer micro-batch take different tiles (linear_tiles) and a decode
batch's down_proj spreads its K chunks over programs (linear_splits); "linear_tiles, no split-K" times the
same tiles with every chunk summed in one program.

Run from the repository root on a GPU (about a minute):
    PYTHONPATH=. python bench/batch_invariant_linear.py --shape 0.5b --rows 256 8192
    PYTHONPATH=. python bench/batch_invariant_linear.py --shape 1.5b --rows 128 8192 --json-out /tmp/bil.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CONFIGS = (  # the first is the old single config; LINEAR_TILES_DECODE and _LARGE are among them
    (64, 64, 64, 4, 3),
    (64, 64, 64, 4, 4),
    (64, 32, 64, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 64, 64, 8, 3),
    (64, 128, 64, 4, 3),
    (128, 64, 64, 4, 3),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 128, 128, 4, 3),
    (128, 128, 128, 8, 2),
)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages


def model_shapes(shape: str) -> tuple[dict[str, tuple[int, int]], int]:
    """{matmul: (K, N)} of one decoder layer plus the head, and the layer count, for a bench shape."""
    spec = importlib.util.spec_from_file_location("engine_throughput", HERE / "engine_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_throughput"] = module
    spec.loader.exec_module(module)
    cfg = module.SHAPES[shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_heads"]
    q, kv = cfg["num_heads"] * head_dim, cfg["num_kv_heads"] * head_dim
    mats = {
        "qkv_proj": (hidden, q + 2 * kv),
        "o_proj": (q, hidden),
        "gate_up_proj": (hidden, 2 * inter),
        "down_proj": (inter, hidden),
        "lm_head": (hidden, cfg["vocab_size"]),
    }
    return mats, cfg["num_layers"]


def graph_ms(calls, reps: int = 20) -> float:
    """ms per replay of a CUDA graph of `calls` (callables, run in order): the engine's decode runs its
    forward as a graph, so this leaves out launch overhead the way the engine does."""
    for call in calls:  # compile / warm outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", choices=("0.5b", "1.5b", "tiny"))
    p.add_argument("--rows", type=int, nargs="+", default=[256, 8192])
    p.add_argument(
        "--quick", action="store_true", help="cuBLAS, linear_forward's own choice and the old config only"
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/batch_invariant_linear.py needs a CUDA device")
    from clawrl.models import batch_invariant as bi

    mats, num_layers = model_shapes(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # every layer its own weights (one forward reads each once, as in the engine); the head once
    weights = {
        n: [(torch.randn(nn, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
            for _ in range(1 if n == "lm_head" else num_layers)]
        for n, (k, nn) in mats.items()
    }  # fmt: skip
    bias = (torch.randn(mats["qkv_proj"][1], generator=gen, device="cuda") * 0.1).bfloat16()
    configs = [bi.LinearTiles(*c) for c in (CONFIGS[:1] if args.quick else CONFIGS)]
    result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(), "rows": {}}
    for rows in args.rows:
        xs = {n: torch.randn(rows, k, generator=gen, device="cuda").bfloat16() for n, (k, _) in mats.items()}
        table: dict[str, dict] = {}

        def timed(matmul, xs=xs) -> tuple[dict[str, float], float]:
            """(ms of each matmul's chain over the layers, ms of the whole forward's matmuls in layer order)"""
            per = {n: graph_ms([lambda n=n, w=w: matmul(xs[n], w) for w in weights[n]]) for n in mats}
            order = [(n, weights[n][layer]) for layer in range(num_layers) for n in mats if n != "lm_head"]
            order.append(("lm_head", weights["lm_head"][0]))
            return per, graph_ms([lambda n=n, w=w: matmul(xs[n], w) for n, w in order])

        cublas, cublas_total = timed(lambda x, w: torch.nn.functional.linear(x, w))
        table["cublas"] = {"ms": cublas, "step_ms": cublas_total}
        reference = None
        # None: linear_forward's own choices by shape (linear_tiles, linear_splits); split None: by shape
        variants = [("linear_tiles (used)", None, None), ("linear_tiles, no split-K", None, False)]
        variants += [("x".join(map(str, t[:3])) + f" w{t.warps} s{t.stages}", t, None) for t in configs]
        for name, tiles, split in variants:
            try:
                times, total = timed(lambda x, w, t=tiles, s=split: bi.linear_forward(x, w, None, t, split=s))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is reported
                table[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                continue
            x, w = xs["qkv_proj"], weights["qkv_proj"][0]
            full = bi.linear_forward(x, w, bias, tiles, split=split)
            rows_ok = all(
                torch.equal(bi.linear_forward(x[:r], w, bias, tiles, split=split), full[:r])
                for r in (1, 3, 17, min(rows, 129))
            )
            q_size = mats["o_proj"][0]
            cols_ok = all(
                torch.equal(bi.linear_forward(x, w[c], bias[c], tiles, split=split), full[:, c])
                for c in (slice(0, q_size), slice(q_size, w.shape[0]), slice(100, q_size + 7))
            )
            # and the down_proj (long K: chunked, split over programs at small row counts)
            down = bi.linear_forward(xs["down_proj"], weights["down_proj"][0], None, tiles, split=split)
            rows_ok = rows_ok and all(
                torch.equal(
                    bi.linear_forward(xs["down_proj"][:r], weights["down_proj"][0], None, tiles, split=split),
                    down[:r],
                )
                for r in (1, 17, min(rows, 129))
            )
            same_bits = reference is None or (
                torch.equal(full, reference[0]) and torch.equal(down, reference[1])
            )
            reference = (full, down) if reference is None else reference
            table[name] = {
                "ms": times, "step_ms": total, "vs_cublas": total / cublas_total,
                "rows_invariant": rows_ok, "packed_columns_invariant": cols_ok, "bits_equal_first_config": same_bits,
            }  # fmt: skip
        result["rows"][rows] = table
        print(
            f"\n### {args.shape}, {rows} rows ({num_layers} layers): ms per forward, by matmul (all layers)"
        )
        print(
            "| config | "
            + " | ".join(mats)
            + " | forward ms | / cuBLAS | rows inv. | packed cols inv. | = first |"
        )
        print("|---" * (len(mats) + 6) + "|")
        for name, row in table.items():
            if "error" in row:
                print(f"| {name} | {row['error']} |")
                continue
            cells = " | ".join(f"{row['ms'][n]:.4f}" for n in mats)
            extra = (
                f" | {row['vs_cublas']:.2f}x | {row['rows_invariant']} | {row['packed_columns_invariant']} | "
                f"{row['bits_equal_first_config']}"
                if name != "cublas"
                else " | 1.00x | | |"
            )
            print(f"| {name} | {cells} | {row['step_ms']:.3f}{extra} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
