"""Rollout HTTP overhead: tokens/s of a rollout through the engine's HTTP server vs the engine alone.

By default the engine is bench/engine_host_overhead.py's: the real Engine, Scheduler and GpuModelRunner host
side with only the device work stubbed (`stub_device`), so all that is timed is host (CPU) work, on any
machine. --device-ms adds an emulated GPU: each launched step keeps a "device" busy that long, and the
engine thread waits for it with the GIL released (time.sleep), as it waits in torch.cuda.Event.synchronize
on the GPU; with ~3 ms (the 0.5B model at batch 256 on the H200) the in-process run is device-bound like
the real engine, and the HTTP run shows what the server and the client add. --shape 0.5b runs the same on
the GPU with a real engine (random-weight checkpoint written by bench/engine_throughput.py's code).

The same requests (--batch prompts of --prompt-len tokens, --new-tokens each, or spread down to
--min-new-tokens so that they finish at different steps; EOS ignored) go two ways, alternating:
- in-process: `Engine.add_request` for every request, then `Engine.step()` until done (the ceiling, as
  bench/engine_throughput.py drives the engine);
- HTTP: the engine behind AsyncEngine and the FastAPI app in a uvicorn thread of this process (as
  clawrl/cluster/engine_actor.py serves it), and a client subprocess doing the RolloutManager's side: the
  default generate function (clawrl/rollout/generate.py) through EngineRouter and AsyncEngineClient, with
  the payload a rollout sends (input_ids, the --rollout-* sampling params, return_logprob), all at once.

The client opens its connections before the timed rollout (--connections warm), as a loop's rollouts after
the first find them, and freezes its heap as the RolloutManager does; --connections cold opens them inside it.

Reported per run: tokens/s; engine steps and wall ms per step (inside Engine.step in brackets); three
phases: ramp (first request sent -> first step that decodes the whole batch), steady (those steps, ms per
step), tail (-> last response received); the answer path from the engine's stamps (when the requests
reached the engine's handler, when the last one finished, its answer was built and was back); the garbage
collector's pauses in the server and the client; CPU ms per step of the server process, of its engine
thread and HTTP thread, and of the client process, and of the two threads over the steady phase alone.
After the runs, the medians of the HTTP runs (tokens/s, ramp, tail, arrival spread, answer path, GC);
--json-out writes every run.

--profile adds cProfile tables of the engine thread and the HTTP event loop's thread (each timed by its
own CPU clock, so waiting for the GIL or for I/O is not counted), and of the client process.

Run from the repository root (CPU only, about a minute):
    .venv/bin/python bench/rollout_http_overhead.py --device-ms 3
    .venv/bin/python bench/rollout_http_overhead.py --device-ms 3 --min-new-tokens 64
    .venv/bin/python bench/rollout_http_overhead.py --repeats 1 --profile
On the H200 (real engine, random-weight Qwen2.5-0.5B shape):
    PYTHONPATH=. python bench/rollout_http_overhead.py --shape 0.5b --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_host_overhead as host  # noqa: E402  (bench/ is not a package)

from clawrl.metrics.timer import GcPauses  # noqa: E402

_SERVER_THREADS = ("clawrl-engine", "clawrl-engine-http")


# ---------------------------------------------------------------------------------------------------
# the requests


def prompt_ids(i: int, prompt_len: int) -> list[int]:
    """Prompt i: the same tokens bench/engine_host_overhead.py's add_requests sends."""
    return [(i * 7919 + j * 104729) % (host.VOCAB - 3) + 3 for j in range(prompt_len)]


def new_tokens(i: int, args) -> int:
    """Request i's max_new_tokens: --new-tokens, or spread over [--min-new-tokens, --new-tokens]; the same for
    every sample of a --group-size group (one batch request carries one set of sampling params)."""
    low = args.new_tokens if args.min_new_tokens is None else args.min_new_tokens
    i -= i % args.group_size
    return low + (i * 7919) % (args.new_tokens - low + 1)


def rollout_args(max_response_len: int) -> argparse.Namespace:
    """The --rollout-* flags the default generate function reads (slime-style defaults)."""
    return argparse.Namespace(
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_stop=None,
        rollout_stop_token_ids=None, rollout_seed=0, rollout_max_response_len=max_response_len,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# client subprocess (the RolloutManager's side)


async def _client_rollout(url: str, args) -> dict:
    from clawrl.data.sample import Sample
    from clawrl.rollout.context import (
        RolloutContext,
        reset_rollout_context,
        rollout_context,
        set_rollout_context,
    )
    from clawrl.rollout.generate import generate, generate_group, train_sampling_params
    from clawrl.rollout.router import EngineRouter
    from clawrl.rollout.timeline import RolloutTimeline

    flags = [rollout_args(new_tokens(i, args)) for i in range(args.batch)]
    params = [{**train_sampling_params(f), "ignore_eos": True} for f in flags]
    router = EngineRouter([url], max_concurrent_requests=512)  # the RolloutManager's default per engine
    token = set_rollout_context(
        RolloutContext(router=router, tokenizer=None, loop=asyncio.get_running_loop())
    )
    try:
        samples = [Sample(index=i, tokens=prompt_ids(i, args.prompt_len)) for i in range(args.batch)]
        if args.connections == "warm":
            await _open_connections(router, -(-args.batch // args.group_size))
        timeline = rollout_context().timeline = RolloutTimeline(started=time.monotonic())
        gc.collect()
        gc.freeze()  # as the RolloutManager freezes its heap after its set-up
        print("ready", flush=True)  # imports done: the server starts its clocks and answers "go"
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start, start_cpu = time.perf_counter(), time.process_time()
        timeline.started = time.monotonic()
        with GcPauses() as pauses:
            if args.group_size > 1:  # the RolloutManager's way: one batch request per prompt group
                groups = [samples[i : i + args.group_size] for i in range(0, len(samples), args.group_size)]
                await asyncio.gather(
                    *(generate_group(flags[g[0].index], g, params[g[0].index]) for g in groups)
                )
            else:
                await asyncio.gather(*(generate(flags[s.index], s, params[s.index]) for s in samples))
        end, cpu = time.perf_counter(), time.process_time() - start_cpu
    finally:
        reset_rollout_context(token)
        await router.aclose()
    return {
        "start": start,
        "end": end,
        "cpu_s": cpu,
        "tokens": sum(s.response_length for s in samples),
        "calls": _call_stamps(timeline),
        "gc_ms": pauses.seconds * 1e3,
        "gc_collections": pauses.collections,
    }


async def _open_connections(router, count: int) -> None:
    """`count` tiny requests at once, so the rollout finds that many pooled connections, as a loop's rollouts
    after the first do while the train step between them is shorter than the client's keep-alive (20 s for
    the run's own engines, 2 s for external ones: clawrl/engine/http/client.py); one-token prompts, so the
    prefix cache holds nothing the rollout uses."""
    payload = {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}}
    await asyncio.gather(*(router.generate(payload) for _ in range(count)))


def _call_stamps(timeline) -> dict[str, float]:
    """The /generate calls' answer path (the engine's stamps, this host's monotonic clock), in ms from the
    rollout's start: when requests reached the engine's handler, when the engine finished them, and when
    their answers were built and back."""
    calls = timeline.engine_calls
    if not calls:
        return {}
    ms = lambda stamp: (stamp - timeline.started) * 1e3  # noqa: E731
    return {"first_received_ms": ms(min(c.received for c in calls)),
            "last_received_ms": ms(max(c.received for c in calls)),
            "last_finished_ms": ms(max(c.finished for c in calls)),
            "last_answered_ms": ms(max(c.answered for c in calls)),
            "last_back_ms": ms(max(c.back for c in calls))}  # fmt: skip


def client_main(url: str, args) -> None:
    if not args.profile:
        print(json.dumps(asyncio.run(_client_rollout(url, args))), flush=True)
        return
    import cProfile
    import pstats

    with cProfile.Profile(time.process_time) as profile:  # includes the imports and set-up: small
        result = asyncio.run(_client_rollout(url, args))
    print(
        "\n--- client process (RolloutManager side): CPU time by function, sorted by tottime ---",
        file=sys.stderr,
    )
    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.top)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------
# server side


class _StepCounter:
    """Counts Engine.step calls and the time inside them; times the steady phase (steps that start with the
    whole batch running and nothing waiting: the HTTP server's requests report only when they finish, so
    their outputs cannot tell) by perf_counter, which is CLOCK_MONOTONIC: comparable with the client's."""

    def __init__(self, engine, batch: int) -> None:
        self.calls, self.inside_s = 0, 0.0
        self.full_steps, self.first_full, self.last_full = 0, None, None
        self.cpu_first, self.cpu_last = {}, {}  # server threads' CPU clocks at the steady phase's ends
        inner = type(engine).step.__get__(engine)  # the class's: counters of earlier runs drop out
        scheduler = engine.scheduler

        def step():
            start, cpu = time.perf_counter(), _thread_cpu_s(_SERVER_THREADS)
            full = len(scheduler.running) == batch and not scheduler.waiting
            try:
                return inner()
            finally:
                end = time.perf_counter()
                self.inside_s += end - start
                self.calls += 1
                if full:
                    self.full_steps += 1
                    if self.first_full is None:
                        self.first_full, self.cpu_first = start, cpu
                    self.last_full, self.cpu_last = end, _thread_cpu_s(_SERVER_THREADS)

        engine.step = step

    def steady_cpu_ms_per_step(self) -> dict[str, float]:
        """CPU ms per step of each server thread over the steady phase."""
        steps = max(self.full_steps - 1, 1)
        return {
            f"steady_{_short_name(name)}_cpu_ms_per_step": (self.cpu_last[name] - self.cpu_first[name])
            * 1e3
            / steps
            for name in self.cpu_first
            if name in self.cpu_last
        }


class _DeviceClock:
    """Emulates the GPU's time: each launched step occupies a device for `device_s` after the previous one,
    and collect() waits for it with the GIL released (time.sleep), as the real collect waits in
    torch.cuda.Event.synchronize. So the engine thread's host work overlaps the device step, as on the GPU,
    and every step ends with a GIL hand-back that the server's other threads can delay."""

    def __init__(self, runner, device_s: float) -> None:
        self.device_s, self.busy_until, self.done_at = device_s, 0.0, {}
        launch, collect = runner.launch, runner.collect

        def timed_launch(batch):
            handle = launch(batch)
            if handle.seqs:
                self.busy_until = max(time.perf_counter(), self.busy_until) + self.device_s
                self.done_at[id(handle)] = self.busy_until
            return handle

        def timed_collect(handle):
            wait = self.done_at.pop(id(handle), 0.0) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return collect(handle)

        runner.launch, runner.collect = timed_launch, timed_collect


class _Engines:
    """Each run's engine: a fresh stubbed one (bench/engine_host_overhead.py's, plus --device-ms of emulated
    GPU time), or with --shape one real engine on the GPU for every run, its prefix cache flushed between
    runs (the runs send the same prompts)."""

    def __init__(self, args, workdir: Path) -> None:
        self.args, self.workdir, self.real, self.made = args, workdir, None, 0

    def get(self):
        if self.args.shape is None:
            self.made += 1
            engine = host.build_engine(self.workdir / f"run{self.made}", self.args)
            if self.args.device_ms > 0:
                _DeviceClock(engine.runner, self.args.device_ms / 1e3)
            return engine
        if self.real is None:
            self.real = self._build_real()
        if not self.real.flush_cache():
            raise RuntimeError("the engine still has requests after a run")
        return self.real

    def _build_real(self):
        from engine_throughput import build_checkpoint

        from clawrl.engine.config import EngineConfig
        from clawrl.engine.core.engine import Engine
        from clawrl.engine.core.request import SamplingParams

        device = self.args.device
        path = build_checkpoint(Path(self.args.workdir) / f"random-{self.args.shape}", self.args.shape,
                                init_std=0.02, device=device)  # fmt: skip
        dtype = "bfloat16" if device == "cuda" else "float32"
        engine = Engine(EngineConfig(model_path=str(path), device=device, dtype=dtype,
                                     max_running_requests=self.args.batch))  # fmt: skip
        prompts = [prompt_ids(i, self.args.prompt_len) for i in range(self.args.batch)]
        engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up, untimed
        return engine


class _ThreadProfiles:
    """cProfile of the engine thread and of the HTTP event loop's thread, timed by each thread's CPU clock
    (time.thread_time: time spent waiting for the GIL or for I/O is not counted), switched on and off from
    inside those threads through a bench-only route (cProfile profiles the thread that enables it)."""

    def __init__(self) -> None:
        import cProfile

        self.engine = cProfile.Profile(time.thread_time)
        self.loop = cProfile.Profile(time.thread_time)

    def install(self, app, async_engine) -> None:
        async def switch(action: str) -> dict:
            if action == "on":
                self.loop.enable()
                await async_engine.run_in_engine_thread(self.engine.enable)
            else:
                self.loop.disable()
                await async_engine.run_in_engine_thread(self.engine.disable)
            return {"profiling": action}

        app.add_api_route("/_bench/profile/{action}", switch, methods=["POST"])

    def report(self, top: int) -> None:
        import pstats

        for name, profile in (("clawrl-engine (engine thread)", self.engine), ("HTTP event loop", self.loop)):
            print(f"\n--- {name}: CPU time (time.thread_time) by function, sorted by tottime ---")
            pstats.Stats(profile).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(top)


def _switch_profile(url: str, action: str) -> None:
    response = httpx.post(f"{url}/_bench/profile/{action}", timeout=60)
    if response.status_code != 200:  # (on the GPU machine's Python 3.12, `on` once answered 400: say why)
        raise RuntimeError(f"--profile: switching {action} failed: {response.status_code} {response.text}")


def _short_name(thread_name: str) -> str:
    return {"clawrl-engine": "engine_thread", "clawrl-engine-http": "http_thread"}[thread_name]


def _thread_cpu_s(names: tuple[str, ...]) -> dict[str, float]:
    """CPU seconds used so far by each named thread of this process (Linux: per-thread CPU clocks)."""
    found = {t.name: t.ident for t in threading.enumerate() if t.name in names}
    return {name: time.clock_gettime(time.pthread_getcpuclockid(ident)) for name, ident in found.items()}


def run_inprocess(args, engines: _Engines) -> dict:
    """The ceiling: add every request, step the engine until done. The heap is frozen as AsyncEngine freezes
    it (a full garbage collection pass would otherwise stop this loop for ~0.2 s at random)."""
    from clawrl.engine.core.request import SamplingParams

    engine = engines.get()
    counter = _StepCounter(engine, args.batch)
    gc.collect()
    gc.freeze()
    try:
        start, start_cpu = time.perf_counter(), time.process_time()
        for i in range(args.batch):
            params = SamplingParams(
                max_new_tokens=new_tokens(i, args), ignore_eos=True, temperature=1.0, seed=i
            )
            engine.add_request(f"r{i}", prompt_ids(i, args.prompt_len), params)
        tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.token_ids)
        end, cpu = time.perf_counter(), time.process_time() - start_cpu
    finally:
        gc.unfreeze()
    return _result("in-process", tokens, start, end, counter, server_cpu_s=cpu)


def run_http(args, engines: _Engines, profiles: _ThreadProfiles | None) -> dict:
    """The rollout path: server threads here, the client in a subprocess."""
    from clawrl.engine.async_engine import AsyncEngine
    from clawrl.engine.http.app import ServerThread, create_app
    from clawrl.engine.http.client import EngineClient

    engine = engines.get()
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine)
    if profiles is not None:
        profiles.install(app, async_engine)
    with ServerThread(app) as server, EngineClient(server.url, timeout=60) as control:
        # First-call costs (imports, first tokenizer use) out of the way.
        control.generate(
            input_ids=prompt_ids(args.batch, args.prompt_len), sampling_params={"max_new_tokens": 2}
        )
        counter = _StepCounter(engine, args.batch)
        measured = _client_run(server.url, args, profile=profiles is not None)
    client, server_cpu, threads_cpu = measured
    expected = sum(new_tokens(i, args) for i in range(args.batch))
    if client["tokens"] != expected:
        raise RuntimeError(f"the client received {client['tokens']} tokens, expected {expected}")
    result = _result("HTTP", client["tokens"], client["start"], client["end"], counter, server_cpu_s=server_cpu,
                     client_cpu_s=client["cpu_s"], **threads_cpu)  # fmt: skip
    calls = client["calls"]
    result.update(calls)
    result.update(
        {key: client[key] for key in ("gc_ms", "gc_collections", "server_gc_ms", "server_gc_collections")}
    )
    if "ramp_s" in result:
        result["ramp_ms"], result["tail_ms"] = result["ramp_s"] * 1e3, result["tail_s"] * 1e3
    if calls:
        result["arrival_spread_ms"] = calls["last_received_ms"] - calls["first_received_ms"]
        result["answer_after_finish_ms"] = calls["last_answered_ms"] - calls["last_finished_ms"]
        result["back_after_finish_ms"] = calls["last_back_ms"] - calls["last_finished_ms"]
    return result


def _client_run(url: str, args, *, profile: bool) -> tuple[dict, float, dict[str, float]]:
    """Start the client subprocess, wait until it is ready, then time its rollout (CPU clocks of this
    process and of its server threads over exactly that span)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--client-url",
        url,
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--min-new-tokens",
        str(args.new_tokens if args.min_new_tokens is None else args.min_new_tokens),
        "--group-size",
        str(args.group_size),
        "--top",
        str(args.top),
        "--connections",
        args.connections,
    ]
    command += ["--profile"] if profile else []  # fmt: skip
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the client subprocess did not start (it said {ready!r}; see its stderr)")
        if profile:
            _switch_profile(url, "on")
        threads_before, start_cpu = _thread_cpu_s(_SERVER_THREADS), time.process_time()
        with GcPauses() as pauses:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, _ = proc.communicate(timeout=args.timeout_s)
        server_cpu, threads_after = time.process_time() - start_cpu, _thread_cpu_s(_SERVER_THREADS)
        if profile:
            _switch_profile(url, "off")
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"the client subprocess failed (exit {proc.returncode}; see its stderr above)")
    threads = {
        f"{_short_name(name)}_cpu_s": threads_after[name] - threads_before[name] for name in threads_before
    }
    client = json.loads(out.strip().splitlines()[-1])
    client["server_gc_ms"], client["server_gc_collections"] = pauses.seconds * 1e3, pauses.collections
    return client, server_cpu, threads


def _result(kind: str, tokens: int, start: float, end: float, counter: _StepCounter, **cpu: float) -> dict:
    """Totals, the per-step averages, and the three phases: ramp (first request sent -> first step that
    decodes the whole batch), steady (those steps), tail (-> last response received)."""
    steps, wall_s = max(counter.calls, 1), end - start
    result = {
        "kind": kind, "tokens": tokens, "tok_per_s": tokens / wall_s, "wall_s": wall_s,
        "steps": counter.calls, "wall_ms_per_step": wall_s * 1e3 / steps,
        "in_step_ms_per_step": counter.inside_s * 1e3 / steps,
    }  # fmt: skip
    if counter.full_steps:
        result.update(counter.steady_cpu_ms_per_step())
        result["ramp_s"] = counter.first_full - start
        result["steady_ms_per_step"] = (counter.last_full - counter.first_full) * 1e3 / counter.full_steps
        result["tail_s"] = end - counter.last_full
    for name, seconds in cpu.items():
        result[name.removesuffix("_s") + "_ms_per_step"] = seconds * 1e3 / steps
    return result


_PATH_KEYS = (
    "tok_per_s",
    "ramp_ms",
    "tail_ms",
    "arrival_spread_ms",
    "answer_after_finish_ms",
    "back_after_finish_ms",
    "server_gc_ms",
    "gc_ms",
)
"""The HTTP runs' medians printed at the end: tokens/s, the phases, and the answer path of the last call."""

_CPU_LABELS = {"server_cpu_ms_per_step": "server process", "engine_thread_cpu_ms_per_step": "engine thread",
               "http_thread_cpu_ms_per_step": "HTTP thread", "client_cpu_ms_per_step": "client process"}  # fmt: skip


def _print(result: dict) -> None:
    r = result
    print(f"{r['kind']:10} {r['tok_per_s']:8.0f} tok/s {r['wall_s']:5.2f} s, {r['steps']} steps: "
          f"{r['wall_ms_per_step']:.2f} ms/step ({r['in_step_ms_per_step']:.2f} in Engine.step)")  # fmt: skip
    if "steady_ms_per_step" in r:
        print(f"{'':10} phases: ramp {r['ramp_s']:.3f} s, steady {r['steady_ms_per_step']:.2f} ms/step, "
              f"tail {r['tail_s']:.3f} s")  # fmt: skip
    if "last_back_ms" in r:
        print(f"{'':10} requests in the engine's handler {r['first_received_ms']:.1f}-{r['last_received_ms']:.1f} ms "
              f"after the first was sent; the last finished at {r['last_finished_ms']:.1f} ms, its answer "
              f"built at {r['last_answered_ms']:.1f}, back at {r['last_back_ms']:.1f}")  # fmt: skip
    if "gc_ms" in r:
        print(f"{'':10} garbage collector: server {r['server_gc_ms']:.1f} ms (collections by generation "
              f"{r['server_gc_collections']}), client {r['gc_ms']:.1f} ms ({r['gc_collections']})")  # fmt: skip
    cpu = ", ".join(f"{label} {r[key]:.2f}" for key, label in _CPU_LABELS.items() if key in r)
    print(f"{'':10} CPU ms/step: {cpu}")
    steady = [f"{_CPU_LABELS[key]} {r['steady_' + key]:.2f}" for key in _CPU_LABELS if "steady_" + key in r]
    if steady:
        print(f"{'':10} CPU ms/step in the steady phase: {', '.join(steady)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="concurrent requests")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument(
        "--new-tokens", type=int, default=256, help="max_new_tokens of every request (EOS ignored)"
    )
    p.add_argument(
        "--min-new-tokens", type=int, default=None,
        help="spread max_new_tokens over [this, --new-tokens] (finishes spread out, as in a real rollout)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size")
    p.add_argument("--group-size", type=int, default=1,
                   help="samples per batch request (the rollout sends one per prompt group: 8 in loop_step)")  # fmt: skip
    p.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="emulated GPU time per step (0: none; ~3 for the 0.5B model at batch 256 on the H200)",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for this (server) process; default: Python's (5 ms)",
    )
    p.add_argument(
        "--schedule", choices=("overlap", "plain"), default="overlap", help="stub engine's schedule"
    )
    p.add_argument(
        "--shape",
        choices=("0.5b", "1.5b", "tiny"),
        default=None,
        help="GPU: a real engine on a random-weight model of this shape (bench/engine_throughput.py's)",
    )
    p.add_argument("--device", default="cuda", help="--shape: the real engine's device (cpu: a smoke test)")
    p.add_argument("--workdir", default="/tmp/clawrl-bench-engine", help="--shape: checkpoint directory")
    p.add_argument("--repeats", type=int, default=3, help="runs of each path, alternating; all are printed")
    p.add_argument(
        "--connections",
        choices=("warm", "cold"),
        default="warm",
        help="warm: the client opens its connections before the timed rollout, as a loop's later "
        "rollouts find them; cold: it opens them during the rollout, as a first rollout does",
    )
    p.add_argument("--profile", action="store_true", help="cProfile the server threads (HTTP runs)")
    p.add_argument("--json-out", help="write every run's numbers and the HTTP medians here")
    p.add_argument("--top", type=int, default=25, help="--profile rows per table")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of one HTTP run")
    p.add_argument("--client-url", help=argparse.SUPPRESS)  # internal: run as the client subprocess
    args = p.parse_args()
    if args.client_url:
        client_main(args.client_url, args)
        return
    if args.shape is not None and args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            "--shape runs a real engine on the GPU; this machine has no CUDA device (--device cpu: smoke test)"
        )
    torch.set_num_threads(1)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    profiles = _ThreadProfiles() if args.profile else None
    print(
        f"batch {args.batch}, prompt {args.prompt_len}, new tokens {args.min_new_tokens or args.new_tokens}-"
        f"{args.new_tokens}, {args.schedule} schedule, device {args.device_ms} ms/step, "
        f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms"
    )
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        engines = _Engines(args, Path(tmp))
        for _ in range(args.repeats):
            for result in (run_inprocess(args, engines), run_http(args, engines, profiles)):
                _print(result)
                runs.append(result)
    for kind in ("in-process", "HTTP"):
        best = max((r for r in runs if r["kind"] == kind), key=lambda r: r["tok_per_s"])
        tok_s = sorted(r["tok_per_s"] for r in runs if r["kind"] == kind)
        print(
            f"{kind}: best {best['tok_per_s']:.0f} tok/s, median {tok_s[len(tok_s) // 2]:.0f} "
            f"({best['wall_ms_per_step']:.2f} ms/step at best)"
        )
    http = [r for r in runs if r["kind"] == "HTTP"]
    medians = {
        key: statistics.median(r[key] for r in http) for key in _PATH_KEYS if all(key in r for r in http)
    }
    if medians:
        print("HTTP medians: " + ", ".join(f"{key} {value:.1f}" for key, value in medians.items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs, "http_medians": medians},
                                                  indent=1))  # fmt: skip
    if profiles is not None:
        profiles.report(args.top)


if __name__ == "__main__":
    main()
