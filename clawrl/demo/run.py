"""`clawrl demo`: the whole system on CPU in a few minutes, from nothing.

    clawrl demo [--output-dir outputs/demo] [--seed 0]

1. builds a tiny tokenizer and a random tiny Qwen2-style model locally (clawrl.models.tiny);
2. writes arithmetic word problems (clawrl.demo.task) as jsonl prompts with gsm8k-style labels;
3. warms the model up with the SFT loss (a TrainActor in this process, --loss-type sft_loss);
4. runs GRPO through the real stack: Ray, an engine actor serving HTTP, an FSDP2 trainer actor, shared-memory
   weight sync after every step, `clawrl train`'s own loop (clawrl.loops.sync), evaluating before RL and
   every few rollouts;
5. writes the final model as a HF directory (`--save-hf`: transformers, `clawrl engine` and a new run's
   --hf-checkpoint load it), the report (plots + index.html), and prints the accuracy before and after RL
   and where the model is.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from clawrl.demo.recipe import DemoAssets, DemoRecipe, build_assets, grpo_job, sft_batch, sft_job

FINAL_MODEL_DIR = "final_model"
"""Where under --output-dir the demo writes its trained model (a HF directory)."""


def run_demo(output_dir: str | Path, *, seed: int = 0, recipe: DemoRecipe | None = None, echo=print) -> dict:
    """Run the demo into `output_dir` (which must not hold an earlier run); returns the summary.

    `recipe` defaults to `DemoRecipe(seed=seed)`, the tuned one; tests pass a micro recipe.
    """
    import torch

    out = Path(output_dir)
    if (out / "metrics.jsonl").exists():
        raise FileExistsError(f"{out} already holds a demo run (metrics.jsonl); pick another --output-dir")
    recipe = recipe or DemoRecipe(seed=seed)
    started = time.perf_counter()
    torch.set_num_threads(2)
    assets = build_assets(recipe, out / "assets")
    echo(
        f"[demo] tiny model and {recipe.num_train} problems written in {time.perf_counter() - started:.1f} s"
    )
    sft_dir = warm_up(recipe, assets, out / "sft_model", echo=echo)
    echo(f"[demo] SFT warm-up done at {time.perf_counter() - started:.1f} s; GRPO through Ray + HTTP + FSDP2")
    from clawrl.loops.sync import train

    job = grpo_job(recipe, sft_dir, assets, out)
    job.model.save_hf = str(out / FINAL_MODEL_DIR)  # no --save-interval: written once, after the last rollout
    train(job)
    from clawrl.metrics.report import build_report

    report = build_report(out)  # the path of index.html
    summary = {**_summary(out, time.perf_counter() - started), "final_model": job.model.save_hf}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo(
        f"[demo] eval accuracy {summary['eval_before_rl']:.3f} before RL -> {summary['eval_after_rl']:.3f} after "
        f"({summary['eval_gain']:+.3f}) in {summary['total_seconds']:.0f} s; report: {report}; "
        f"final model (HF format): {summary['final_model']}"
    )
    return summary


def warm_up(recipe: DemoRecipe, assets: DemoAssets, sft_dir: Path, *, echo=print) -> Path:
    """SFT on worked solutions with an in-process TrainActor (world size 1); exports the result to `sft_dir`."""
    from transformers import AutoTokenizer

    from clawrl.data.dataset import read_rows
    from clawrl.trainer.actor import TrainActor

    s = recipe.sft
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    rows = read_rows(str(assets.sft_path))
    scratch = sft_dir.parent / "sft_logs"
    actor = TrainActor(sft_job(recipe, assets.model_dir, scratch), device="cpu")
    actor.init(total_optimizer_steps=s.steps)
    for step in range(s.steps):
        chunk = [rows[(step * s.batch_size + i) % len(rows)] for i in range(s.batch_size)]
        loss = actor.train(sft_batch(tokenizer, chunk, rollout_id=step))["train"][-1]["train/loss"]
        if (step + 1) % 20 == 0 or step + 1 == s.steps:
            echo(f"[demo] SFT step {step + 1}/{s.steps}: loss {loss:.3f}")
    actor.export_hf(str(sft_dir))
    actor.shutdown()
    shutil.rmtree(scratch, ignore_errors=True)
    return sft_dir


def _summary(out: Path, seconds: float) -> dict:
    from clawrl.metrics.jsonl import read_metrics

    rows = read_metrics(out)
    evals = [(r["step"], r["eval/demo"]) for r in rows if "eval/demo" in r]
    return {
        "eval_before_rl": evals[0][1],
        "eval_after_rl": evals[-1][1],
        "eval_gain": evals[-1][1] - evals[0][1],
        "eval_curve": evals,
        "total_seconds": round(seconds, 1),
    }
