"""The demo run in ONE process: the real Engine and TrainActor, without Ray or HTTP (the recipe's harness).

A test helper, not part of the package: tests/integration/test_demo_inprocess.py runs it on a micro recipe,
and it is kept to re-tune the recipe quickly (`clawrl demo` is the real path, through Ray and HTTP).

`run_inprocess(recipe, out_dir)` builds the tiny model and the task files (`build_assets`), warms the model up
with a TrainActor on the SFT loss, then runs GRPO with a second TrainActor (world size 1, CPU): each rollout is
sampled by an `Engine` in this process, scored by the gsm8k reward, normalised per group, trained on, and the
new weights are copied into the engine (`actor.weight_buckets()` -> `engine.update_weights_from_tensors`).
The engine starts from the random model and follows the trainer the same way during the warm-up, so both
phases have an eval curve. It is the experiment harness the recipe was tuned with and a regression check for
it; `clawrl demo` runs the same recipe through the Ray loop.

    python tests/integration/demo_inprocess.py --out /tmp/demo [--seed 0] [--set grpo.lr=1e-3 --set sft.steps=400]

writes <out>/metrics.jsonl (one object per logged step: phase, step, wall_s, metrics), <out>/summary.json
(accuracy before and after RL, both curves, seconds per phase), the models (init_model, sft_model,
final_model) and the data files (data/train.jsonl, eval.jsonl, sft.jsonl), and prints one line per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawrl.demo.recipe import (
    DemoAssets,
    DemoRecipe,
    GRPOSettings,
    apply_override,
    build_assets,
    grpo_job,
    sft_batch,
    sft_job,
)


def load_prompts(path: Path, tokenizer) -> tuple[list[list[int]], list[str], list[str]]:
    """(prompt token ids, labels, kinds) of a prompt file, read exactly as --apply-chat-template reads it."""
    from clawrl.data.chat import encode_text
    from clawrl.data.dataset import PromptDataset

    dataset = PromptDataset(
        str(path), tokenizer, input_key="input", label_key="label", apply_chat_template=True
    )
    ids = [encode_text(tokenizer, s.prompt) for s in dataset.samples]
    return ids, [s.label for s in dataset.samples], [s.metadata.get("kind", "") for s in dataset.samples]


def evaluate(engine, tokenizer, prompts: list[list[int]], labels: list[str], kinds: list[str], *,
             max_new_tokens: int, temperature: float, seed: int) -> dict[str, float]:  # fmt: skip
    """Accuracy (gsm8k reward) of one sample per prompt, overall and per problem kind."""
    from clawrl.engine.core.request import SamplingParams
    from clawrl.rollout.rewards.gsm8k import gsm8k_score

    # A seed per prompt: with one shared seed, sampled (temperature > 0) answers of all prompts would be
    # driven by the same random stream and be correlated.
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        for i in range(len(prompts))
    ]
    outs = engine.generate(prompts, params)
    scores = [gsm8k_score(_text(tokenizer, o), label) for o, label in zip(outs, labels, strict=True)]
    metrics = {"eval/demo": sum(scores) / len(scores)}
    for kind in sorted(set(kinds)):
        mine = [s for s, k in zip(scores, kinds, strict=True) if k == kind]
        metrics[f"eval/demo_{kind}"] = sum(mine) / len(mine)
    metrics["eval/demo-truncated_ratio"] = sum(o["finish_reason"]["type"] == "length" for o in outs) / len(
        outs
    )
    return metrics


def _text(tokenizer, out: dict) -> str:
    return tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def generate_rollout(engine, tokenizer, prompts, labels, rollout_id: int, g: GRPOSettings, seed: int):
    """Sample n responses per prompt, score them, normalise per group: (TrainBatch, rollout metrics)."""
    import torch

    from clawrl.algo import postprocess_rewards
    from clawrl.data.train_batch import TrainBatch
    from clawrl.engine.core.request import SamplingParams
    from clawrl.rollout.rewards.gsm8k import gsm8k_score

    n = g.n_samples_per_prompt
    # One request per sample, seeded --rollout-seed + the sample's running index, as the rollout manager does
    # (clawrl/rollout/generate.py): every sample draws its own random stream.
    first = rollout_id * len(prompts) * n
    params = [
        SamplingParams(max_new_tokens=g.max_response_len, temperature=g.temperature, seed=seed + first + i)
        for i in range(len(prompts) * n)
    ]
    prompt_of = [p for p in prompts for _ in range(n)]
    outs = engine.generate(prompt_of, params)  # prompt order, then copy: groups are consecutive
    label_of = [lab for lab in labels for _ in range(n)]
    raw = [gsm8k_score(_text(tokenizer, o), lab) for o, lab in zip(outs, label_of, strict=True)]
    rewards = postprocess_rewards("grpo", torch.tensor(raw), n).tolist()
    lengths = [len(o["output_ids"]) for o in outs]
    batch = TrainBatch(
        rollout_id=rollout_id, tokens=[p + o["output_ids"] for p, o in zip(prompt_of, outs, strict=True)],
        response_lengths=lengths, loss_masks=[[1] * r for r in lengths], rewards=rewards, raw_rewards=raw,
        rollout_log_probs=[o["logprobs"] for o in outs],
        truncated=[int(o["finish_reason"]["type"] == "length") for o in outs],
    )  # fmt: skip
    groups = torch.tensor(raw).view(-1, n)
    metrics = {
        "rollout/raw_reward": sum(raw) / len(raw),
        "rollout/pass_at_n": float((groups.max(dim=1).values > 0).float().mean()),
        "rollout/zero_std_ratio": float((groups.std(dim=1) == 0).float().mean()),
        "rollout/response_len/mean": sum(lengths) / len(lengths),
        "rollout/truncated_ratio": sum(batch.truncated) / len(lengths),
    }
    return batch, metrics


def sync_weights(actor, engine) -> float:
    """Copy the trainer's weights into the engine (bumps its weight version); returns the seconds taken."""
    start = time.perf_counter()
    for bucket in actor.weight_buckets():
        engine.update_weights_from_tensors(bucket)
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------------------
# The in-process run
# ------------------------------------------------------------------------------------------------------------
class _Run:
    """One in-process run: the engine, the eval set, metrics.jsonl, the console and wall-clock per phase."""

    def __init__(self, recipe: DemoRecipe, out: Path, echo: Callable[[str], None]):
        self.recipe, self.out, self.echo = recipe, out, echo
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.evals: list[dict[str, Any]] = []
        self.file = (out / "metrics.jsonl").open("w", encoding="utf-8")

    def log(self, phase: str, step: int, metrics: dict[str, Any]) -> None:
        row = {"phase": phase, "step": step, "wall_s": round(time.perf_counter() - self.start, 3), **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        shown = " ".join(f"{k.split('/')[-1]}={v:.3g}" for k, v in metrics.items() if isinstance(v, float))
        self.echo(f"[{row['wall_s']:6.1f}s] {phase} {step}: {shown}")

    @contextlib.contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0

    def evaluate(self, phase: str, step: int) -> None:
        """Greedy (eval_temperature) accuracy on the held-out problems with the engine's current weights."""
        g = self.recipe.grpo
        with self.timed("eval"):
            metrics = evaluate(self.engine, self.tokenizer, *self.eval_set, max_new_tokens=g.max_response_len,
                               temperature=g.eval_temperature, seed=self.recipe.seed)  # fmt: skip
        self.evals.append({"phase": phase, "step": step, **metrics})
        self.log(f"eval/{phase}", step, metrics)


def run_inprocess(
    recipe: DemoRecipe, out_dir: str | Path, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the demo in this process (Engine + TrainActor, no Ray); returns the summary (also in summary.json).

    The engine starts from the random model and follows the trainer by weight copies: every
    `sft.eval_interval` warm-up steps (for the eval curve) and after every GRPO step (on-policy rollouts).
    """
    import torch

    from clawrl.engine.config import EngineConfig
    from clawrl.engine.core.engine import Engine

    if recipe.num_threads is not None:
        torch.set_num_threads(recipe.num_threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(recipe, out, echo)
    with run.timed("setup"):
        assets = build_assets(recipe, out)
        # Every prompt fits one step's token budget with room to spare: prefill is never chunked.
        run.engine = Engine(EngineConfig(model_path=str(assets.model_dir), seed=recipe.seed))
        run.tokenizer = run.engine.tokenizer
        run.eval_set = load_prompts(assets.eval_path, run.tokenizer)
    with run.timed("sft"):
        _warm_up(run, assets, out / "sft_model")
    with run.timed("grpo"):
        _reinforce(run, assets, out / "sft_model", out / "final_model")
    summary = _summary(run)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo(json.dumps({k: v for k, v in summary.items() if k != "recipe"}))
    run.file.close()
    return summary


def _warm_up(run: _Run, assets: DemoAssets, sft_dir: Path) -> None:
    """SFT on the teacher's solutions with a TrainActor, evaluating on the way; exports the result to sft_dir."""
    from clawrl.data.dataset import read_rows
    from clawrl.trainer.actor import TrainActor

    recipe, s = run.recipe, run.recipe.sft
    rows = read_rows(str(assets.sft_path))
    actor = TrainActor(sft_job(recipe, assets.model_dir, run.out), device="cpu")
    actor.init(total_optimizer_steps=s.steps)
    for step in range(1, s.steps + 1):
        chunk = [rows[((step - 1) * s.batch_size + i) % len(rows)] for i in range(s.batch_size)]
        with run.timed("sft_train"):
            metrics = actor.train(sft_batch(run.tokenizer, chunk, rollout_id=step - 1))["train"][-1]
        if step % s.eval_interval == 0 or step == s.steps:
            run.log("sft", step, {k: metrics[k] for k in ("train/loss", "train/grad_norm", "train/lr")})
            with run.timed("sync"):
                sync_weights(actor, run.engine)
            run.evaluate("sft", step)  # the last one is the "before RL" accuracy
    actor.export_hf(str(sft_dir))
    actor.shutdown()


def _reinforce(run: _Run, assets: DemoAssets, sft_dir: Path, final_dir: Path) -> None:
    """GRPO from the warm-up's model: rollout -> train -> weight copy, evaluating every eval_interval steps."""
    from clawrl.trainer.actor import TrainActor

    recipe, g = run.recipe, run.recipe.grpo
    prompts, labels, _ = load_prompts(assets.train_path, run.tokenizer)
    job = grpo_job(recipe, sft_dir, assets, run.out)
    actor = TrainActor(job, device="cpu")
    actor.init(total_optimizer_steps=g.num_rollout * job.train.num_steps_per_rollout)
    for rollout_id in range(g.num_rollout):
        ids = [(rollout_id * g.rollout_batch_size + i) % len(prompts) for i in range(g.rollout_batch_size)]
        t0 = time.perf_counter()
        with run.timed("rollout"):
            batch, metrics = generate_rollout(
                run.engine, run.tokenizer, [prompts[i] for i in ids], [labels[i] for i in ids], rollout_id, g,
                recipe.seed,
            )  # fmt: skip
        t1 = time.perf_counter()
        with run.timed("train"):
            train_metrics = actor.train(batch)
        t2 = time.perf_counter()
        with run.timed("sync"):
            sync_weights(actor, run.engine)
        last = train_metrics["train"][-1]
        metrics.update({k: last[k] for k in _TRAIN_KEYS if k in last})
        metrics.update({"perf/rollout_time": t1 - t0, "perf/train_time": t2 - t1,
                        "perf/update_weights_time": time.perf_counter() - t2})  # fmt: skip
        run.log("grpo", rollout_id + 1, metrics)
        if (rollout_id + 1) % g.eval_interval == 0 or rollout_id + 1 == g.num_rollout:
            run.evaluate("grpo", rollout_id + 1)
    actor.export_hf(str(final_dir))
    actor.shutdown()


_TRAIN_KEYS = ("train/pg_loss", "train/entropy_loss", "train/kl_loss", "train/grad_norm", "train/pg_clipfrac",
               "train/ppo_kl", "train/train_rollout_logprob_abs_diff")  # fmt: skip


def _summary(run: _Run) -> dict[str, Any]:
    sft_evals = [e for e in run.evals if e["phase"] == "sft"]
    grpo_evals = [e for e in run.evals if e["phase"] == "grpo"]
    before = sft_evals[-1]["eval/demo"]
    after = grpo_evals[-1]["eval/demo"] if grpo_evals else before
    return {
        "eval_before_rl": before,
        "eval_after_rl": after,
        "eval_gain": after - before,
        "sft_curve": [(e["step"], e["eval/demo"]) for e in sft_evals],
        "grpo_curve": [(0, before)] + [(e["step"], e["eval/demo"]) for e in grpo_evals],
        "phase_seconds": {k: round(v, 2) for k, v in run.phases.items()},
        "total_seconds": round(time.perf_counter() - run.start, 2),
        "recipe": run.recipe.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the demo recipe in one process (no Ray, no HTTP).")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="recipe override")
    args = parser.parse_args(argv)
    recipe = DemoRecipe(seed=args.seed)
    for assignment in args.set:
        apply_override(recipe, assignment)
    run_inprocess(recipe, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
