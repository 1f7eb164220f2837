"""The demo's recipe: hyperparameters as data, the job configs they imply, and the warm-up's batches.

`DemoRecipe` holds everything `clawrl demo` needs: the task (task.py), the tiny model's shape, the SFT
warm-up and the GRPO phase. `sft_job` / `grpo_job` turn it into validated `JobConfig`s for the real loop;
`sft_batch` turns warm-up rows into the TrainBatch the trainer takes.

Why GRPO has headroom (task.py): the warm-up data comes from a chatty teacher, most of whose solutions open
with a ~30-token retelling of the problem. Under the 24-token response budget such a solution is cut off
before its first number. After SFT the model has learned the arithmetic and opens verbosely about as often as
the teacher did, so greedy decoding mostly runs out of budget, while sampling at temperature 1 picks the
concise style for ~30% of samples, which then often score 1. GRPO rewards those: the model switches to the
concise style within 5-10 steps, then sharpens its arithmetic.

What the real loop must do to reproduce the numbers of `run_inprocess`:
- warm-up: `sft_job`, one `TrainActor.train(sft_batch(tokenizer, rows, step))` per step with the next
  `sft.batch_size` rows of sft.jsonl in file order (wrapping around); the per-token loss (`sft_job` sets it).
- hand the warm-up's weights to the GRPO trainer (`--hf-checkpoint` of `grpo_job`) and to the engine.
- GRPO: `grpo_job`'s flags: prompts of train.jsonl in file order through the chat template, n samples per
  prompt at temperature 1 (no top-p/top-k) with at most 24 new tokens; TRUNCATED SAMPLES STAY IN THE BATCH
  with their (zero) reward (they are the signal); gsm8k reward; group mean/std normalisation; one optimizer
  step per rollout; weights copied to the engine after every step (on-policy).
- eval: greedy, 24 new tokens, on eval.jsonl before the first rollout and every `grpo.eval_interval`.

`run_inprocess(recipe, out_dir)` in tests/integration/demo_inprocess.py runs the whole recipe in one process (no
Ray, no HTTP); it is the harness the recipe was tuned with, and its numbers are the reference for the Ray loop.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawrl.config.algo import AlgoConfig
from clawrl.config.data import DataConfig
from clawrl.config.eval import EvalConfig
from clawrl.config.job import JobConfig
from clawrl.config.logs import LoggingConfig
from clawrl.config.model import ModelConfig
from clawrl.config.resources import ResourcesConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.train import TrainConfig
from clawrl.config.validate import validate
from clawrl.demo.task import TaskSpec, make_splits, prompt_row, sft_rows, write_jsonl


@dataclass(kw_only=True)
class ModelShape:
    """The tiny policy model (a Qwen2-style decoder with tied embeddings)."""

    vocab_size: int = 2048
    """Tokenizer and embedding size."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""


@dataclass(kw_only=True)
class SFTSettings:
    """The warm-up: `--loss-type sft_loss` on the chatty teacher's solutions (task.py)."""

    steps: int = 600
    """Optimizer steps (one batch each)."""
    batch_size: int = 16
    """Conversations per optimizer step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 5
    """Linear learning-rate warm-up steps."""
    lr_decay_style: str = "cosine"
    """Learning-rate decay after the warm-up: constant, linear or cosine (down to min_lr at the last step)."""
    min_lr: float = 2e-4
    """Learning rate at the last step of a linear or cosine decay."""
    per_token_loss: bool = True
    """Average the loss over all tokens of a batch (the usual SFT loss) instead of per sample first."""
    eval_interval: int = 100
    """Copy the weights to the engine and evaluate every N steps (and after the last)."""


@dataclass(kw_only=True)
class GRPOSettings:
    """The RL phase (slime's flag names in the comments of `grpo_job`)."""

    num_rollout: int = 20
    """Rollout steps."""
    rollout_batch_size: int = 16
    """Prompts per rollout."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the GRPO group)."""
    temperature: float = 1.0
    """Rollout sampling temperature (the trainer divides logits by it too)."""
    max_response_len: int = 24
    """Maximum new tokens per response (rollout and eval): every concise solution fits, no verbose one does."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout."""
    lr: float = 5e-4
    """Peak learning rate (AdamW)."""
    lr_warmup_steps: int = 5
    """Linear warm-up steps: a fresh Adam's first steps are sign-SGD steps of size lr, which wreck a tiny model."""
    lr_decay_style: str = "cosine"
    """Learning-rate decay after the warm-up: constant, linear or cosine (down to min_lr at the last step)."""
    min_lr: float = 5e-5
    """Learning rate at the last step of a linear or cosine decay."""
    eps_clip: float = 0.2
    """PPO clip, low side."""
    eps_clip_high: float = 0.28
    """PPO clip, high side (DAPO clip-higher)."""
    kl_loss_coef: float = 0.0
    """Weight of the low_var_kl loss to the post-SFT model (0: no reference model at all)."""
    entropy_coef: float = 0.0
    """Entropy bonus."""
    eval_interval: int = 5
    """Evaluate every N rollouts (and always before the first and after the last)."""
    eval_temperature: float = 0.0
    """Eval sampling temperature (0: greedy)."""
    max_tokens_per_gpu: int = 8192
    """Token budget of one packed micro-batch (--use-dynamic-batch-size)."""


@dataclass(kw_only=True)
class DemoRecipe:
    """Everything the demo run is made of."""

    seed: int = 0
    """Seeds the problems, the model init, the trainer and the engine's sampling."""
    task: TaskSpec = field(
        default_factory=lambda: TaskSpec(max_operand=5, max_factor=5, verbose_fraction=0.6)
    )
    """Which problems are generated."""
    num_train: int = 4000
    """Training problems (SFT batches and RL prompts are drawn from them, in order)."""
    num_eval: int = 200
    """Held-out evaluation problems."""
    model: ModelShape = field(default_factory=ModelShape)
    """The tiny model."""
    sft: SFTSettings = field(default_factory=SFTSettings)
    """The warm-up phase."""
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    """The RL phase."""
    num_threads: int | None = 1
    """torch threads per component (None: torch's default); the real run shares 2 cores between two."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def micro_recipe(seed: int = 0) -> DemoRecipe:
    """A seconds-long recipe for tests of the wiring (not the accuracy): 1-layer 32-wide model, 4 SFT steps,
    2 GRPO rollouts of 4 x 4 samples with an entropy bonus (an untrained model may score 0 everywhere, and
    GRPO alone would then have no gradient at all), eval after every rollout."""
    return DemoRecipe(
        seed=seed,
        task=TaskSpec(max_operand=5, max_factor=5, verbose_fraction=0.5),
        num_train=64,
        num_eval=8,
        model=ModelShape(
            vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),  # fmt: skip
        sft=SFTSettings(steps=4, batch_size=8, lr=3e-3, warmup_steps=0, eval_interval=4),
        grpo=GRPOSettings(
            num_rollout=2,
            rollout_batch_size=4,
            n_samples_per_prompt=4,
            lr=1e-3,
            lr_warmup_steps=0,
            entropy_coef=0.01,
            eval_interval=1,
        ),  # fmt: skip
        num_threads=None,
    )


# ------------------------------------------------------------------------------------------------------------
# Assets and job configs
# ------------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DemoAssets:
    """What `build_assets` wrote."""

    model_dir: Path
    """The randomly initialised tiny model (HF directory, tokenizer included)."""
    train_path: Path
    """Training prompts (--prompt-data)."""
    eval_path: Path
    """Held-out prompts (--eval-prompt-data demo PATH)."""
    sft_path: Path
    """The warm-up conversations (the training problems with their worked solutions)."""


def build_assets(recipe: DemoRecipe, out_dir: str | Path) -> DemoAssets:
    """Train the tokenizer, write the random model and the task's jsonl files under `out_dir`."""
    from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    out = Path(out_dir)
    shape = recipe.model
    tokenizer = build_tiny_tokenizer(shape.vocab_size)
    model_dir = build_tiny_model(
        out / "init_model", arch="qwen2", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size, max_position_embeddings=256, seed=recipe.seed,
        tokenizer=tokenizer,
    )  # fmt: skip
    train, eval_problems = make_splits(
        recipe.task, seed=recipe.seed, num_train=recipe.num_train, num_eval=recipe.num_eval
    )
    data = out / "data"
    return DemoAssets(
        model_dir=model_dir,
        train_path=write_jsonl(map(prompt_row, train), data / "train.jsonl"),
        eval_path=write_jsonl(map(prompt_row, eval_problems), data / "eval.jsonl"),
        sft_path=write_jsonl(sft_rows(train, recipe.task, seed=recipe.seed), data / "sft.jsonl"),
    )


def sft_job(recipe: DemoRecipe, model_dir: str | Path, output_dir: str | Path) -> JobConfig:
    """The warm-up's job: --loss-type sft_loss, one optimizer step per batch, no reference model."""
    sft = recipe.sft
    return validate(
        JobConfig(
            model=ModelConfig(hf_checkpoint=str(model_dir)),
            rollout=RolloutConfig(num_rollout=sft.steps, rollout_batch_size=sft.batch_size),
            train=TrainConfig(
                loss_type="sft_loss",
                lr=sft.lr,
                lr_warmup_iters=sft.warmup_steps,
                lr_decay_style=sft.lr_decay_style,
                min_lr=sft.min_lr,
                seed=recipe.seed,
                global_batch_size=sft.batch_size,
                use_dynamic_batch_size=True,
                max_tokens_per_gpu=recipe.grpo.max_tokens_per_gpu,
            ),  # fmt: skip
            # Per-token mean, the usual SFT loss. slime's default per-sample mean weighs each token by
            # 1/len(response), which would favour the short style's first token ~3:1 over its data share.
            algo=AlgoConfig(calculate_per_token_loss=sft.per_token_loss),
            resources=ResourcesConfig(actor_num_gpus_per_node=1),
            logging=LoggingConfig(output_dir=str(output_dir), run_name="demo-sft"),
        )
    )


def grpo_job(
    recipe: DemoRecipe, sft_model_dir: str | Path, assets: DemoAssets, output_dir: str | Path
) -> JobConfig:
    """The RL phase's job, starting from (and, with a KL loss, anchored to) the warm-up's model."""
    g = recipe.grpo
    use_kl = g.kl_loss_coef > 0
    return validate(
        JobConfig(
            model=ModelConfig(hf_checkpoint=str(sft_model_dir)),
            data=DataConfig(
                prompt_data=str(assets.train_path),
                input_key="input",
                label_key="label",
                apply_chat_template=True,
            ),  # fmt: skip
            rollout=RolloutConfig(
                num_rollout=g.num_rollout,
                rollout_batch_size=g.rollout_batch_size,
                n_samples_per_prompt=g.n_samples_per_prompt,
                rollout_max_response_len=g.max_response_len,
                rollout_temperature=g.temperature,
                rm_type="gsm8k",
                rollout_seed=recipe.seed,
            ),  # fmt: skip
            eval=EvalConfig(
                eval_interval=g.eval_interval,
                eval_prompt_data={"demo": str(assets.eval_path)},
                eval_temperature=g.eval_temperature,
                eval_max_response_len=g.max_response_len,
            ),  # fmt: skip
            train=TrainConfig(
                loss_type="policy_loss",
                lr=g.lr,
                lr_warmup_iters=g.lr_warmup_steps,
                lr_decay_style=g.lr_decay_style,
                min_lr=g.min_lr,
                seed=recipe.seed,
                num_steps_per_rollout=g.num_steps_per_rollout,
                use_dynamic_batch_size=True,
                max_tokens_per_gpu=g.max_tokens_per_gpu,
            ),  # fmt: skip
            algo=AlgoConfig(
                advantage_estimator="grpo",
                eps_clip=g.eps_clip,
                eps_clip_high=g.eps_clip_high,
                use_kl_loss=use_kl,
                kl_loss_coef=g.kl_loss_coef,
                kl_loss_type="low_var_kl",
                entropy_coef=g.entropy_coef,
            ),  # fmt: skip
            # One trainer rank and one engine, sharing the machine (on CPU: shared-memory weight sync).
            resources=ResourcesConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1, colocate=True),
            logging=LoggingConfig(output_dir=str(output_dir), run_name="demo-grpo"),
        )
    )


# ------------------------------------------------------------------------------------------------------------
# Warm-up batches and experiment overrides
# ------------------------------------------------------------------------------------------------------------
def sft_batch(tokenizer, rows: list[dict], rollout_id: int):
    """A TrainBatch of warm-up conversations: prompt (chat template, generation prompt) + answer + <|im_end|>."""
    from clawrl.data.chat import encode_text, render_chat
    from clawrl.data.train_batch import TrainBatch

    tokens, lengths = [], []
    for row in rows:
        user, assistant = row["messages"]
        prompt = encode_text(tokenizer, render_chat(tokenizer, [user], add_generation_prompt=True))
        response = encode_text(tokenizer, assistant["content"]) + [tokenizer.eos_token_id]
        tokens.append(prompt + response)
        lengths.append(len(response))
    zeros = [0.0] * len(rows)
    return TrainBatch(
        rollout_id=rollout_id, tokens=tokens, response_lengths=lengths, loss_masks=[[1] * n for n in lengths],
        rewards=zeros, raw_rewards=zeros,
    )  # fmt: skip


def apply_override(recipe: DemoRecipe, assignment: str) -> None:
    """Set one field from 'section.field=value' (or 'field=value'); the value is parsed as JSON if it can be."""
    key, sep, text = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set {assignment!r}: expected FIELD=VALUE, e.g. grpo.lr=2e-3")
    *path, name = key.split(".")
    target: Any = recipe
    for part in path:
        target = getattr(target, part)
    if not hasattr(target, name):
        raise ValueError(f"--set {assignment!r}: {type(target).__name__} has no field {name!r}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    setattr(target, name, tuple(value) if isinstance(value, list) else value)
