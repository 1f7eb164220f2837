"""Benchmark of colocated weight sync: trainer-side model -> a real Engine, version flip included.

A random-weight model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocab 151936, tied) and of Qwen2.5-1.5B's (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate
8960) is written once as an HF checkpoint; an Engine loads it in a subprocess (the deployment: trainer and
engine are separate processes on one device). The trainer side holds fp32 master weights (as TrainActor
does on GPU) and converts to the engine dtype while it exports, exactly like `TrainActor.weight_buckets`;
each timed sync is

    sender.begin(v); for bucket in iter_weight_buckets(iter_full_tensors(model, bf16), size): sender.send(bucket)
    sender.finish()          # every engine acknowledged every bucket and flipped to version v

so gather/convert, staging (flat buffer + CUDA IPC handle, or shared memory on CPU), engine load (device to
device into the fused parameters), the engine's synchronisation and the version flip are all inside it.
The trainer weights are perturbed before the first sync, and after the runs the engine's per-tensor
checksums must equal the trainer's (`--no-verify` skips that).

Transports between this process and the engine (`--transport`):
  http    the engine's real HTTP server (needs fastapi + uvicorn + pydantic)
  direct  the same WeightReceiver code, driven over a multiprocessing pipe (no HTTP; works where FastAPI is
          not installed, e.g. the H200 image); pause/continue are no-ops there (nothing is generating)
`--transport both` (default) runs http when it is available, and direct always.
`--engine-process inprocess` runs the engine in this process (CPU only: CUDA IPC handles cannot be opened
by the process that made them).

Output, per shape / transport / bucket size: median total ms (begin -> finish returned), GB/s, the phases
(begin = pause, send = all buckets handed over, finish = last acks + flip), "export alone" (the same
gather/convert loop with nothing sent: the trainer-side floor inside the total), and per bucket the staging
time, the time until acknowledged, and the engine's own time to open the handles and to load.

Run (H200, from the repository root; writes the table and a JSON file):
    PYTHONPATH=. python3 bench/weight_sync.py --device cuda --json "$OUT/weight_sync.json"
Run (CPU, here):
    .venv/bin/python bench/weight_sync.py --device cpu --shapes 0.5b --bucket-mb 256,1024 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from clawrl.engine.http.client import _Routes
from clawrl.models.config import ModelArgs
from clawrl.models.decoder import CausalLM
from clawrl.models.hf_io import save_hf
from clawrl.trainer.weights import iter_full_tensors, iter_weight_buckets
from clawrl.weight_sync import make_sender, tensor_checksum
from clawrl.weight_sync.checksum import checksum_differences

SHAPES = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
}
VOCAB = {"0.5b": 151936, "1.5b": 151936, "tiny": 4096}
GOAL_MS = {"0.5b": 50.0}


def model_args(shape: str) -> ModelArgs:
    dims = SHAPES[shape]
    return ModelArgs(arch="qwen2", vocab_size=VOCAB[shape], head_dim=dims["hidden_size"] // dims["num_heads"],
                     tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768, rope_theta=1e6,
                     eos_token_ids=[0], torch_dtype="bfloat16", **dims)  # fmt: skip


def build_trainer_model(shape: str, device: str, seed: int) -> CausalLM:
    """Un-fused fp32 model with random weights (std 0.02), as the trainer holds it."""
    with torch.device("meta"):
        model = CausalLM(model_args(shape), fused=False)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model


def perturb_(model: CausalLM, seed: int) -> None:
    """Change every weight a little, so a sync that loads nothing would fail the checksum check."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, device=param.device), alpha=1e-3)


# ------------------------------------------------------------------------------------------ engine side

_DIRECT_ROUTES = {
    "/pause_generation": lambda receiver, body: {"success": True},
    "/continue_generation": lambda receiver, body: {"success": True},
    "/update_weights_from_tensor": lambda receiver, body: receiver.update_from_tensor(body),
    "/weights_checksum": lambda receiver, body: receiver.checksums(),
    "/get_weight_version": lambda receiver, body: {"weight_version": receiver.engine.weight_version},
}


def _build_engine(model_dir: str, device: str, dtype: str):
    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
    # A small KV cache and no CUDA graphs: the benchmark moves weights, it does not generate (weights are
    # copied into the parameters in place, so captured graphs would stay valid anyway).
    config = EngineConfig(model_path=model_dir, device=device, dtype=dtype, num_kv_blocks=16, context_length=256,
                          max_running_requests=8, enable_cuda_graph=False)  # fmt: skip
    return Engine(config)


def engine_main(conn, model_dir: str, device: str, dtype: str, transport: str) -> None:
    """Subprocess: load the engine, then serve it over HTTP or over the pipe until told to stop."""
    from clawrl.engine.weight_receiver import WeightReceiver

    engine = _build_engine(model_dir, device, dtype)
    if transport == "http":
        from clawrl.engine.async_engine import AsyncEngine
        from clawrl.engine.http.app import ServerThread, create_app

        with ServerThread(create_app(AsyncEngine(engine))) as server:
            conn.send(server.url)
            conn.recv()  # "stop"
        return
    receiver = WeightReceiver(engine)
    conn.send("pipe://engine")
    while True:
        message = conn.recv()
        if message == "stop":
            return
        path, body = message
        try:
            conn.send(("ok", _DIRECT_ROUTES[path](receiver, body or {})))
        except Exception as error:  # reported to the sender, which raises it naming the engine
            conn.send(("error", f"{type(error).__name__}: {error}"))


class PipeClient(_Routes):
    """The engine client's route methods, carried over a multiprocessing pipe instead of HTTP."""

    def __init__(self, conn, timeout: float) -> None:
        self.conn, self.timeout = conn, timeout

    def _call(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
              timeout: float | None = None) -> Any:  # fmt: skip
        self.conn.send((path, body))
        if not self.conn.poll(timeout or self.timeout):
            raise TimeoutError(f"{path}: no reply from the engine process within {timeout or self.timeout} s")
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{path}: {result}")
        return result

    def close(self) -> None:
        pass


class LocalClient(_Routes):
    """The route methods calling a WeightReceiver of this process directly (CPU in-process mode)."""

    def __init__(self, receiver, timeout: float) -> None:
        self.receiver = receiver

    def _call(self, method: str, path: str, body: dict | None = None, **_: Any) -> Any:
        return _DIRECT_ROUTES[path](self.receiver, body or {})

    def close(self) -> None:
        pass


@contextlib.contextmanager
def engine_endpoint(model_dir: str, device: str, dtype: str, transport: str, inprocess: bool):
    """Yields make_sender kwargs (engine_urls, client_factory) reaching an engine on `model_dir`."""
    if inprocess:
        from clawrl.engine.weight_receiver import WeightReceiver

        receiver = WeightReceiver(_build_engine(model_dir, device, dtype))
        yield {
            "engine_urls": ["local://engine"],
            "client_factory": lambda url, timeout: LocalClient(receiver, timeout),
        }
        return
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=engine_main, args=(child, model_dir, device, dtype, transport), daemon=True
    )
    process.start()
    try:
        url = _first_message(parent, process, timeout_s=600.0)
        if transport == "http":
            yield {"engine_urls": [url]}
        else:
            yield {"engine_urls": [url], "client_factory": lambda url, timeout: PipeClient(parent, timeout)}
    finally:
        with contextlib.suppress(Exception):
            parent.send("stop")
        process.join(60)
        if process.is_alive():
            process.kill()


def _first_message(conn, process, *, timeout_s: float) -> str:
    """The engine process's URL, or an error as soon as it dies (its traceback is on stderr)."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not process.is_alive():
            raise RuntimeError(
                f"the engine process exited with code {process.exitcode} while starting (see above)"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine process did not start within {timeout_s:.0f} s")
    return conn.recv()


# ------------------------------------------------------------------------------------------ measurement


def timed_sync(sender, model, dtype: torch.dtype, bucket_bytes: int, version: str) -> dict[str, float]:
    """One full sync; returns wall times (s) of its phases."""
    if model.lm_head.weight.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    sender.begin(version)
    begun = time.perf_counter()
    for bucket in iter_weight_buckets(iter_full_tensors(model, dtype), bucket_bytes):
        sender.send(bucket)
    sent = time.perf_counter()
    versions = sender.finish()
    end = time.perf_counter()
    assert set(versions.values()) == {version}, versions
    return {"total_s": end - start, "begin_s": begun - start, "send_s": sent - begun, "finish_s": end - sent}


def export_only_s(model, dtype, bucket_bytes: int) -> float:
    """The trainer-side part alone: gather + convert + bucket, nothing sent (the baseline inside a sync)."""
    cuda = model.lm_head.weight.is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for bucket in iter_weight_buckets(iter_full_tensors(model, dtype), bucket_bytes):
        del bucket
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_bucket_size(
    sender, model, dtype, bucket_bytes: int, repeats: int, counter: list[int]
) -> dict[str, Any]:
    runs, stats = [], []
    for i in range(repeats + 1):  # the first run warms up (allocator, IPC, connections)
        counter[0] += 1
        phases = timed_sync(sender, model, dtype, bucket_bytes, f"v{counter[0]}")
        if i:
            runs.append(phases)
            stats += sender.stats
    export = statistics.median(export_only_s(model, dtype, bucket_bytes) for _ in range(max(1, repeats)))
    total_bytes = sum(s["bytes"] for s in sender.stats)
    totals = [r["total_s"] for r in runs]
    return {
        "bucket_mb": bucket_bytes / 2**20, "num_buckets": len(sender.stats), "bytes": total_bytes,
        "total_ms_median": 1e3 * statistics.median(totals), "total_ms_min": 1e3 * min(totals),
        "gb_per_s": total_bytes / statistics.median(totals) / 1e9,
        "export_only_ms": 1e3 * export,
        "begin_ms": 1e3 * statistics.median(r["begin_s"] for r in runs),
        "send_ms": 1e3 * statistics.median(r["send_s"] for r in runs),
        "finish_ms": 1e3 * statistics.median(r["finish_s"] for r in runs),
        "bucket_prepare_ms_mean": 1e3 * statistics.mean(s["prepare_s"] for s in stats),
        "bucket_ack_ms_mean": 1e3 * statistics.mean(s["ack_s"] for s in stats),
        "bucket_ack_ms_max": 1e3 * max(s["ack_s"] for s in stats),
        "engine_open_ms_mean": 1e3 * statistics.mean(s.get("engine_open_s", 0.0) for s in stats),
        "engine_load_ms_mean": 1e3 * statistics.mean(s.get("engine_load_s", 0.0) for s in stats),
    }  # fmt: skip


def verify(sender, model, dtype) -> str:
    """'ok', or the first differences between engine and trainer checksums."""
    url = sender.urls[0]
    reply = sender.submit(url, "weights_checksum").result(timeout=600)
    trainer = {name: tensor_checksum(t) for name, t in iter_full_tensors(model, dtype)}
    lines = checksum_differences(trainer, reply["checksums"])
    return "ok" if not lines else f"{len(lines)} tensors differ, e.g. {lines[:3]}"


def run_shape(shape: str, args, transports: list[str], workdir: Path) -> list[dict[str, Any]]:
    dtype = getattr(torch, args.dtype)
    model = build_trainer_model(shape, args.device, seed=0)
    model_dir = workdir / shape
    save_hf(model.to(dtype), model_dir)  # the engine's starting checkpoint (bf16 on disk)
    model.float()
    perturb_(model, seed=1)
    num_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    print(f"\n== {shape}: {num_bytes / 1e9:.3f} GB in {args.dtype}, device {args.device}", flush=True)
    results, counter = [], [0]
    inprocess = args.engine_process == "inprocess"
    for transport in transports:
        with (
            engine_endpoint(str(model_dir), args.device, args.dtype, transport, inprocess) as endpoint,
            make_sender(
                "colocated", timeout_s=args.timeout_s, max_inflight=args.max_inflight, **endpoint
            ) as sender,
        ):
            for bucket_mb in args.bucket_mb:
                row = bench_bucket_size(sender, model, dtype, int(bucket_mb * 2**20), args.repeats, counter)
                row.update(shape=shape, transport=transport, device=args.device)
                print_row(row)
                results.append(row)
            if not args.no_verify:
                outcome = verify(sender, model, dtype)
                print(f"   checksums engine == trainer after the last sync: {outcome}", flush=True)
                results[-1]["verify"] = outcome
    return results


def print_row(row: dict[str, Any]) -> None:
    goal = GOAL_MS.get(row["shape"]) if row["device"].startswith("cuda") else None
    met = goal is not None and row["total_ms_median"] < goal
    mark = "" if goal is None else f" (goal < {goal:.0f} ms: {'met' if met else 'NOT met'})"
    print(f"   {row['transport']:6s} bucket {row['bucket_mb']:7.1f} MiB x{row['num_buckets']:3d}: "
          f"total {row['total_ms_median']:8.1f} ms (min {row['total_ms_min']:.1f}) {row['gb_per_s']:6.2f} GB/s | "
          f"begin {row['begin_ms']:.1f} send {row['send_ms']:.1f} finish {row['finish_ms']:.1f} ms "
          f"(export alone {row['export_only_ms']:.1f}) | per bucket: "
          f"prepare {row['bucket_prepare_ms_mean']:.1f} ack mean {row['bucket_ack_ms_mean']:.1f} "
          f"max {row['bucket_ack_ms_max']:.1f} (engine: open {row['engine_open_ms_mean']:.1f} "
          f"load {row['engine_load_ms_mean']:.1f}) ms{mark}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="0.5b,1.5b", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--bucket-mb", default="64,256,512,1024", help="comma list of bucket sizes in MiB")
    parser.add_argument("--dtype", default="bfloat16", help="engine dtype (the trainer converts to it)")
    parser.add_argument("--transport", default="both", choices=["both", "http", "direct"])
    parser.add_argument("--engine-process", default="subprocess", choices=["subprocess", "inprocess"])
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed syncs per bucket size (after one warm-up)"
    )
    parser.add_argument("--max-inflight", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.bucket_mb = [float(x) for x in args.bucket_mb.split(",")]
    if args.engine_process == "inprocess" and args.device.startswith("cuda"):
        parser.error(
            "--engine-process inprocess needs --device cpu (a CUDA IPC handle cannot be opened by its maker)"
        )
    http_ok = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "pydantic"))
    if args.transport == "http" and not http_ok:
        parser.error("--transport http needs fastapi, uvicorn and pydantic")
    transports = {"both": ["http"] * http_ok + ["direct"], "http": ["http"], "direct": ["direct"]}[
        args.transport
    ]
    if args.engine_process == "inprocess":
        transports = ["direct"]
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
          + f", transports {transports}", flush=True)  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory(prefix="clawrl-bench-ws-") as tmp:
        for shape in args.shapes.split(","):
            results += run_shape(shape.strip(), args, transports, Path(tmp))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r.get("verify", "ok") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
