"""Engine host overhead: the CPU time of one decode step for a full batch, with the GPU taken out.

The real Engine, Scheduler, BlockManager, Sequences, stop rules, StepOutputs and the GPU runner's host side
(gpu_runner.GpuModelRunner: staging arrays, block-table rows, sampler inputs) run on the CPU; only the device
work is replaced by instant stand-ins: the decode forward (what one CUDA-graph replay computes) returns a
preallocated logits buffer, the prefill forward returns zero hidden states, and the Triton sampler kernel
writes a hash of each row's key. So what is timed is exactly the Python / numpy / torch-call work the engine
thread does per step, which on the H200 must hide under the ~1.5 ms GPU step of the 0.5B model at batch 256.

Each timed step is split into phases by wrapping the engine's calls (time.perf_counter): scheduling, the
runner's launch (input building, sampler set-up), scheduler postprocess, runner collect, stop rules and
StepOutputs, the rest of Engine.step, and the caller consuming the outputs (as bench/engine_throughput.py
does). --profile adds a cProfile table of the timed steps.

Run from the repository root (CPU only, ~20 s):
    .venv/bin/python bench/engine_host_overhead.py
    .venv/bin/python bench/engine_host_overhead.py --schedule plain --batch 256 --steps 200 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

VOCAB = 4096


class _PhaseTimer:
    """Accumulates perf_counter time per phase of the wrapped calls while `active`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, owner: object, attribute: str, label: str) -> None:
        inner = getattr(owner, attribute)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.active:
                    self.totals[label] += time.perf_counter() - start

        setattr(owner, attribute, timed)


def stub_device(runner, vocab: int) -> None:
    """Replace the runner's device work (forward, CUDA-graph replay, sampler kernel) by instant stand-ins."""
    import clawrl.engine.runner.triton_ops as triton_ops

    max_batch = runner.batch_sizes[-1]
    logits = torch.zeros(max_batch, vocab)
    hidden_size = runner.model.args.hidden_size
    runner._decode_forward = lambda size: logits[:size]  # one graph replay: no host work but the call
    runner._forward = lambda ids_N, positions_N: torch.zeros(ids_N.shape[0], hidden_size)

    def sample_rows(logits_MV, rows, temperatures_M, keys_M, tokens_M, logprobs_M, *, sample, **_):
        tokens_M[rows] = keys_M[rows] % logits_MV.shape[1]  # a token that depends on seed and step
        logprobs_M[rows] = -1.0

    triton_ops.sample_rows = sample_rows


def build_engine(workdir: Path, args):
    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine
    from clawrl.engine.runner.gpu_runner import GpuModelRunner
    from clawrl.models.tiny import build_tiny_model

    path = build_tiny_model(workdir / "tiny", vocab_size=VOCAB, max_position_embeddings=4096)
    context = args.prompt_len + args.new_tokens
    num_blocks = args.batch * -(-context // args.block_size) + 16
    config = EngineConfig(
        model_path=str(path), block_size=args.block_size, num_kv_blocks=num_blocks,
        max_running_requests=args.batch, max_num_batched_tokens=8192,
        enable_overlap_schedule=args.schedule == "overlap",
    )  # fmt: skip
    engine = Engine(config)
    engine.runner = GpuModelRunner(
        engine.model, engine.kv_cache, max_running_requests=args.batch, context_length=engine.context_length,
        enable_cuda_graph=False, fused_kernels=False,
    )  # fmt: skip
    stub_device(engine.runner, VOCAB)
    return engine


def wrap_phases(engine, timer: _PhaseTimer) -> None:
    phases = [
        (engine.scheduler, "schedule", "schedule"),
        (engine.runner, "launch", "runner.launch"),
        (engine.scheduler, "postprocess", "postprocess"),
        (engine.runner, "collect", "runner.collect"),
        (engine, "_apply_stop_rules", "stop rules + outputs"),  # before the fused loop of _apply_tokens
        (engine, "_apply_tokens", "tokens, stop rules, outputs"),
    ]
    for owner, attribute, label in phases:
        if hasattr(owner, attribute):
            timer.wrap(owner, attribute, label)


def add_requests(engine, args) -> None:
    from clawrl.engine.core.request import SamplingParams

    for i in range(args.batch):
        prompt = [(i * 7919 + j * 104729) % (VOCAB - 3) + 3 for j in range(args.prompt_len)]
        params = SamplingParams(
            max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0.0 if args.greedy else 1.0, seed=i
        )
        engine.add_request(f"r{i}", prompt, params)


def run(args) -> dict[str, float]:
    """Per-step milliseconds by phase over `args.steps` decode steps of a full batch."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(Path(tmp), args)
        timer = _PhaseTimer()
        wrap_phases(engine, timer)
        add_requests(engine, args)
        counts: dict[str, int] = defaultdict(int)
        while not all(s.num_output_tokens >= 2 for s in engine.scheduler.running) or len(
            engine.scheduler.running
        ) < min(args.batch, engine.scheduler.max_running_requests):
            for out in engine.step():  # prefill (not timed)
                counts[out.request_id] += len(out.token_ids)
        assert args.steps + 4 < args.new_tokens, "--steps must stay below --new-tokens (a full batch)"
        profiler = cProfile.Profile() if args.profile else None
        timer.active = True
        consume = 0.0
        start, start_cpu = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        for _ in range(args.steps):
            outputs = engine.step()
            mark = time.perf_counter()
            for out in outputs:  # what the throughput bench does with each output
                counts[out.request_id] += len(out.token_ids)
            consume += time.perf_counter() - mark
        if profiler is not None:
            profiler.disable()
        total, total_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        timer.active = False
        assert len(outputs) == args.batch, (
            f"expected {args.batch} outputs per decode step, got {len(outputs)}"
        )
    phases = {label: seconds * 1e3 / args.steps for label, seconds in timer.totals.items()}
    step = (total - consume) * 1e3 / args.steps
    phases["other (Engine.step)"] = step - sum(phases.values())
    phases["caller consumes outputs"] = consume * 1e3 / args.steps
    phases["TOTAL per step"] = total * 1e3 / args.steps
    # CPU time of this process: less sensitive than wall time to other processes sharing the cores.
    phases["TOTAL per step, CPU time"] = total_cpu * 1e3 / args.steps
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="running sequences (all decoding)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens of every request")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed (after prefill)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size")
    p.add_argument("--schedule", choices=("overlap", "plain"), default="overlap", help="engine schedule")
    p.add_argument("--greedy", action="store_true", help="temperature 0 instead of 1")
    p.add_argument("--repeats", type=int, default=3, help="runs; the fastest is reported")
    p.add_argument("--profile", action="store_true", help="print a cProfile table of the timed steps")
    args = p.parse_args()
    runs = [run(args) for _ in range(args.repeats if not args.profile else 1)]
    best = min(runs, key=lambda r: r["TOTAL per step, CPU time"])
    print(f"host time per decode step, batch {args.batch}, {args.schedule} schedule ({args.steps} steps, "
          f"best of {len(runs)}):")  # fmt: skip
    for label, ms in best.items():
        print(f"  {label:28} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
