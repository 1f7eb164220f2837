"""--true-on-policy-mode's attention kernel per launch config, beside the default engine's kernels.

The mode's engine and trainer must compute every query row's attention with the same bits, whether the row
is a decode token (one token per program), one of a prefill chunk's tokens or one of the trainer's packed
tokens (programs of several tokens of one sequence). For each launch config of
clawrl.models.batch_invariant's attention kernel (rows of the q tile, warps) on a Qwen-shaped layer this
times, over a paged KV cache with shuffled pages (the engine's layout):
    prefill   B prompts of P tokens each, all new (segment_blocks: ROWS // (Hq / Hkv) tokens a program),
    decode    B sequences at context C, one new token each (token_blocks), replayed in a CUDA graph,
and beside them the default engine's kernels on the same cache (clawrl/engine/runner/triton_attention.py:
paged_prefill_attention, paged_decode_attention with its split of the context). Each config is checked:
    blocks == tokens   the prefill queries computed one token per program give the same bits as in
                       blocks (what a config needs to serve both decode and prefill),
    == mode's bits     the bits of the kernel the mode runs now (ATTENTION_ROWS, 4 warps): configs that
                       match it can be mixed (a decode config and a prefill config) without losing parity,
    max |err|          against fp32 attention.
Printed per config: ms per layer call and per forward (x layers), the ratio to the default kernel.

Run from the repository root on a GPU (under a minute):
    PYTHONPATH=. python bench/batch_invariant_attention.py --shape 0.5b --json-out /tmp/bia.json
    PYTHONPATH=. python bench/batch_invariant_attention.py --shape 1.5b --batch 128
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
from pathlib import Path

import torch

SHAPES = {  # query heads, KV heads, head_dim, layers
    "0.5b": (14, 2, 64, 24),
    "1.5b": (12, 2, 128, 28),
    "qwen3-0.6b": (16, 8, 128, 28),
}
ROWS = (16, 32, 64, 128)
WARPS = (1, 2, 4, 8)
PAGE = 16
HERE = Path(__file__).resolve().parent


def paged_cache(batch: int, context: int, kv_heads: int, head_dim: int, seed: int = 0, device: str = "cuda"):
    """k/v caches [pages, PAGE, Hkv, D] bf16 filled at every used slot, and a block table [B, W] of
    shuffled pages (sequence s's position j at table[s, j // PAGE] * PAGE + j % PAGE)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = math.ceil(context / PAGE)
    pages = batch * width
    k = torch.randn(pages, PAGE, kv_heads, head_dim, device=device, generator=gen).bfloat16()
    v = torch.randn(pages, PAGE, kv_heads, head_dim, device=device, generator=gen).bfloat16()
    table = torch.randperm(pages, device=device, generator=gen).view(batch, width).to(torch.int32)
    return k, v, table


def reference(q, k_cache, v_cache, table, pos, seq, scale) -> torch.Tensor:
    """fp32 attention of each query row over its sequence's keys 0..pos (gathered from the pages)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for s in seq.unique().tolist():
        rows = (seq == s).nonzero()[:, 0]
        n = int(pos[rows].max()) + 1
        j = torch.arange(n, device=q.device)
        slots = table[s, j // PAGE].long() * PAGE + j % PAGE
        keys = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)  # [n, Hq, D]
        vals = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,nhd->htn", q[rows].float(), keys) * scale
        scores = scores.masked_fill(j[None, None, :] > pos[rows][None, :, None], float("-inf"))
        out[rows] = torch.einsum("htn,nhd->thd", scores.softmax(-1), vals)
    return out


def event_ms(fn, reps: int = 20) -> float:
    """Median ms of one eager call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@functools.cache
def _cublas_row_blocks():
    spec = importlib.util.spec_from_file_location("cublas_row_blocks", HERE / "cublas_row_blocks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_ms(fn, reps: int = 20) -> float:
    """ms per call of `fn` replayed in a CUDA graph (the engine's decode): bench/cublas_row_blocks.py's."""
    return _cublas_row_blocks().graph_ms(fn, reps)


def run_shape(shape: str, batch: int, prompt: int, context: int) -> dict:
    from clawrl.engine.runner import triton_attention as ta
    from clawrl.models import batch_invariant as bi
    from clawrl.models.triton_train_ops import sm_count

    heads, kv_heads, head_dim, layers = SHAPES[shape]
    scale = head_dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_cache, v_cache, table = paged_cache(batch, max(prompt, context), kv_heads, head_dim)
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)

    # prefill: every sequence's P prompt tokens, positions 0..P-1
    num_tokens = batch * prompt
    q_pre = torch.randn(num_tokens, heads, head_dim, device="cuda", generator=gen).bfloat16()
    starts = torch.arange(0, num_tokens + 1, prompt, device="cuda")
    seq_pre = torch.arange(batch, device="cuda").repeat_interleave(prompt)
    pos_pre = torch.arange(prompt, device="cuda").repeat(batch)
    # decode: one token per sequence at position C - 1
    q_dec = torch.randn(batch, heads, head_dim, device="cuda", generator=gen).bfloat16()
    pos_dec = torch.full((batch,), context - 1, device="cuda")
    dec_blocks = bi.token_blocks(torch.arange(batch, device="cuda"))

    ref_pre = reference(q_pre, k_cache, v_cache, table, pos_pre, seq_pre, scale)
    mode_bits = bi.attention_forward(q_pre, k_rows, v_rows, pos_pre, bi.token_blocks(seq_pre), table, scale,
                                     page=PAGE)  # fmt: skip
    configs = []
    for rows in ROWS:
        block_m = bi.attention_block_m(heads, kv_heads, rows)
        pre_blocks = bi.segment_blocks(starts, num_tokens, block_m)
        for warps in WARPS:

            def prefill(blocks=pre_blocks, rows=rows, warps=warps):
                return bi.attention_forward(q_pre, k_rows, v_rows, pos_pre, blocks, table, scale, page=PAGE,
                                            rows=rows, num_warps=warps)  # fmt: skip

            def decode(rows=rows, warps=warps):
                return bi.attention_forward(q_dec, k_rows, v_rows, pos_dec, dec_blocks, table, scale, page=PAGE,
                                            rows=rows, num_warps=warps)  # fmt: skip

            try:
                blocked = prefill()
            except Exception as exc:  # a config the compiler cannot fit (registers, shared memory)
                configs.append({"rows": rows, "warps": warps, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            alone = prefill(bi.token_blocks(seq_pre))
            configs.append({
                "rows": rows, "warps": warps, "tokens_per_program": block_m,
                "blocks_equal_tokens": bool(torch.equal(blocked, alone)),
                "equal_mode_bits": bool(torch.equal(blocked, mode_bits)),
                "max_abs_err": float((blocked.float() - ref_pre).abs().max()),
                "prefill_ms": event_ms(prefill), "decode_ms": graph_ms(decode),
            })  # fmt: skip

    # the default engine's kernels on the same cache
    tiles = ta.plan_prefill_tiles([prompt] * batch, ta.prefill_block_m(heads, kv_heads))
    tile_seq, tile_first = (torch.tensor(t, dtype=torch.int32, device="cuda") for t in tiles)
    ctx_pre = torch.full((batch,), prompt, dtype=torch.int32, device="cuda")
    ctx_dec = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    splits = ta.decode_num_splits(batch, kv_heads, sm_count(torch.cuda.current_device()))

    def default_prefill():
        return ta.paged_prefill_attention(q_pre, k_cache, v_cache, table, starts.to(torch.int32), ctx_pre,
                                          tile_seq, tile_first, scale)  # fmt: skip

    def default_decode():
        return ta.paged_decode_attention(q_dec, k_cache, v_cache, table, ctx_dec, scale, num_splits=splits)

    default = {
        "prefill_ms": event_ms(default_prefill), "decode_ms": graph_ms(default_decode),
        "max_abs_err": float((default_prefill().float() - ref_pre).abs().max()),
    }  # fmt: skip
    layout_ms = event_ms(lambda: bi.segment_blocks(starts, num_tokens, bi.attention_block_m(heads, kv_heads)))
    return {
        "shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers,
        "batch": batch, "prompt": prompt, "context": context, "default": default, "configs": configs,
        "mode_rows": bi.ATTENTION_ROWS, "segment_blocks_ms": layout_ms,
    }  # fmt: skip


def print_table(result: dict) -> None:
    layers, default = result["layers"], result["default"]
    print(
        f"\n## {result['shape']}: Hq {result['heads']} / Hkv {result['kv_heads']} / D {result['head_dim']}, "
        f"{result['layers']} layers; prefill {result['batch']} x {result['prompt']} tokens, decode "
        f"{result['batch']} at context {result['context']}; ms per forward (x layers)\n"
    )
    print("| kernel | tokens/program | prefill ms | vs default | decode ms | vs default | blocks == tokens "
          "| == mode's bits | max abs err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| default engine | - | {default['prefill_ms'] * layers:.2f} | 1.00 | {default['decode_ms'] * layers:.3f} "
          f"| 1.00 | - | - | {default['max_abs_err']:.2e} |")  # fmt: skip
    for c in result["configs"]:
        if "error" in c:
            print(f"| rows {c['rows']}, {c['warps']} warps | - | failed: {c['error'][:60]} | | | | | | |")
            continue
        mark = " (mode now)" if c["rows"] == result["mode_rows"] and c["warps"] == 4 else ""
        print(
            f"| rows {c['rows']}, {c['warps']} warps{mark} | {c['tokens_per_program']} "
            f"| {c['prefill_ms'] * layers:.2f} | {c['prefill_ms'] / default['prefill_ms']:.2f} "
            f"| {c['decode_ms'] * layers:.3f} | {c['decode_ms'] / default['decode_ms']:.2f} "
            f"| {'yes' if c['blocks_equal_tokens'] else 'NO'} | {'yes' if c['equal_mode_bits'] else 'no'} "
            f"| {c['max_abs_err']:.2e} |"
        )
    print(f"\nsegment_blocks (once per forward): {result['segment_blocks_ms']:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 0.5b and 1.5b"
    )
    p.add_argument("--batch", type=int, default=256, help="sequences")
    p.add_argument("--prompt", type=int, default=128, help="prefill tokens per sequence")
    p.add_argument("--context", type=int, default=256, help="decode context length")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench/batch_invariant_attention.py needs a CUDA device (the kernels are timed on it)"
        )
    results = []
    for shape in args.shape or ["0.5b", "1.5b"]:
        results.append(run_shape(shape, args.batch, args.prompt, args.context))
        print_table(results[-1])
    if args.json_out:
        result = {"device": torch.cuda.get_device_name(), "results": results}
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
