"""Engine throughput: the built-in engine vs transformers' generation modes on the same random-weight model.

A Qwen2.5-shaped checkpoint with random weights (config.json + bf16 safetensors + a local 8192-token BPE
tokenizer; the embedding keeps the real 151936 rows) is written under --workdir; nothing is downloaded.
All sides get the same random prompts (--prompt-len tokens each) and generate exactly --new-tokens tokens
(EOS disabled: eos_token_id None for `generate`, -1 for continuous batching; every output's length is
checked), sampling at temperature 1.0 with no top-k / top-p (or greedy with --greedy). The engine is
timed from the first add_request to the last token (prefill included; decode-only tok/s is reported too),
its prefix cache flushed before each timed generation so that no prompt block is reused from the warm-up.
The transformers peers (--peers, default all; bf16, sdpa), each timed the same way (one call, first prompt
in to last token out, prefill included):
  generate        one static batch through `generate`, default dynamic cache;
  static-compile  `generate` with cache_implementation="static", whose decode step transformers compiles
                  with torch.compile (its defaults: inductor, reduce-overhead);
  generate-batch  continuous batching with a paged KV cache: the manager `generate_batch` uses, kept open
                  so that its set-up and CUDA-graph capture stay out of the timing.
Each peer runs in its own process: a warm-up on other prompts (compilation, graph capture), a probe, then
the timed run. When the probe says the timed run would exceed --hf-max-seconds, the peer's new tokens are
cut (then its prompts); the table shows "N x T capped". A peer past --peer-timeout (load and compile
included) is killed. A failing peer prints "n/a (reason)" in its row and is listed in the JSON under
"peer_failures"; the run goes on. The engine's ratio is taken against the fastest peer that ran.

The decode roofline is the time to read, every decode step, all weight bytes plus the K/V bytes of every
sequence's current context at --hbm-tbs TB/s (H200: 4.19); results are given as a percentage of it.

--check first verifies on the GPU: the Triton decode kernel vs the fp32 torch reference on random data; the
fused Triton sampler vs the torch sampler; engine greedy tokens with CUDA graphs vs without (bit-identical
expected), engine fp32 vs transformers fp32 (identical expected) and engine bf16 vs transformers bf16
(fraction of matching tokens, and logprob differences while the tokens still agree).
It also times the decode-attention kernel alone for a few block sizes / warp counts.
--profile prints torch.profiler tables (top kernels by CUDA time) of one decode step of the first
configuration, with and without CUDA graphs.

The engine is timed with both schedules (--schedules): "overlap" (EngineConfig.enable_overlap_schedule: the
CPU schedules step t + 1 while the GPU runs step t) and "plain"; with the same seeds they must produce the
same tokens, which is checked and reported.

Every phase is isolated: a failure prints its traceback and the rest still runs. A summary table is printed
at the end and everything goes to --json-out.

Run on the H200 from the repository root (PYTHONPATH=., no pip install, no network; ~5-6 minutes with
--peers generate, of which ~1 minute is the first compilation of the Triton kernels; every further peer
adds its load, compilation / graph capture and runs, at most --peer-timeout per configuration):
    PYTHONPATH=. python bench/engine_throughput.py --check --suite --profile --peers generate --json-out $OUT/engine.json
All three peers, one configuration per call to stay inside a 10-minute command:
    PYTHONPATH=. python bench/engine_throughput.py --shape 0.5b --batch 256 --json-out $OUT/engine_peers.json
One configuration:
    PYTHONPATH=. python bench/engine_throughput.py --shape 0.5b --batch 256 --prompt-len 128 --new-tokens 256
CPU smoke test of the script itself (reference runner, no Triton):
    .venv/bin/python bench/engine_throughput.py --device cpu --shape tiny --batch 4 --new-tokens 8 --check
(~1.5 min on 2 CPU cores, most of it torch.compile of the static-compile peer; --peers generate to skip it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

SHAPES = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                 vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                 vocab_size=151936),
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                 vocab_size=8192),
}  # fmt: skip
SUITE = [("0.5b", 256), ("0.5b", 64), ("1.5b", 128)]
TOKENIZER_VOCAB = 8192
RESULTS: dict = {"runs": [], "check": {}, "errors": [], "peer_failures": []}


# -- checkpoints ---------------------------------------------------------------------------------------------


def build_checkpoint(out_dir: Path, shape: str, *, init_std: float, device: str, seed: int = 0) -> Path:
    """Write a random-weight Qwen2.5-style HF directory (bf16 safetensors, tied embeddings, qkv bias)."""
    from clawrl.models.config import ModelArgs
    from clawrl.models.decoder import CausalLM
    from clawrl.models.hf_io import save_hf
    from clawrl.models.tiny import build_tiny_tokenizer

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    tokenizer = build_tiny_tokenizer(TOKENIZER_VOCAB)
    args = ModelArgs(
        arch="qwen2", **SHAPES[shape], head_dim=SHAPES[shape]["hidden_size"] // SHAPES[shape]["num_heads"],
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
        qkv_bias=True, bos_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
        torch_dtype="bfloat16",
    )  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = CausalLM(args).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, init_std, generator=generator)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    free_memory()
    return out_dir


def random_prompts(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, TOKENIZER_VOCAB) for _ in range(prompt_len)] for _ in range(batch)]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- roofline -------------------------------------------------------------------------------------------------


def decode_roofline(shape: str, batch: int, prompt_len: int, new_tokens: int, hbm_tbs: float) -> dict:
    """Tokens/s if every decode step only read all weights and every sequence's K/V at hbm_tbs TB/s (bf16)."""
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_heads"]
    qkv = s["hidden_size"] * (s["num_heads"] + 2 * s["num_kv_heads"]) * head_dim
    per_layer = qkv + (s["num_heads"] + 2 * s["num_kv_heads"]) * head_dim  # + qkv bias
    per_layer += s["num_heads"] * head_dim * s["hidden_size"] + 3 * s["hidden_size"] * s["intermediate_size"]
    per_layer += 2 * s["hidden_size"]  # norms
    params = s["num_layers"] * per_layer + s["vocab_size"] * s["hidden_size"] + s["hidden_size"]
    weight_bytes = 2 * params
    kv_bytes_per_token = 2 * s["num_layers"] * s["num_kv_heads"] * head_dim * 2
    # Decode steps 1..new_tokens-1 (the first token comes out of prefill); step k reads contexts of P + k.
    steps = range(1, new_tokens)
    total_bytes = sum(weight_bytes + batch * (prompt_len + k) * kv_bytes_per_token for k in steps)
    seconds = total_bytes / (hbm_tbs * 1e12)
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "decode_tok_s": batch * len(steps) / seconds if seconds else float("nan"),
        "step_ms_mid": (weight_bytes + batch * (prompt_len + new_tokens // 2) * kv_bytes_per_token)
        / (hbm_tbs * 1e12)
        * 1e3,
    }


# -- our engine -----------------------------------------------------------------------------------------------


def make_engine(path: Path, args, *, max_running: int, dtype: str = "bfloat16", cuda_graph: bool = True):
    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine

    start = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model_path=str(path), device=args.device, dtype=dtype if args.device == "cuda" else "float32",
            max_running_requests=max_running, mem_fraction_static=args.mem_fraction_static,
            enable_cuda_graph=cuda_graph, num_kv_blocks=None if args.device == "cuda" else 4096,
            true_on_policy_mode=getattr(args, "true_on_policy", False),
        )
    )  # fmt: skip
    mode = ""
    if engine.config.true_on_policy_mode:
        from clawrl.models.batch_invariant import kernel_choices

        choices = kernel_choices(engine.model)
        on_cublas = sum(1 for kernel in choices.values() if kernel != "triton")
        mode = f", true-on-policy mode: {on_cublas} of {len(choices)} linears on cuBLAS"
        by_kind = {re.sub(r"\.\d+\.", ".*.", name): kernel for name, kernel in choices.items()}
        RESULTS.setdefault("true_on_policy_kernels", {})[path.name] = by_kind
    print(f"  engine ready in {time.perf_counter() - start:.1f} s "
          f"({engine.kv_cache.num_blocks} KV blocks, graphs {'on' if cuda_graph else 'off'}{mode})")  # fmt: skip
    return engine


def sampling_params(new_tokens: int, greedy: bool, seed: int):
    from clawrl.engine.core.request import SamplingParams

    return SamplingParams(
        max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0 if greedy else 1.0, seed=seed
    )


def timed_engine_run(engine, prompts: list[list[int]], new_tokens: int, greedy: bool) -> dict:
    """Generate through add_request/step; returns total and decode-only throughput and the outputs."""
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    # The warm-up and earlier repeats ran these very prompts: without the flush their K/V blocks would serve
    # most of this prefill from the prefix cache, which none of the transformers peers gets.
    flushed = engine.flush_cache()
    assert flushed, "requests left over from an earlier run"
    sync()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling_params(new_tokens, greedy, seed=i))
    prefill_done, tokens_at_prefill, num_steps = None, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        num_steps += 1
        if prefill_done is None and all(outputs.values()):
            prefill_done, tokens_at_prefill = time.perf_counter(), sum(map(len, outputs.values()))
    sync()
    end = time.perf_counter()
    total = sum(map(len, outputs.values()))
    assert total == len(prompts) * new_tokens, (
        f"generated {total} tokens, expected {len(prompts) * new_tokens}"
    )
    return {
        "seconds": end - start,
        "tok_s": total / (end - start),
        "prefill_s": prefill_done - start,
        "decode_tok_s": (total - tokens_at_prefill) / max(end - prefill_done, 1e-9),
        "steps": num_steps,
        "outputs": [outputs[f"r{i}"] for i in range(len(prompts))],
    }


def run_engine(path: Path, shape: str, batch: int, args) -> dict:
    """Each schedule ("overlap": EngineConfig.enable_overlap_schedule, "plain") timed on one engine; an engine
    whose run failed is replaced by a fresh one. Same seeds, so both schedules must give the same tokens."""
    prompts = random_prompts(batch, args.prompt_len)
    engine = make_engine(path, args, max_running=batch)
    results, outputs = {}, {}

    def timed(schedule: str) -> dict:
        engine.set_overlap_schedule(schedule == "overlap")
        for _ in range(args.warmup):  # compiles the prefill kernels at this batch's shapes
            timed_engine_run(engine, prompts, min(8, args.new_tokens), args.greedy)
        runs = [timed_engine_run(engine, prompts, args.new_tokens, args.greedy) for _ in range(args.repeats)]
        runs.sort(key=lambda run: run["tok_s"])
        median = runs[len(runs) // 2]  # one generation is ~0.5 s: single runs vary by several percent
        median["repeats_tok_s"] = [run["tok_s"] for run in runs]
        return median

    for schedule in args.schedules.split(","):
        results[schedule] = guarded(
            f"engine {shape} batch {batch}, {schedule} schedule", lambda s=schedule: timed(s)
        )
        if results[schedule] is None:
            engine = make_engine(path, args, max_running=batch)
            continue
        outputs[schedule] = results[schedule].pop("outputs")
        e = results[schedule]
        print(f"  engine ({schedule}): {e['tok_s']:,.0f} tok/s total, {e['decode_tok_s']:,.0f} tok/s decode, "
              f"prefill {e['prefill_s']:.2f} s, {e['steps']} steps")  # fmt: skip
    if len(outputs) == 2:
        agreement = token_agreement(*outputs.values())
        results["schedules_agree"] = {"fraction": agreement["fraction"], "identical": agreement["identical"]}
        print(f"  overlap vs plain schedule: {agreement['fraction']:.4f} of tokens identical")
    if args.profile and not RESULTS.get("profiled") and args.device == "cuda":  # the first configuration only
        RESULTS["profiled"] = f"{shape} batch {batch}"
        engine.set_overlap_schedule(False)
        guarded(f"profile {shape} batch {batch}", lambda: profile_decode_step(engine, prompts, args))
    return results  # the engine is freed by the caller's free_memory() once this frame is gone


def profile_decode_step(engine, prompts: list[list[int]], args) -> None:
    """torch.profiler tables of one decode step in steady state, with CUDA graphs and eagerly."""
    from torch.profiler import ProfilerActivity, profile

    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, sampling_params(64, args.greedy, seed=i))
    for _ in range(12):  # prefill (chunked over ~5 steps at batch 256) and a few decode steps
        engine.step()
    runner = engine.runner
    for graphs in (True, False):
        runner.enable_cuda_graph = graphs and hasattr(runner, "_graphs") and bool(runner._graphs)
        engine.step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
        print(
            f"\n== profile: one decode step of {len(prompts)} sequences, CUDA graphs {'on' if graphs else 'off'}"
        )
        print(profiler_table(prof))
    runner.enable_cuda_graph = True
    for i in range(len(prompts)):
        engine.abort_request(f"p{i}")
    while engine.has_unfinished_requests():
        engine.step()


def profiler_table(prof) -> str:
    for key in ("self_cuda_time_total", "self_device_time_total", "cuda_time_total", "device_time_total"):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)
        except Exception:  # the sort key was renamed across torch releases
            continue
    return prof.key_averages().table(row_limit=25)


# -- transformers ---------------------------------------------------------------------------------------------


def load_hf(path: Path, device: str, dtype: torch.dtype, *, attention: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
    return model.to(device).eval()


def hf_generation_config(model, new_tokens: int, greedy: bool, *, scores: bool = False):
    """Exactly new_tokens per sequence, same sampling rule as the engine: no EOS (continuous batching needs
    -1 instead of None, see cb_generator), temperature 1.0 without top-k / top-p, or greedy."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.pad_token_id = 0
    config.max_new_tokens = new_tokens
    config.min_new_tokens = None
    config.do_sample = not greedy
    config.temperature, config.top_k, config.top_p = 1.0, 0, 1.0
    # A returned dict keeps the cache alive and makes generate check stop criteria every step.
    config.return_dict_in_generate, config.output_logits = scores, scores
    return config


def hf_generate(model, prompts: list[list[int]], new_tokens: int, greedy: bool, *, scores: bool = False,
                static_cache_len: int | None = None):  # fmt: skip
    """One static batch through `generate`; with static_cache_len, a static KV cache of that many positions,
    whose decode step transformers compiles itself (its documented recipe: cache_implementation="static")."""
    config = hf_generation_config(model, new_tokens, greedy, scores=scores)
    if static_cache_len is not None:
        config.cache_implementation = "static"
        # Sized for the longest call from the first one, so that the short warm-up compiles the shapes the
        # timed run uses: newer releases read max_cache_len, all keep the largest size seen on the model.
        config.max_cache_len = static_cache_len
        model._previous_max_cache_length = max(
            static_cache_len, getattr(model, "_previous_max_cache_length", 0)
        )
        if model.device.type == "cpu":  # transformers compiles on CUDA only unless told otherwise
            from transformers import CompileConfig

            config.compile_config = CompileConfig(mode="default")
            config.compile_config._compile_all_devices = True
    input_ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    sequences = out.sequences if scores else out
    new = sequences[:, input_ids.shape[1] :]
    assert new.shape[1] == new_tokens, f"transformers generated {new.shape[1]} tokens, expected {new_tokens}"
    return new.tolist(), (torch.stack(out.logits, dim=1) if scores else None)


# -- transformers peers -----------------------------------------------------------------------------------------
# Each peer runs in its own process under a wall-clock deadline (--peer-timeout): a compile that hangs or a
# crash that leaves CUDA in a bad state costs that peer's row only, never the run or the device budget.

PEERS = ("generate", "static-compile", "generate-batch")
PEER_HELP = {
    "generate": "generate, default dynamic cache",
    "static-compile": 'generate, cache_implementation="static" + torch.compile of the decode step',
    "generate-batch": "continuous batching (generate_batch's manager), paged KV cache",
}
CB_ATTENTIONS = ("sdpa", "paged|sdpa")  # newer releases take "sdpa" for paged batches, older ones the prefix


def plan_peer_work(batch: int, new_tokens: int, probe_tokens: int, probe_seconds: float,
                   cap_seconds: float) -> tuple[int, int]:  # fmt: skip
    """(prompts, new tokens) whose timed run should fit cap_seconds, from a probe of probe_tokens tokens on
    all prompts. New tokens are cut first (the batch, which sets the throughput, stays), down to
    probe_tokens; prompts only when even that is over the cap (time assumed proportional to both)."""
    estimate = probe_seconds * new_tokens / probe_tokens
    if estimate <= cap_seconds:
        return batch, new_tokens
    tokens = max(probe_tokens, int(new_tokens * cap_seconds / estimate))
    at_tokens = probe_seconds * tokens / probe_tokens
    prompts = batch if at_tokens <= cap_seconds else max(1, int(batch * cap_seconds / at_tokens))
    return prompts, tokens


def timed_generation(generate, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    sync()
    start = time.perf_counter()
    outputs = generate(prompts, new_tokens)
    sync()
    seconds = time.perf_counter() - start
    lengths = {len(out) for out in outputs}
    if len(outputs) != len(prompts) or lengths != {new_tokens}:
        raise RuntimeError(f"{len(outputs)} outputs of lengths {sorted(lengths)} for {len(prompts)} prompts "
                           f"x {new_tokens} tokens")  # fmt: skip
    return seconds, outputs


def time_peer(generate, prompts: list[list[int]], new_tokens: int, cap_seconds: float) -> dict:
    """Warm-up (compilation, graph capture), a probe, the plan under the cap, then the timed run: tok/s is
    generated tokens over the wall time of the one call, prefill included, as for the engine. Warm-up
    prompts differ from the timed ones so that no prefix cache can serve the timed prefill."""
    probe = min(16, new_tokens)
    warm = random_prompts(len(prompts), len(prompts[0]), seed=1)
    warmup_s, _ = timed_generation(generate, warm, probe)
    probe_s, _ = timed_generation(generate, warm, probe)
    num_prompts, num_tokens = plan_peer_work(len(prompts), new_tokens, probe, probe_s, cap_seconds)
    if num_prompts < len(prompts):  # a new batch shape: compile / capture it before timing
        timed_generation(generate, warm[:num_prompts], probe)
    seconds, _ = timed_generation(generate, prompts[:num_prompts], num_tokens)
    return {"tok_s": num_prompts * num_tokens / seconds, "seconds": seconds, "num_prompts": num_prompts,
            "new_tokens": num_tokens, "capped": (num_prompts, num_tokens) != (len(prompts), new_tokens),
            "warmup_s": warmup_s, "probe_s": probe_s}  # fmt: skip


@contextlib.contextmanager
def cb_generator(model, greedy: bool, max_tokens: int, batch: int, max_len: int):
    """Yields generate(prompts, n) over one continuous-batching manager (the one generate_batch builds and
    tears down per call; kept open here so its set-up and CUDA-graph warm-up stay out of the timing)."""
    config = hf_generation_config(model, max_tokens, greedy)
    config.eos_token_id = -1  # None would fall back to the model's EOS
    kwargs = {"generation_config": config, "block": True, "timeout": 30}
    cb_config = cb_batching_config(model.device.type, batch, max_len)
    if cb_config is not None:
        kwargs["continuous_batching_config"] = cb_config
    counter = iter(range(1 << 62))
    with model.continuous_batching_context_manager(**kwargs) as manager:

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            ids = [f"q{next(counter)}" for _ in prompts]
            for request_id, prompt in zip(ids, prompts, strict=True):
                manager.add_request(prompt, request_id=request_id, max_new_tokens=n, eos_token_id=-1)
            return cb_collect(manager, ids)

        yield generate


def cb_batching_config(device: str, batch: int, max_len: int):
    """CUDA: the library's own sizing (from free memory). CPU: a small cache, as the automatic sizing has no
    memory figure there and takes tens of seconds."""
    import dataclasses

    if device != "cpu":
        return None
    from transformers.generation import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = {"page_size": 16} if "page_size" in names else {"block_size": 16}  # renamed in 5.17
    blocks = batch * (-(-max_len // 16) + 1)  # every sequence's longest context, in 16-token pages
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=512, **page)


def cb_collect(manager, ids: list[str]) -> list[list[int]]:
    done: dict = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous-batching generation thread stopped (its log is above)")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
    return [done[request_id] for request_id in ids]


def run_peer(name: str, path: Path, batch: int, args) -> dict:
    """One peer on the same prompts and lengths as the engine (in the worker process)."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    prompts = random_prompts(batch, args.prompt_len)
    if name == "generate":
        model = load_hf(path, args.device, dtype)
        generate = lambda p, n: hf_generate(model, p, n, args.greedy)[0]  # noqa: E731
        return time_peer(generate, prompts, args.new_tokens, args.hf_max_seconds)
    if name == "static-compile":
        model = load_hf(path, args.device, dtype)
        max_cache_len = args.prompt_len + args.new_tokens
        generate = lambda p, n: hf_generate(model, p, n, args.greedy, static_cache_len=max_cache_len)[0]  # noqa: E731
        return time_peer(generate, prompts, args.new_tokens, args.hf_max_seconds)
    failures = []
    for attention in CB_ATTENTIONS:
        try:
            model = load_hf(path, args.device, dtype, attention=attention)
            max_len = args.prompt_len + args.new_tokens
            with cb_generator(model, args.greedy, args.new_tokens, batch, max_len) as generate:
                result = time_peer(generate, prompts, args.new_tokens, args.hf_max_seconds)
                result["attention"] = model.config._attn_implementation  # what the manager switched to
            return {**result, "earlier_failures": failures}
        except Exception as exc:  # noqa: BLE001 - the next attention name may be the one this release takes
            traceback.print_exc()
            failures.append(f"{attention}: {type(exc).__name__}: {exc}"[:300])
            free_memory()
    raise RuntimeError("; ".join(failures))


def run_peer_process(name: str, path: Path, batch: int, args) -> dict:
    """The peer in a child process of this script, killed (its process group) at --peer-timeout seconds.
    Returns its result, or {"error": reason}."""
    out = Path(args.workdir) / f"peer-{name}-{batch}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-worker", name, "--peer-model", str(path),
           "--peer-out", str(out), "--batch", str(batch), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--device", args.device,
           "--hf-max-seconds", str(args.hf_max_seconds), "--workdir", args.workdir]  # fmt: skip
    cmd += ["--greedy"] if args.greedy else []
    start = time.perf_counter()
    child = subprocess.Popen(cmd, start_new_session=True)  # its own group: compile workers die with it
    try:
        returncode = child.wait(timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"error": f"timed out after {args.peer_timeout:.0f} s (--peer-timeout)"}
    except BaseException:  # Ctrl-C or a signal to this process: its own session would outlive it otherwise
        os.killpg(child.pid, signal.SIGKILL)
        raise
    if out.is_file():
        result = json.loads(out.read_text())
    else:
        result = {"error": f"worker exited with code {returncode} (its traceback is above)"}
    result["process_s"] = time.perf_counter() - start
    return result


def peer_worker(args) -> int:
    """--peer-worker: one peer, its result (or its error) written to --peer-out."""
    try:
        result = run_peer(args.peer_worker, Path(args.peer_model), args.batch, args)
    except Exception as exc:  # noqa: BLE001 - the reason goes to the parent's table
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    Path(args.peer_out).write_text(json.dumps(result, default=str))
    return 0


# -- correctness checks ---------------------------------------------------------------------------------------


def check_decode_kernel(args) -> dict:
    from clawrl.engine.runner.triton_attention import paged_attention_reference, paged_decode_attention

    generator = torch.Generator().manual_seed(0)
    num_seqs, page, hkv, hq, d = 64, 16, 2, 14, 64
    ctx = torch.randint(1, 600, (num_seqs,), generator=generator)
    blocks = (ctx + page - 1) // page
    k_cache = torch.randn(int(blocks.sum()) + 1, page, hkv, d, generator=generator).to("cuda", torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=generator).to("cuda", torch.bfloat16)
    order = torch.randperm(int(blocks.sum()), generator=generator)
    tables = torch.zeros(num_seqs, int(blocks.max()), dtype=torch.int32)
    offsets = torch.cumsum(blocks, 0) - blocks
    for s in range(num_seqs):
        tables[s, : blocks[s]] = order[offsets[s] : offsets[s] + blocks[s]]
    tables = tables.cuda()
    q = torch.randn(num_seqs, hq, d, generator=generator).to("cuda", torch.bfloat16)
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, list(range(num_seqs + 1)), ctx.tolist(), 0.125
    )
    result = {}
    for splits in (1, 4):
        got = paged_decode_attention(
            q, k_cache, v_cache, tables, ctx.cuda(), 0.125, num_splits=splits
        ).float()
        rel = ((got - want).norm() / want.norm()).item()
        result[f"splits_{splits}"] = {"max_abs_err": (got - want).abs().max().item(), "rel_err": rel}
    result["ok"] = all(r["rel_err"] < 1e-2 for r in result.values())
    result["timing"] = time_decode_kernel()
    return result


def time_decode_kernel() -> dict:
    """Microseconds and achieved K/V GB/s of one decode-attention layer at the 0.5B shape, batch 256,
    context 256, for a few (block_n, num_warps) choices (the engine's default is block_n 64, 4 warps)."""
    from clawrl.engine.runner.triton_attention import paged_decode_attention

    num_seqs, ctx, page, hkv, hq, d, num_layers = 256, 256, 16, 2, 14, 64, 8
    blocks_per_seq = ctx // page
    shape = (num_seqs * blocks_per_seq + 1, page, hkv, d)
    # Eight "layers" (33 MB of K/V each) taken in turn, so that no call finds its K/V in the 50 MB L2.
    caches = [
        tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        for _ in range(num_layers)
    ]
    tables = torch.randperm(num_seqs * blocks_per_seq, device="cuda").view(num_seqs, blocks_per_seq).int()
    q = torch.randn(num_seqs, hq, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((num_seqs,), ctx, device="cuda")
    kv_bytes = 2 * num_seqs * ctx * hkv * d * 2
    timings = {}
    for block_n, warps in ((64, 4), (32, 4), (32, 2), (16, 2), (64, 8)):
        run = functools.partial(paged_decode_attention, block_n=block_n, num_warps=warps)
        try:
            for k_cache, v_cache in caches:
                run(q, k_cache, v_cache, tables, lens, 0.125)
            sync()
            start = time.perf_counter()
            for i in range(48):
                k_cache, v_cache = caches[i % num_layers]
                run(q, k_cache, v_cache, tables, lens, 0.125)
            sync()
        except Exception as exc:  # noqa: BLE001 - a knob setting that does not compile is a result too
            timings[f"block_n={block_n},warps={warps}"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        micros = (time.perf_counter() - start) / 48 * 1e6
        timings[f"block_n={block_n},warps={warps}"] = {"us": micros, "GB_s": kv_bytes / micros / 1e3}
    print("  decode attention, batch 256 x context 256, one layer:", json.dumps(timings))
    return timings


def check_sampler(args) -> dict:
    from clawrl.engine.core.request import SamplingParams
    from clawrl.engine.runner.sampler import sample

    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, SHAPES["0.5b"]["vocab_size"], generator=generator) * 3).to(
        "cuda", torch.bfloat16
    )
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3]) for i in range(64)]
    seeds, steps = list(range(64)), [i * 7 for i in range(64)]
    fused = sample(logits, params, seeds, steps, fused=True)
    reference = sample(logits, params, seeds, steps, fused=False)
    agree = (fused[0] == reference[0]).float().mean().item()
    diff = (fused[1] - reference[1]).abs().max().item()
    return {"token_agreement": agree, "max_logprob_diff": diff, "ok": agree >= 0.98 and diff < 1e-3}


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y), len(ra))
        for ra, rb in zip(a, b, strict=True)
    ]
    return {"fraction": same / sum(map(len, a)), "common_prefix": prefix, "identical": a == b}


def check_engine(path: Path, args) -> dict:
    """Greedy engine tokens: graphs vs eager (bf16), engine vs transformers (fp32 and bf16)."""
    prompts, new_tokens, result = random_prompts(8, 32, seed=5), 32, {}
    runs = {}
    for name, dtype, graphs in (("bf16_graph", "bfloat16", True), ("bf16_eager", "bfloat16", False),
                                ("fp32_graph", "float32", True)):  # fmt: skip
        engine = make_engine(path, args, max_running=8, dtype=dtype, cuda_graph=graphs)
        runs[name] = engine.generate(prompts, sampling_params(new_tokens, True, 0))
        del engine
        free_memory()
    ids = {name: [r["output_ids"] for r in out] for name, out in runs.items()}
    result["graph_vs_eager"] = token_agreement(ids["bf16_graph"], ids["bf16_eager"])
    result["distinct_tokens"] = len({t for row in ids["bf16_graph"] for t in row})
    first_lp = {}  # (side, dtype) -> first-token log-probs of each row's fp32 greedy token
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_hf(path, args.device, dtype)
        hf_ids, logits = hf_generate(model, prompts, new_tokens, True, scores=True)
        del model
        free_memory()
        ours = runs[f"{dtype_name}_graph"]
        agreement = token_agreement([r["output_ids"] for r in ours], hf_ids)
        hf_logprobs = torch.log_softmax(logits.float(), dim=-1)
        first_lp["hf", dtype_name] = [
            hf_logprobs[row, 0, r["output_ids"][0]].item() for row, r in enumerate(runs["fp32_graph"])
        ]
        diffs = []
        for row, (r, prefix) in enumerate(zip(ours, agreement["common_prefix"], strict=True)):
            for t in range(min(prefix + 1, new_tokens)):  # up to and including the first disagreement
                diffs.append(abs(r["logprobs"][t] - hf_logprobs[row, t, r["output_ids"][t]].item()))
        agreement["max_logprob_diff_on_common_prefix"] = max(diffs)
        agreement["first_token_max_logprob_diff"] = max(
            abs(r["logprobs"][0] - hf_logprobs[row, 0, r["output_ids"][0]].item())
            for row, r in enumerate(ours)
        )
        result[f"engine_vs_hf_{dtype_name}"] = agreement
    result["bf16_error"] = bf16_error(runs, first_lp)
    # bf16 against bf16 compares two roundings of a random 24-layer model; what must hold is that the engine's
    # bf16 is no further from the fp32 truth than transformers' own bf16 is.
    result["ok"] = (
        result["graph_vs_eager"]["identical"]
        and result["engine_vs_hf_fp32"]["fraction"] > 0.9
        and result["bf16_error"]["engine"] <= 2 * result["bf16_error"]["hf"] + 0.02
    )
    return result


def bf16_error(runs: dict, first_lp: dict) -> dict:
    """Max |bf16 - fp32| of the first token's log-prob, engine and transformers each against their own fp32,
    on the rows whose bf16 engine picked the fp32 token (the engine reports only its own token's log-prob)."""
    fp32, bf16 = runs["fp32_graph"], runs["bf16_graph"]
    rows = [
        i for i, (a, b) in enumerate(zip(fp32, bf16, strict=True)) if a["output_ids"][0] == b["output_ids"][0]
    ]
    engine = [abs(bf16[i]["logprobs"][0] - fp32[i]["logprobs"][0]) for i in rows]
    hf = [abs(first_lp["hf", "bf16"][i] - first_lp["hf", "fp32"][i]) for i in range(len(fp32))]
    return {"engine": max(engine, default=float("nan")), "hf": max(hf), "rows_compared": len(rows)}


# -- driver ---------------------------------------------------------------------------------------------------


def guarded(name: str, fn):
    """Run one phase; a failure is printed and recorded, and the benchmark goes on."""
    print(f"\n### {name}", flush=True)
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every phase must be isolated
        traceback.print_exc()
        RESULTS["errors"].append({"phase": name, "error": f"{type(exc).__name__}: {exc}"})
        print(f"!!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
        free_memory()
        return None


def run_config(shape: str, batch: int, args, workdir: Path) -> None:
    path = guarded(f"build {shape} checkpoint", lambda: build_checkpoint(
        workdir / f"random-{shape}", shape, init_std=0.02, device=args.device))  # fmt: skip
    if path is None:
        return
    row = {"shape": shape, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "sampling": "greedy" if args.greedy else "temperature 1.0"}  # fmt: skip
    row["roofline"] = decode_roofline(shape, batch, args.prompt_len, args.new_tokens, args.hbm_tbs)
    row["engine"] = guarded(f"engine {shape} batch {batch}", lambda: run_engine(path, shape, batch, args))
    free_memory()
    row["peers"] = {}
    for name in args.peers:
        print(f"\n### transformers {name} {shape} batch {batch} (own process)", flush=True)
        result = run_peer_process(name, path, batch, args)
        row["peers"][name] = result
        print(f"  transformers {name}: {peer_cell(result)}")
        if "error" in result:
            RESULTS["peer_failures"].append({"config": f"{shape} batch {batch}", "peer": name,
                                             "error": result["error"]})  # fmt: skip
    row["hf"] = row["peers"].get("generate")  # the key earlier JSON files used for this peer
    RESULTS["runs"].append(row)
    write_json(args)


def peer_cell(result: dict | None) -> str:
    """A peer's table cell: its tok/s and, when the time cap cut its work, prompts x new tokens run."""
    if not result:
        return "not run"
    if "error" in result:
        return f"n/a ({result['error'][:60]})"
    work = f" ({result['num_prompts']} x {result['new_tokens']} capped)" if result.get("capped") else ""
    return f"{result['tok_s']:,.0f}{work}"


def best_peer(peers: dict) -> tuple[str, float]:
    """The fastest peer that ran, ("-", nan) when none did: the engine's ratio is taken against it."""
    ran = {name: r["tok_s"] for name, r in peers.items() if r and "tok_s" in r}
    if not ran:
        return "-", float("nan")
    name = max(ran, key=ran.get)
    return name, ran[name]


def print_summary() -> None:
    print("\n" + "=" * 126)
    print(f"{'shape':6} {'batch':>5} {'schedule':>8} {'engine tok/s':>13} {'decode tok/s':>13} {'prefill s':>9} "
          f"{'peer tok/s':>10} {'ratio':>7} {'roofline tok/s':>15} {'% roof (tot/dec)':>17}")  # fmt: skip
    for row in RESULTS["runs"]:
        for schedule, engine in (row.get("engine") or {"-": None}).items():
            if schedule != "schedules_agree":
                print_row(row, schedule, engine or {})
    print(
        "(peer = the fastest transformers peer that ran in this run, * = its work was capped; ratio = engine "
        "/ peer; each peer below)"
    )
    print_peers()


def print_row(row: dict, schedule: str, engine: dict) -> None:
    roof, nan = row["roofline"], float("nan")
    tok, dec, prefill = (
        engine.get("tok_s", nan),
        engine.get("decode_tok_s", nan),
        engine.get("prefill_s", nan),
    )
    best, peer_tok = best_peer(row.get("peers") or {})
    capped = "*" if (row.get("peers") or {}).get(best, {}).get("capped") else ""
    pct = f"{100 * tok / roof['decode_tok_s']:.1f}/{100 * dec / roof['decode_tok_s']:.1f}"
    print(f"{row['shape']:6} {row['batch']:>5} {schedule:>8} {tok:>13,.0f} {dec:>13,.0f} {prefill:>9.2f} "
          f"{peer_tok:>9,.0f}{capped:1} {tok / peer_tok:>7.1f} {roof['decode_tok_s']:>15,.0f} {pct:>17}")  # fmt: skip


def peer_rows(row: dict) -> list[str]:
    """The peers table's lines of one configuration, each peer's ratio against the engine's best schedule."""
    engine = [e["tok_s"] for k, e in (row.get("engine") or {}).items() if k != "schedules_agree" and e]
    engine_tok = max(engine, default=float("nan"))
    best, _ = best_peer(row.get("peers") or {})
    lines = []
    for name, result in (row.get("peers") or {}).items():
        ratio = f"{engine_tok / result['tok_s']:.1f}x" if result and "tok_s" in result else "-"
        mark = " (best)" if name == best else ""
        lines.append(f"{row['shape']:6} {row['batch']:>5} {name + mark:22} {peer_cell(result):48} {ratio:>8}")
    return lines


def print_peers() -> None:
    if not any(row.get("peers") for row in RESULTS["runs"]):
        return
    print(f"\n{'shape':6} {'batch':>5} {'transformers peer':22} {'tok/s':48} {'engine/peer':>8}")
    for row in RESULTS["runs"]:
        for line in peer_rows(row):
            print(line)
    for name in dict.fromkeys(name for row in RESULTS["runs"] for name in row.get("peers") or {}):
        print(f"  {name}: {PEER_HELP[name]}")
    print("  (N x T capped: the peer ran N prompts x T new tokens to stay within --hf-max-seconds)")


def print_checks() -> None:
    for name, check in RESULTS["check"].items():
        print(f"check {name}: {'OK' if check and check.get('ok') else 'FAILED'} {json.dumps(check)[:300]}")
    for error in RESULTS["errors"]:
        print(f"ERROR in {error['phase']}: {error['error']}")
    for failure in RESULTS["peer_failures"]:
        print(f"peer n/a: {failure['peer']} ({failure['config']}): {failure['error']}")


def write_json(args) -> None:
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="model shape")
    p.add_argument("--batch", type=int, default=256, help="concurrent prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt (EOS ignored)")
    p.add_argument(
        "--suite", action="store_true", help=f"run {SUITE} (shape, batch) instead of --shape/--batch"
    )
    p.add_argument("--peers", type=peer_list, default=",".join(PEERS),
                   help=f"transformers peers to time, comma-separated, from {','.join(PEERS)}, or none")  # fmt: skip
    p.add_argument("--skip-hf", action="store_true", help="run no transformers peer (--peers none)")
    p.add_argument("--check", action="store_true", help="correctness checks first (module docstring)")
    p.add_argument("--profile", action="store_true",
                   help="print profiler tables of one decode step (first configuration)")  # fmt: skip
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of temperature-1 sampling")
    p.add_argument("--true-on-policy", action="store_true",
                   help="the engine in --true-on-policy-mode (batch-invariant kernels): its cost at this batch")  # fmt: skip
    p.add_argument("--warmup", type=int, default=1, help="short warm-up generations before timing")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed generations per schedule; the median is reported"
    )
    p.add_argument("--schedules", default="overlap,plain",
                   help="engine schedules to time: overlap (EngineConfig.enable_overlap_schedule) and/or plain")  # fmt: skip
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: smoke-test this script")
    p.add_argument(
        "--mem-fraction-static", type=float, default=0.6, help="engine weights + KV-cache fraction"
    )
    p.add_argument("--hf-max-seconds", type=float, default=60.0,
                   help="each peer's timed run is cut (new tokens, then prompts) to fit this, from a probe")  # fmt: skip
    p.add_argument("--peer-timeout", type=float, default=300.0,
                   help="wall-clock deadline per peer and config, load + compile + warm-up included")  # fmt: skip
    p.add_argument("--peer-worker", choices=PEERS, help=argparse.SUPPRESS)  # internal: the peer's process
    p.add_argument("--peer-model", help=argparse.SUPPRESS)
    p.add_argument("--peer-out", help=argparse.SUPPRESS)
    p.add_argument("--hbm-tbs", type=float, default=4.19, help="HBM bandwidth for the roofline, TB/s")
    p.add_argument("--workdir", default="/tmp/clawrl-bench-engine", help="where checkpoints are written")
    p.add_argument("--json-out", default=None, help="write all results as JSON here")
    args = p.parse_args(argv)
    if args.skip_hf:
        args.peers = []
    return args


def peer_list(text: str) -> list[str]:
    """--peers: names from PEERS, comma-separated, or "none"."""
    names = [] if text.strip() == "none" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)} or none")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer_worker:
        return peer_worker(args)
    workdir = Path(args.workdir)
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, device {args.device}", flush=True)
    if args.device == "cuda" and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}")
    RESULTS["args"] = vars(args)
    if args.check:
        if args.device == "cuda":
            RESULTS["check"]["decode_kernel"] = guarded(
                "check: Triton decode kernel", lambda: check_decode_kernel(args)
            )
            RESULTS["check"]["sampler"] = guarded("check: Triton sampler", lambda: check_sampler(args))
        shape = "tiny" if args.shape == "tiny" else "0.5b"
        path = guarded("build check checkpoint", lambda: build_checkpoint(
            workdir / f"check-{shape}", shape, init_std=0.05, device=args.device, seed=1))  # fmt: skip
        if path is not None:
            RESULTS["check"]["engine"] = guarded("check: engine tokens", lambda: check_engine(path, args))
        write_json(args)
    configs = SUITE if args.suite else [(args.shape, args.batch)]
    for shape, batch in configs:
        run_config(shape, batch, args, workdir)
    print_summary()
    print_checks()
    write_json(args)
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
