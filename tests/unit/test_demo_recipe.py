"""The demo recipe's consistency: the response budget, the job configs it implies, SFT batches, overrides."""

from pathlib import Path

import pytest

from clawrl.data.chat import encode_text
from clawrl.demo.recipe import DemoAssets, DemoRecipe, apply_override, grpo_job, sft_batch, sft_job
from clawrl.demo.task import KINDS, TaskSpec, generate_problems, sft_row
from clawrl.models.tiny import build_tiny_tokenizer
from clawrl.rollout.rewards.gsm8k import gsm8k_score


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(DemoRecipe().model.vocab_size)


def test_every_concise_answer_fits_the_budget_and_no_verbose_one_does(tokenizer):
    recipe = DemoRecipe()
    budget = recipe.grpo.max_response_len
    problems = generate_problems(600, recipe.task, seed=0)
    assert {p.kind for p in problems} == set(KINDS)
    for p in problems:
        concise = encode_text(tokenizer, p.target()) + [tokenizer.eos_token_id]
        assert len(concise) <= budget, (p.target(), len(concise))
        # A verbose answer cut off at the budget holds no number at all, so it scores 0.
        cut = tokenizer.decode(encode_text(tokenizer, p.target(verbose=True))[:budget])
        assert not any(ch.isdigit() for ch in cut), cut
        assert gsm8k_score(cut, p.label) == 0.0


def test_the_two_styles_part_at_one_first_token(tokenizer):
    """Every verbose answer starts with the same token and every concise one with a digit: after SFT the
    style is one first-token decision whose odds follow the teacher's mix, not the model's name copying."""
    problems = generate_problems(300, DemoRecipe().task, seed=1)
    firsts = {encode_text(tokenizer, p.target(verbose=True))[0] for p in problems}
    assert len(firsts) == 1
    assert not tokenizer.decode(list(firsts)).strip()[0].isdigit()
    assert all(tokenizer.decode(encode_text(tokenizer, p.target())[:1]).isdigit() for p in problems)


def test_default_recipe_says_what_the_bar_depends_on():
    recipe = DemoRecipe()
    assert recipe.num_eval >= 100  # the accuracy bar is measured on at least 100 held-out problems
    assert recipe.grpo.eval_temperature == 0.0  # greedy eval
    assert (
        0.5 < recipe.task.verbose_fraction < 1.0
    )  # greedy opens verbosely after SFT; sampling often does not


def _assets(tmp_path: Path) -> DemoAssets:
    return DemoAssets(model_dir=tmp_path / "m", train_path=tmp_path / "train.jsonl",
                      eval_path=tmp_path / "eval.jsonl", sft_path=tmp_path / "sft.jsonl")  # fmt: skip


def test_sft_job_is_a_per_token_sft_loss_with_one_step_per_batch(tmp_path):
    recipe = DemoRecipe()
    job = sft_job(recipe, tmp_path / "m", tmp_path / "out")
    assert job.train.loss_type == "sft_loss"
    assert job.algo.calculate_per_token_loss
    assert job.train.lr == recipe.sft.lr and job.train.lr_warmup_iters == recipe.sft.warmup_steps
    assert job.train.global_batch_size == recipe.sft.batch_size and job.train.num_steps_per_rollout == 1
    assert job.model.hf_checkpoint == str(tmp_path / "m")


def test_grpo_job_carries_the_recipe_as_slime_flags(tmp_path):
    recipe = DemoRecipe()
    g = recipe.grpo
    job = grpo_job(recipe, tmp_path / "sft", _assets(tmp_path), tmp_path / "out")
    assert job.model.hf_checkpoint == job.model.ref_load == str(tmp_path / "sft")
    assert (job.data.prompt_data, job.data.input_key, job.data.label_key) == (
        str(tmp_path / "train.jsonl"), "input", "label"
    )  # fmt: skip
    assert job.data.apply_chat_template
    r = job.rollout
    assert (r.rollout_batch_size, r.n_samples_per_prompt, r.num_rollout) == (
        g.rollout_batch_size, g.n_samples_per_prompt, g.num_rollout
    )  # fmt: skip
    assert (r.rollout_max_response_len, r.rollout_temperature, r.rm_type) == (
        g.max_response_len, g.temperature, "gsm8k"
    )  # fmt: skip
    assert job.eval.eval_prompt_data == {"demo": str(tmp_path / "eval.jsonl")}
    assert (job.eval.eval_temperature, job.eval.eval_max_response_len) == (0.0, g.max_response_len)
    assert job.train.loss_type == "policy_loss" and job.train.lr == g.lr
    assert (
        job.train.global_batch_size * g.num_steps_per_rollout == g.rollout_batch_size * g.n_samples_per_prompt
    )
    assert job.algo.advantage_estimator == "grpo"
    assert job.algo.use_kl_loss == (g.kl_loss_coef > 0)


def test_sft_batch_is_prompt_then_answer_then_end_of_turn(tokenizer):
    problem = generate_problems(1, TaskSpec(kinds=("add",)), seed=0)[0]
    row = sft_row(problem)
    batch = sft_batch(tokenizer, [row, row], rollout_id=7)
    assert batch.rollout_id == 7 and len(batch) == 2
    tokens, n = batch.tokens[0], batch.response_lengths[0]
    assert tokenizer.decode(tokens[-n:]) == problem.target() + "<|im_end|>"
    assert (
        tokenizer.decode(tokens[:-n])
        == f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert batch.loss_masks[0] == [1] * n
    assert batch.rewards == [0.0, 0.0]


def test_override_sets_nested_fields_and_names_bad_ones():
    recipe = DemoRecipe()
    apply_override(recipe, "grpo.lr=2e-3")
    apply_override(recipe, 'task.kinds=["add", "mul"]')
    apply_override(recipe, "seed=5")
    assert recipe.grpo.lr == 2e-3 and recipe.task.kinds == ("add", "mul") and recipe.seed == 5
    with pytest.raises(ValueError, match="GRPOSettings has no field 'lrr'"):
        apply_override(recipe, "grpo.lrr=1")
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        apply_override(recipe, "grpo.lr")
