"""One RL step of the real loop, phase by phase, beside the standalone benchmark of each part in the same run.

For each shape (--shapes) and placement (--modes) this runs the real `clawrl train` (Ray, an engine actor
serving HTTP, an FSDP2 trainer actor, weight sync) on a random-weight checkpoint (bench/engine_throughput.py's
builder) with the demo's arithmetic prompts (bench/gpu_smoke.py's data) and a reward that varies between
samples (tests/integration/loop_reward.py), so every step updates the weights. Rollout 0 is a warm-up
(kernel compilation, allocator growth) and is left out; the other rollouts' phases are medians. Placements:

  colocate     --colocate: engine and trainer share the GPU and take turns; the engine releases its memory
               for each train step; the trainer's state comes back while the first rollout generates and
               then stays, where the GPU has room for it beside the engine (else it offloads every step)
  colocate-late-onload
               --colocate --disable-onload-during-rollout: the trainer offloads after every step and onloads
               only after the engine released its memory
  no-offload   --colocate --no-offload-train --no-offload-rollout: both stay resident on the one GPU (what
               "split" can be on a single GPU: clawrl's split placement needs trainer GPUs + engine GPUs)
  split        trainer and engine on GPUs of their own (needs >= 2 GPUs; "n/a" otherwise)
  colocate-true-on-policy
               --colocate --true-on-policy-mode: the batch-invariant kernels on both sides; the run's largest
               train/train_rollout_logprob_abs_diff is printed (0 when the mode holds)

On CPU every placement is clawrl's cpu mode (one trainer process, one engine process): one run, mode "cpu".

Phases, from the run's metrics.jsonl (step time = the time between two consecutive metric lines):
rollout (its ramp, steady decode, tail and reward parts: clawrl/rollout/timeline.py), engine memory release,
trainer onload, log_probs, ref_log_probs, actor_train, trainer offload, the rest of the train call (Ray
transfer, advantages), weight sync, engine resume and the rest of the step (driver, logging). Beside each
part, the same work measured alone in this process after the loop ended, on the loop's rollout rebuilt (its
first prompts through the same dataset code and chat template, each sample with the loop's mean response
length of random tokens; a --save-debug-rollout-data dump would add its write to the loop's step):
  rollout        bench/engine_throughput.py's in-process engine on those prompts, all at once, at that response
                 length (EOS ignored); its prefill time (until every sequence has a token) is in the JSON
  log-prob passes, actor_train
                 the loop's TrainActor configuration (the same flags) on that batch, in this process, as
                 bench/train_throughput.py measures it (perf/*_time of `train()`, after one warm-up call)
  weight sync    bench/weight_sync.py's engine subprocess and colocated sender, fed by that TrainActor's
                 `weight_buckets` (the loop's export path), one sender reused across syncs
Parts without a standalone benchmark (reward, memory release/resume, offload/onload) say "n/a".
loop efficiency = (sum of the standalone times) / (step time): 1.0 when the loop adds nothing to its parts.

Also per rollout (warm-up included): the engine's steps and its counters in ms per step (busy: inside its
step; cpu: the engine thread's CPU in it; gpu_wait: blocked on the GPU; gpu: the steps' span on the GPU;
process_cpu: all the engine process's threads), so a step that drifts from rollout to rollout shows where;
and the engine thread's seconds idle (waiting for a request) and applying commands (adding requests): the
rollout's time outside those and the steps is outside the engine thread (HTTP, the rollout manager).

Writes the markdown tables to stdout and everything to --json-out.

Run (H200, from the repository root; ray, fastapi, uvicorn carried as for bench/gpu_smoke.py):
    PYTHONPATH=. python bench/loop_step.py --json-out $OUT/loop_step.json
    PYTHONPATH=. python bench/loop_step.py --shapes 0.5b --modes colocate --num-rollout 4
Run (CPU check of the script, < 3 min on 2 cores):
    .venv/bin/python bench/loop_step.py --shapes tiny --device cpu --json-out /tmp/loop_step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
REWARD = ROOT / "tests" / "integration" / "loop_reward.py"


@dataclass(kw_only=True)
class Workload:
    """One rollout's size for a shape."""

    prompts: int
    """--rollout-batch-size."""
    samples: int
    """--n-samples-per-prompt."""
    response_len: int
    """--rollout-max-response-len."""
    max_tokens_per_gpu: int
    """--max-tokens-per-gpu (micro-batch token budget)."""


WORKLOADS = {
    "0.5b": Workload(prompts=32, samples=8, response_len=256, max_tokens_per_gpu=16384),
    "1.5b": Workload(prompts=32, samples=8, response_len=256, max_tokens_per_gpu=16384),
    "tiny": Workload(prompts=4, samples=4, response_len=32, max_tokens_per_gpu=4096),
}
MODES = {
    "colocate": ["--colocate"],
    "colocate-late-onload": ["--colocate", "--disable-onload-during-rollout"],
    "no-offload": ["--colocate", "--no-offload-train", "--no-offload-rollout"],
    "split": ["--rollout-num-gpus", "1"],
    "colocate-true-on-policy": ["--colocate", "--true-on-policy-mode"],
    "cpu": [],
}
LOGPROB_DIFF = "train/train_rollout_logprob_abs_diff"

# (label, loop metric, standalone key, level): level-0 rows partition the step, level-1 rows split the rollout.
ROWS = (
    ("rollout", "perf/rollout_time", "rollout", 0),
    ("  engine busy (inside its step, GPU wait included)", "perf/engine_busy_time", None, 1),
    ("  first sample back", "perf/rollout_first_sample_time", None, 1),
    ("  ramp (to 90% in flight)", "perf/rollout_ramp_time", None, 1),
    ("  steady (>= 90% in flight)", "perf/rollout_steady_time", None, 1),
    ("  tail (after 90% came back)", "perf/rollout_tail_time", None, 1),
    ("  reward calls (sum, overlapped)", "perf/rollout_reward_time", None, 1),
    ("  reward after last generation", "perf/rollout_reward_tail_time", None, 1),
    ("  batch building", "perf/rollout_finish_time", None, 1),
    ("  a request: sent -> in the engine's handler (median)", "perf/rollout_request_send_time", None, 1),
    (
        "  a request: in the engine until its last sample finished (median)",
        "perf/rollout_request_engine_time",
        None,
        1,
    ),
    ("  a request: finished -> answer built (median)", "perf/rollout_request_answer_time", None, 1),
    (
        "  a request: answer built -> back in the rollout (median)",
        "perf/rollout_request_return_time",
        None,
        1,
    ),
    ("  last request: engine finished -> back in the rollout", "perf/rollout_last_answer_time", None, 1),
    ("  garbage collector in the rollout's process", "perf/rollout_gc_time", None, 1),
    ("engine memory release", "perf/engine_release_time", None, 0),
    ("trainer onload", "perf/trainer_onload_time", None, 0),
    ("log_probs", "perf/log_probs_time", "log_probs", 0),
    ("ref_log_probs", "perf/ref_log_probs_time", "ref_log_probs", 0),
    ("actor_train", "perf/actor_train_time", "actor_train", 0),
    ("trainer offload", "perf/trainer_offload_time", None, 0),
    ("train call, other (Ray, advantages)", "train_other", None, 0),
    ("  advantages", "perf/advantages_time", None, 1),
    ("  in the trainer, other (batching, metrics)", "trainer_other", None, 1),
    ("  Ray call (batch there, metrics back)", "ray_train_call", None, 1),
    ("weight sync", "perf/update_weights_time", "weight_sync", 0),
    ("  buckets (onload, gather, cast)", "perf/update_weights_gather_time", None, 1),
    ("trainer weights offload (after the sync)", "perf/trainer_weights_offload_time", None, 0),
    ("engine resume", "perf/engine_resume_time", None, 0),
    ("step, other (driver, logging)", "step_other", None, 0),
)
TRAIN_PARTS = ("perf/engine_release_time", "perf/trainer_onload_time", "perf/log_probs_time",
               "perf/ref_log_probs_time", "perf/actor_train_time", "perf/trainer_offload_time")  # fmt: skip
TRAINER_PARTS = ("perf/log_probs_time", "perf/ref_log_probs_time", "perf/advantages_time",
                 "perf/actor_train_time")  # fmt: skip
STEP_PARTS = ("perf/rollout_time", "perf/train_time", "perf/update_weights_time", "perf/engine_resume_time",
              "perf/trainer_weights_offload_time", "perf/check_weight_update_time", "perf/eval_time")  # fmt: skip


# -- the table (pure functions of the metrics: tests/unit/test_bench_loop_step.py) --------------------------


def loop_phases(rows: list[dict], warmup: int = 1) -> dict[str, float]:
    """Median seconds per metric over the rollouts after `warmup`, plus "step" (time between metric lines),
    "train_other" and "step_other" (what the named parts leave of perf/train_time and of the step)."""
    steps = [r for r in rows if "perf/rollout_time" in r]
    measured = [(prev, row) for prev, row in zip(steps, steps[1:], strict=False) if row["step"] >= warmup]
    if not measured:
        raise ValueError(
            f"no rollout after the {warmup} warm-up rollout(s) in the metrics: use more rollouts"
        )
    per_step = []
    for prev, row in measured:
        values = {k: float(v) for k, v in row.items() if k.startswith("perf/") and k.endswith("_time")}
        values["step"] = float(row["time"]) - float(prev["time"])
        values["train_other"] = values.get("perf/train_time", 0.0) - sum(
            values.get(k, 0.0) for k in TRAIN_PARTS
        )
        values["step_other"] = values["step"] - sum(values.get(k, 0.0) for k in STEP_PARTS)
        if "perf/train_actor_time" in values:  # the trainer's own time of the call, rank 0
            values["trainer_other"] = values["perf/train_actor_time"] - sum(
                values.get(k, 0.0) for k in TRAINER_PARTS
            )
            values["ray_train_call"] = (
                values["train_other"] - values["trainer_other"] - values.get("perf/advantages_time", 0.0)
            )
        per_step.append(values)
    keys = set().union(*per_step)
    return {k: statistics.median(v[k] for v in per_step if k in v) for k in sorted(keys)}


ENGINE_COUNTERS = (("busy", "perf/engine_busy_time"), ("cpu", "perf/engine_step_cpu_time"),
                   ("gpu_wait", "perf/engine_gpu_wait_time"), ("gpu", "perf/engine_gpu_time"),
                   ("process_cpu", "perf/engine_process_cpu_time"))  # fmt: skip


def per_rollout(rows: list[dict]) -> list[dict]:
    """Each rollout's time, the engine's steps and its counters in ms per step (None where not logged):
    whether the engine's step drifts from rollout to rollout, and whether the drift is on the GPU (gpu), in
    the engine thread's CPU work (cpu) or off the CPU (busy - cpu - gpu_wait: the GIL, the scheduler)."""
    out = []
    for row in rows:
        if "perf/rollout_time" not in row:
            continue
        steps = row.get("perf/engine_steps")
        entry = {"step": row["step"], "rollout_s": row["perf/rollout_time"], "engine_steps": steps}
        for name, key in ENGINE_COUNTERS:
            value = row.get(key)
            entry[f"{name}_ms_per_step"] = value * 1e3 / steps if value is not None and steps else None
        entry["idle_s"] = row.get("perf/engine_idle_time")
        entry["command_s"] = row.get("perf/engine_command_time")
        out.append(entry)
    return out


def per_rollout_markdown(entries: list[dict]) -> str:
    """per_rollout() as a markdown table."""
    head = "| rollout | rollout s | engine steps | " + " | ".join(f"{n} ms/step" for n, _ in ENGINE_COUNTERS)
    lines = [head + " | engine idle s | engine commands s |", "|---" * (5 + len(ENGINE_COUNTERS)) + "|"]
    for e in entries:
        cells = [str(e["step"]), f"{e['rollout_s']:.3f}", _num(e["engine_steps"], ".0f")]
        cells += [_num(e[f"{n}_ms_per_step"], ".2f") for n, _ in ENGINE_COUNTERS]
        cells += [_num(e.get("idle_s"), ".3f"), _num(e.get("command_s"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_table(loop: dict[str, float], standalone: dict[str, float | None]) -> dict:
    """Rows (label, loop s, standalone s, loop/standalone, share of the step) and the loop efficiency."""
    step = loop["step"]
    rows = []
    for label, key, part, level in ROWS:
        seconds = loop.get(key)
        alone = standalone.get(part) if part else None
        rows.append({
            "phase": label, "level": level, "loop_s": seconds, "standalone_s": alone,
            "ratio": seconds / alone if seconds is not None and alone else None,
            "share": seconds / step if seconds is not None else None,
        })  # fmt: skip
    parts = [r["standalone_s"] for r in rows if r["level"] == 0 and r["standalone_s"] is not None]
    return {"rows": rows, "step_s": step, "standalone_sum_s": sum(parts), "efficiency": sum(parts) / step}


def markdown(table: dict, title: str) -> str:
    """The table as markdown: seconds with 3 decimals, "n/a" where a value does not exist."""
    lines = [f"### {title}", "", "| phase | loop s | standalone s | loop / standalone | share of step |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in table["rows"]:
        lines.append(f"| {r['phase']} | {_num(r['loop_s'], '.3f')} | {_num(r['standalone_s'], '.3f')} | "
                     f"{_num(r['ratio'], '.2f', 'x')} | {_num(r['share'], '.1%')} |")  # fmt: skip
    lines.append(f"| **step** | **{table['step_s']:.3f}** | {table['standalone_sum_s']:.3f} (sum) | | |")
    lines += ["", f"loop efficiency = {table['standalone_sum_s']:.3f} / {table['step_s']:.3f} = "
              f"**{table['efficiency']:.2f}**"]  # fmt: skip
    return "\n".join(lines)


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


# -- the loop ---------------------------------------------------------------------------------------------


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def train_flags(shape: str, ckpt: Path, data: Path, out: Path, num_rollout: int) -> list[str]:
    """`clawrl train` flags shared by every placement (gpu_smoke.py's recipe, without its debugging checks)."""
    w = WORKLOADS[shape]
    batch = w.prompts * w.samples
    return [
        "--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--input-key", "input", "--label-key", "label",
        "--apply-chat-template", "--custom-rm-path", f"{REWARD}:reward",
        "--rollout-batch-size", str(w.prompts), "--n-samples-per-prompt", str(w.samples),
        "--rollout-max-response-len", str(w.response_len), "--rollout-temperature", "1.0",
        "--global-batch-size", str(batch), "--use-kl-loss", "--kl-loss-coef", "0.0", "--lr", "1e-6",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", str(w.max_tokens_per_gpu), "--num-rollout", str(num_rollout),
        "--output-dir", str(out), "--run-name", f"loop-step-{out.name}",
    ]  # fmt: skip


def run_loop(flags: list[str], mode: str, out: Path) -> list[dict]:
    """Run `clawrl train` in a subprocess; its metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "clawrl.cli.main", "train", *flags, *MODES[mode]]
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT)
    print(f"clawrl train ({mode}) exited {result.returncode} after {time.perf_counter() - started:.1f} s")
    if result.returncode != 0:
        raise RuntimeError(f"clawrl train ({mode}) failed with exit code {result.returncode}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def split_reason(mode: str, device: str, num_gpus: int) -> str | None:
    """Why a placement cannot run here (None: it can)."""
    if device == "cpu":
        return None if mode == "cpu" else "CPU: every placement is clawrl's cpu mode (mode 'cpu')"
    if mode == "cpu":
        return "a GPU is visible: use colocate / no-offload / split"
    if mode == "split" and num_gpus < 2:
        return (f"split needs trainer GPUs + engine GPUs = 2, this machine has {num_gpus}; "
                "'no-offload' is the one-GPU stand-in (both resident, no offload)")  # fmt: skip
    return None


# -- standalone parts -------------------------------------------------------------------------------------


def standalone_parts(shape: str, flags: list[str], ckpt: Path, rows: list[dict], device: str, args) -> dict:
    """Every part measured alone on the loop's rollout rebuilt (`loop_like_samples`); None where n/a."""
    from clawrl.config.flags import parse_job_args

    parts: dict = {"rollout": None, "rollout_prefill": None, "log_probs": None, "ref_log_probs": None,
                   "actor_train": None, "weight_sync": None, "notes": {}}  # fmt: skip
    modules = {m: _bench_module(m) for m in ("engine_throughput", "train_throughput", "weight_sync")}
    for name, module in modules.items():
        if shape not in module.SHAPES:
            parts["notes"][name] = f"bench/{name}.py has no shape {shape!r}: its parts are n/a"
    job = parse_job_args(flags)
    lengths = [
        r["rollout/response_len/mean"] for r in rows if r["step"] >= 1 and "rollout/response_len/mean" in r
    ]
    mean_len = statistics.median(lengths)
    samples = loop_like_samples(job, max(1, round(mean_len)))
    parts["response_len"] = mean_len
    # The engine first: run after the trainer in this process (2026-12-05, H200), the engine alone made
    # 96k tok/s, 0.682 s: slower than the loop's own rollout (0.631 s), so the ratio meant nothing.
    if "engine_throughput" not in parts["notes"]:
        et = modules["engine_throughput"]
        guarded(
            parts,
            "engine",
            lambda: parts.update(standalone_engine(et, ckpt, samples, mean_len, device, args)),
        )
    if "train_throughput" not in parts["notes"]:
        sync = None if "weight_sync" in parts["notes"] else modules["weight_sync"]
        guarded(parts, "trainer", lambda: parts.update(standalone_trainer(sync, job, samples, device, args)))
    return parts


def guarded(parts: dict, what: str, fn) -> None:
    """One standalone part; a failure leaves its values n/a and records why, the rest still runs."""
    print(f"\n### standalone {what}", flush=True)
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - each part is isolated
        traceback.print_exc()
        parts["notes"][what] = f"failed: {type(error).__name__}: {error}"


def loop_like_samples(job, response_len: int, seed: int = 0) -> list:
    """The loop's rollout rebuilt: its first --rollout-batch-size prompts through the same dataset code and
    chat template, each --n-samples-per-prompt times, with `response_len` random response tokens and rewards
    that vary. (Not a --save-debug-rollout-data dump: writing it would add to the loop's step time.)"""
    from transformers import AutoTokenizer

    from clawrl.data.chat import encode_text
    from clawrl.data.dataset import PromptDataset
    from clawrl.data.sample import Sample, Status

    d, r = job.data, job.rollout
    tokenizer = AutoTokenizer.from_pretrained(job.model.hf_checkpoint)
    dataset = PromptDataset(d.prompt_data, tokenizer, input_key=d.input_key, label_key=d.label_key,
                            apply_chat_template=d.apply_chat_template)  # fmt: skip
    rng, samples = random.Random(seed), []
    for group, prototype in enumerate(dataset.samples[: r.rollout_batch_size]):
        prompt = encode_text(tokenizer, prototype.prompt)
        for _ in range(r.n_samples_per_prompt):
            response = [rng.randrange(10, len(tokenizer)) for _ in range(response_len)]
            samples.append(Sample(
                group_index=group, index=len(samples), tokens=prompt + response, response_length=response_len,
                reward=rng.random(), rollout_log_probs=[-9.0] * response_len, status=Status.TRUNCATED,
            ))  # fmt: skip
    return samples


def standalone_engine(et, ckpt: Path, samples: list, loop_len: float, device: str, args) -> dict:
    """bench/engine_throughput.py's in-process engine on the rollout's prompts, all at once, each generating
    the loop's (rounded) mean response length with EOS ignored; seconds scaled to the loop's mean length."""
    prompts = [list(s.tokens[: len(s.tokens) - s.response_length]) for s in samples]
    new_tokens = samples[0].response_length
    engine_args = SimpleNamespace(device=device, mem_fraction_static=args.engine_mem_fraction)
    engine = et.make_engine(ckpt, engine_args, max_running=len(prompts))
    try:
        et.timed_engine_run(engine, prompts, min(8, new_tokens), greedy=False)  # warm-up: compiles, graphs
        run = et.timed_engine_run(engine, prompts, new_tokens, greedy=False)
    finally:
        del engine
        et.free_memory()
    print(f"  engine alone: {run['tok_s']:,.0f} tok/s, {run['seconds']:.3f} s for {len(prompts)} x {new_tokens}"
          f" tokens (prefill {run['prefill_s']:.3f} s)")  # fmt: skip
    return {"rollout": run["seconds"] * loop_len / new_tokens, "rollout_prefill": run["prefill_s"],
            "engine_tok_s": run["tok_s"], "engine_decode_tok_s": run["decode_tok_s"]}  # fmt: skip


def standalone_trainer(ws, job, samples: list, device: str, args) -> dict:
    """The loop's TrainActor (same flags) on the rebuilt batch: log-prob passes and actor_train after one
    warm-up call; then (unless `ws` is None) weight syncs from it to bench/weight_sync.py's engine subprocess."""
    from clawrl.rollout.manager import train_batch_from_groups
    from clawrl.rollout.replay import regroup
    from clawrl.trainer.actor import TrainActor

    batch, _, _ = train_batch_from_groups(job, 0, regroup(samples), "bench/loop_step.py")
    actor = TrainActor(job, device=device)
    actor.init(total_optimizer_steps=args.trainer_repeats + 1)
    try:
        runs = [actor.train(batch) for _ in range(args.trainer_repeats + 1)][1:]
        out = {k: statistics.median(m.get(f"perf/{k}_time", float("nan")) for m in runs)
               for k in ("log_probs", "ref_log_probs", "actor_train")}  # fmt: skip
        out = {k: (v if v == v else None) for k, v in out.items()}  # NaN: the pass did not run
        print(f"  trainer alone: {json.dumps(out)}")
        if ws is not None:
            out.update(standalone_weight_sync(ws, actor, job, device, args))
    finally:
        actor.shutdown()
    return out


def standalone_weight_sync(ws, actor, job, device: str, args) -> dict:
    """Median seconds of `--sync-repeats` syncs (after one warm-up) of the actor's weights to an engine
    subprocess, through weight_sync.py's endpoint and the colocated sender."""
    from clawrl.weight_sync import make_sender

    transport = (
        "http" if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "pydantic")) else "direct"
    )
    dtype = actor.engine_dtype
    dtype_name = str(dtype).removeprefix("torch.")
    times = []
    with (
        ws.engine_endpoint(job.model.hf_checkpoint, device, dtype_name, transport, False) as endpoint,
        make_sender("colocated", timeout_s=300.0, max_inflight=2, **endpoint) as sender,
    ):
        for i in range(args.sync_repeats + 1):
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
            start = time.perf_counter()
            sender.begin(f"bench-{i}")
            for bucket in actor.weight_buckets(dtype):
                sender.send(bucket)
            sender.finish()
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    print(f"  weight sync alone ({transport}): {seconds * 1e3:.1f} ms (median of {args.sync_repeats})")
    return {"weight_sync": seconds, "weight_sync_transport": transport}


# -- driver -----------------------------------------------------------------------------------------------


def run_shape(shape: str, args, device: str, num_gpus: int) -> dict:
    from clawrl.demo.task import TaskSpec, write_task_files

    work = Path(args.workdir)
    et = _bench_module("engine_throughput")
    ckpt = et.build_checkpoint(work / f"ckpt-{shape}", shape, init_std=0.02, device=device)
    data = write_task_files(work / "data", TaskSpec(), seed=0, num_train=512, num_eval=32)["train"]
    result: dict = {"shape": shape, "workload": asdict(WORKLOADS[shape]), "modes": {}}
    first_run = None
    for mode in args.modes.split(","):
        reason = split_reason(mode, device, num_gpus)
        if reason is not None:
            print(f"\n{shape} {mode}: n/a ({reason})", flush=True)
            result["modes"][mode] = {"n/a": reason}
            continue
        out = Path(args.out) / f"{shape}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"  # a new run dir each time
        flags = train_flags(shape, ckpt, data, out, args.num_rollout)
        try:
            rows = run_loop(flags, mode, out)
        except RuntimeError as error:
            result["modes"][mode] = {"error": str(error)}
            continue
        entry = {"metrics": rows, "loop": loop_phases(rows, warmup=1), "per_rollout": per_rollout(rows)}
        diffs = [row[LOGPROB_DIFF] for row in rows if LOGPROB_DIFF in row]
        entry["max_train_rollout_logprob_abs_diff"] = max(diffs) if diffs else None
        result["modes"][mode] = entry
        print(
            f"\n{shape} {mode}, the engine per rollout:\n{per_rollout_markdown(entry['per_rollout'])}",
            flush=True,
        )
        first_run = first_run or (flags, rows)
    if first_run is None:
        return result
    flags, rows = first_run
    result["standalone"] = standalone_parts(shape, flags, ckpt, rows, device, args)
    for entry in result["modes"].values():
        if "loop" in entry:
            entry["table"] = build_table(entry["loop"], result["standalone"])
    return result


def parse_args(argv: list[str] | None):
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="0.5b,1.5b", help=f"comma list of {sorted(WORKLOADS)}")
    p.add_argument("--modes", default=None, help="comma list of colocate,no-offload,split (cpu on CPU)")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu")
    )
    p.add_argument("--num-rollout", type=int, default=3, help="rollouts per run; the first is a warm-up")
    p.add_argument("--trainer-repeats", type=int, default=2, help="standalone train() calls after a warm-up")
    p.add_argument("--sync-repeats", type=int, default=3, help="standalone weight syncs after a warm-up")
    p.add_argument("--engine-mem-fraction", type=float, default=0.4, help="standalone engine (colocate's)")
    p.add_argument("--workdir", default="/tmp/clawrl-loop-step", help="checkpoints and prompt data")
    p.add_argument(
        "--out", default="/tmp/clawrl-loop-step/runs", help="a new output dir per shape, mode and run"
    )
    p.add_argument("--json-out", default=None, help="write every number here")
    args = p.parse_args(argv)
    if args.num_rollout < 2:
        p.error(f"--num-rollout {args.num_rollout}: needs >= 2 (rollout 0 is a warm-up)")
    args.modes = args.modes or ("cpu" if args.device == "cpu" else "colocate,no-offload,split")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cpu":  # as the loop's cpu-mode processes: one thread each (2 threads are 10x slower
        torch.set_num_threads(1)  # here when the cores are shared); the env reaches the engine subprocess
        os.environ["OMP_NUM_THREADS"] = "1"
    results = {"args": vars(args), "num_gpus": num_gpus, "torch": torch.__version__, "shapes": []}
    for shape in args.shapes.split(","):
        results["shapes"].append(run_shape(shape.strip(), args, args.device, num_gpus))
        write_json(results, args.json_out)
    print_tables(results)
    write_json(results, args.json_out)
    failed = any("error" in m for s in results["shapes"] for m in s["modes"].values())
    return 1 if failed else 0


def print_tables(results: dict) -> None:
    print()
    for shape in results["shapes"]:
        for note in shape.get("standalone", {}).get("notes", {}).values():
            print(f"note ({shape['shape']}): {note}")
        for mode, entry in shape["modes"].items():
            title = f"{shape['shape']}, {mode}"
            if "table" in entry:
                print(markdown(entry["table"], title) + "\n")
                print(per_rollout_markdown(entry["per_rollout"]) + "\n")
                print(f"max {LOGPROB_DIFF} over the run: {entry.get('max_train_rollout_logprob_abs_diff')}\n")
            else:
                print(f"### {title}\n\nn/a: {entry.get('n/a') or entry.get('error')}\n")


def write_json(results: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
