"""Trainer offload / onload (clawrl/trainer/offload.py) against the host link's own speed, on the trainer's real
set of tensors: what bounds `perf/trainer_onload_time` and `perf/trainer_offload_time` in a colocated loop.

The tensors are those a colocated 0.5B / 1.5B trainer moves: the fp32 master parameters, AdamW's two fp32
moments per parameter and a bf16 reference copy (--use-kl-loss), each parameter its own tensor. Measured:
  offload / onload   HostOffload on those tensors (pinned host buffers kept from a warm-up cycle, as in the
                     loop), median of --repeats
  one buffer         the same bytes as one pinned host buffer <-> one device buffer (the link's speed for
                     this size: the floor of any full offload)
  allocations        onload's device allocations alone (resizing every storage back, no copy)

    PYTHONPATH=. python bench/host_offload.py --shape 0.5b --json-out $OUT/host_offload.json     # H200
    .venv/bin/python bench/host_offload.py --shape tiny --device cpu                              # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from clawrl.trainer.offload import HostOffload

SHAPES = {  # as bench/engine_throughput.py's (Qwen2.5-shaped)
    "0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, inter=4864, vocab=151936),
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, inter=8960, vocab=151936),
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=256, vocab=8192),
}


def parameter_shapes(shape: str) -> list[tuple[int, ...]]:
    """One entry per parameter tensor of a Qwen2-style decoder with tied embeddings and qkv bias."""
    s = SHAPES[shape]
    h, head = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * head
    layer = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (h,), (h,), (s["inter"], h), (s["inter"], h),
             (h, s["inter"])]  # fmt: skip
    return [(s["vocab"], h), (h,)] + layer * s["layers"]


def trainer_tensors(shape: str, device: str) -> list[torch.Tensor]:
    """fp32 master + two fp32 moments + a bf16 reference copy per parameter."""
    out = []
    for dims in parameter_shapes(shape):
        out += [torch.randn(dims, device=device) for _ in range(3)]
        out.append(torch.randn(dims, device=device, dtype=torch.bfloat16))
    return out


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def offload_cycle(tensors: list[torch.Tensor], device: str, repeats: int) -> dict[str, list[float]]:
    """HostOffload's offload and onload times, and onload's allocations alone (after a warm-up cycle)."""
    host = HostOffload()
    host.offload(tensors)  # warm-up cycle: the pinned host buffers are allocated once and kept
    host.onload()
    times: dict[str, list[float]] = {"offload_s": [], "onload_s": [], "onload_allocations_s": []}
    for _ in range(repeats):
        times["offload_s"].append(timed(lambda: host.offload(tensors), device))
        times["onload_s"].append(timed(host.onload, device))
    storages = host._storages
    sizes = [st.nbytes() for st in storages]
    for _ in range(repeats):  # what onload does before its copies: every storage reallocated
        for st in storages:
            st.resize_(0)
        if device == "cuda":
            torch.cuda.empty_cache()  # as HostOffload.offload leaves it
        times["onload_allocations_s"].append(
            timed(lambda: [st.resize_(n) for st, n in zip(storages, sizes, strict=True)], device)
        )
    return times


def one_buffer(nbytes: int, device: str, repeats: int) -> dict[str, list[float]]:
    """The same bytes as one pinned host buffer <-> one device buffer."""
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return {
        "one_buffer_h2d_s": [timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), device) for _ in range(repeats)],
        "one_buffer_d2h_s": [timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), device) for _ in range(repeats)],
    }  # fmt: skip


def measure(shape: str, device: str, repeats: int) -> dict:
    tensors = trainer_tensors(shape, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times = offload_cycle(tensors, device, repeats)
    tensors.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    times.update(one_buffer(nbytes, device, repeats))
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    return {"shape": shape, "device": device, "gbytes": gb, "tensors": 4 * len(parameter_shapes(shape)), **med,
            "onload_gb_s": gb / med["onload_s"], "offload_gb_s": gb / med["offload_s"],
            "one_buffer_h2d_gb_s": gb / med["one_buffer_h2d_s"], "one_buffer_d2h_gb_s": gb / med["one_buffer_d2h_s"],
            "onload_vs_one_buffer": med["onload_s"] / med["one_buffer_h2d_s"],
            "offload_vs_one_buffer": med["offload_s"] / med["one_buffer_d2h_s"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu")
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    for shape in args.shape.split(","):
        if shape not in SHAPES:
            p.error(f"--shape {shape!r}: must be one of {sorted(SHAPES)}")
    results = []
    for shape in args.shape.split(","):
        r = measure(shape, args.device, args.repeats)
        results.append(r)
        print(f"{shape}: {r['gbytes']:.2f} GB in {r['tensors']} tensors | onload {r['onload_s']:.3f} s "
              f"({r['onload_gb_s']:.1f} GB/s, of which allocations {r['onload_allocations_s']:.3f} s) | "
              f"offload {r['offload_s']:.3f} s ({r['offload_gb_s']:.1f} GB/s) | one buffer: "
              f"H2D {r['one_buffer_h2d_s']:.3f} s ({r['one_buffer_h2d_gb_s']:.1f} GB/s), "
              f"D2H {r['one_buffer_d2h_s']:.3f} s ({r['one_buffer_d2h_gb_s']:.1f} GB/s)", flush=True)  # fmt: skip
        torch.cuda.empty_cache() if args.device == "cuda" else None
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps({"torch": torch.__version__, "results": results}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
