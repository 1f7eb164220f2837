"""Every flag combination the trainer, the algorithms or the rollout manager would refuse inside a Ray actor is
refused first, while the flags are parsed (validate() or a component's own field checks), by
check_loop_flags (the rules of a job a loop runs, clawrl/config/loop_rules.py) or by the input
checks of `clawrl train`'s preflight (before Ray starts), with one ConfigError naming the flags.

The table below maps each `raise` in clawrl/trainer, clawrl/algo, clawrl/data/train_batch.py and
clawrl/rollout/manager.py that flags can trigger to the argv that triggers it. Every other raise there is
in INTERNAL with the reason flags cannot reach it (an invariant, or it depends on data, files or a plugin's
behaviour). A scan of those files fails on any raise in neither list, so a new flag-dependent raise needs
a rule before Ray (and a row here) to pass.

    .venv/bin/pytest tests/unit/test_validate_walk.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from clawrl.cli.preflight import preflight
from clawrl.config import ConfigError, build_job_parser, job_from_namespace, validate
from clawrl.config.loop_rules import check_loop_flags

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [
    "clawrl/trainer/*.py",
    "clawrl/algo/*.py",
    "clawrl/data/train_batch.py",
    "clawrl/rollout/manager.py",
]

# 4 prompts x 2 samples = 8 samples per rollout, one trainer rank; no model, data or reward (rows add them).
BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--actor-num-gpus-per-node", "1"]  # fmt: skip
ROLLOUT_INPUTS = ["--prompt-data", "prompts.jsonl", "--rm-type", "math"]
MIS = ["--custom-tis-function-path", "clawrl.algo.tis:mis_function", "--use-tis"]


@dataclass(frozen=True)
class Site:
    """A raise statement: file, enclosing function (Class.method) and a piece of its source text."""

    path: str
    func: str
    snippet: str


@dataclass(frozen=True)
class Rule:
    """Flags that reach `site`, and what the error raised before Ray must say."""

    site: Site
    argv: tuple[str, ...]
    names: tuple[str, ...]
    """Texts (flags and values) the ConfigError message must contain."""
    stage: str = "validate"
    """validate: parsing + validate(); loop: then check_loop_flags; preflight: then clawrl train's
    preflight too (still before Ray)."""


ADV, TIS, POLICY, ACTOR, MANAGER = (
    "clawrl/algo/advantages.py",
    "clawrl/algo/tis.py",
    "clawrl/algo/policy_loss.py",
    "clawrl/trainer/actor.py",
    "clawrl/rollout/manager.py",
)


def _rule(path, func, snippet, argv, names, stage="validate") -> Rule:
    return Rule(site=Site(path, func, snippet), argv=tuple(argv), names=tuple(names), stage=stage)


KL_OUTCOME = "has no effect with --advantage-estimator"
RULES = [
    _rule(ADV, "_grouped", "--n-samples-per-prompt must be >= 1", ["--n-samples-per-prompt", "0"],
          ["--n-samples-per-prompt", "got 0"]),
    _rule(ADV, "leave_one_out_rewards", "needs --n-samples-per-prompt >= 2",
          ["--advantage-estimator", "rloo", "--n-samples-per-prompt", "1"],
          ["--advantage-estimator rloo", "--n-samples-per-prompt >= 2, got 1"]),
    _rule(ADV, "_check_estimator", "is not one of", ["--advantage-estimator", "cispo"],
          ["--advantage-estimator", "'cispo'"]),
    _rule(ADV, "_check_discount", "must be in [0, 1]", ["--gamma", "1.5"], ["--gamma", "got 1.5"]),
    _rule(ADV, "_check_discount", "must be in [0, 1]", ["--lambd", "-0.1"], ["--lambd", "got -0.1"]),
    *[  # the critic trains only beside the policy loss, which is where its values come from
        _rule(ADV, "compute_advantages_and_returns", "needs critic values",
              ["--advantage-estimator", "ppo", "--loss-type", loss,
               *(["--custom-loss-function-path", "m.f"] if loss == "custom_loss" else [])],
              ["--advantage-estimator ppo", f"--loss-type {loss}"])
        for loss in ("sft_loss", "custom_loss")
    ],
    *[
        _rule(ADV, "compute_advantages_and_returns", KL_OUTCOME,
              ["--hf-checkpoint", "m", "--advantage-estimator", est, "--kl-coef", "0.1"],
              ["--kl-coef 0.1", f"--advantage-estimator {est}", "--use-kl-loss"])
        for est in ("grpo", "gspo", "dr_grpo", "rloo")
    ],
    _rule("clawrl/algo/entropy.py", "log_probs_and_entropy", "--rollout-temperature must be > 0",
          ["--rollout-temperature", "0"], ["--rollout-temperature", "got 0.0"]),
    _rule("clawrl/trainer/logprobs.py", "linear_log_probs", "temperature must be > 0",
          ["--rollout-temperature", "-1"], ["--rollout-temperature", "got -1.0"]),
    _rule("clawrl/algo/kl.py", "kl_estimate", "--kl-loss-type", ["--kl-loss-type", "k4"],
          ["--kl-loss-type", "'k4'"]),
    _rule(POLICY, "_clipped_surrogate", "--eps-clip / --eps-clip-high must be >= 0", ["--eps-clip", "-0.1"],
          ["--eps-clip", "got -0.1"]),
    _rule(POLICY, "_clipped_surrogate", "--eps-clip / --eps-clip-high must be >= 0",
          ["--eps-clip-high", "-0.2"], ["--eps-clip-high", "got -0.2"]),
    _rule(POLICY, "_clipped_surrogate", "--eps-clip-c must be > 1", ["--eps-clip-c", "1.0"],
          ["--eps-clip-c", "got 1.0"]),
    _rule("clawrl/algo/value_loss.py", "clipped_value_loss", "--value-clip must be > 0", ["--value-clip", "0"],
          ["--value-clip", "got 0.0"]),
    _rule(TIS, "mismatch_log_ratio", "TIS/RS level", [*MIS, "--tis-level", "segment"],
          ["--tis-level", "'segment'"]),
    _rule(TIS, "mismatch_log_ratio", "TIS/RS level", [*MIS, "--use-rs", "--rs-level", "segment"],
          ["--rs-level", "'segment'"]),
    _rule(TIS, "_log_bounds", "must be < upper bound",
          [*MIS, "--use-rs", "--rs-lower-bound", "3", "--rs-upper-bound", "2"],
          ["--rs-lower-bound 3", "--rs-upper-bound 2"]),
    _rule(TIS, "_log_bounds", "need lower bound >= 0", [*MIS, "--use-rs", "--rs-lower-bound", "-1"],
          ["--rs-lower-bound", "got -1.0"]),
    _rule(TIS, "_log_bounds", "need lower bound >= 0", [*MIS, "--use-rs", "--rs-upper-bound", "0"],
          ["--rs-upper-bound", "got 0.0"]),
    _rule(TIS, "rejection_sampling_mask", "veto threshold must be > 0",
          [*MIS, "--use-rs", "--rs-veto-threshold", "0"], ["--rs-veto-threshold", "got 0.0"]),
    _rule(TIS, "_mis_is_weights", "--tis-mode", [*MIS, "--tis-mode", "cap"], ["--tis-mode", "'cap'"]),
    _rule(TIS, "_batch_normalize", "--tis-batch-normalize works at",
          [*MIS, "--tis-level", "geometric", "--tis-batch-normalize"], ["--tis-batch-normalize", "geometric"]),
    _rule("clawrl/trainer/optim.py", "lr_at", "--lr-decay-style", ["--lr-decay-style", "step"],
          ["--lr-decay-style", "'step'"]),
    _rule("clawrl/trainer/packing.py", "plan_micro_batches", "--micro-batch-size must be >= 1",
          ["--micro-batch-size", "0"], ["--micro-batch-size", "got 0"]),
    _rule("clawrl/trainer/packing.py", "plan_micro_batches", "cannot be spread over",
          [*ROLLOUT_INPUTS, "--global-batch-size", "4", "--actor-num-gpus-per-node", "8"],
          ["--global-batch-size 4", "--actor-num-gpus-per-node 8"], stage="loop"),
    _rule("clawrl/trainer/rl_step.py", "plan_steps", "not a multiple of --global-batch-size",
          ["--global-batch-size", "3"], ["--global-batch-size 3", "--rollout-batch-size 4",
                                         "--n-samples-per-prompt 2"]),
    _rule(ACTOR, "TrainActor._build_model", "--hf-checkpoint is required", ROLLOUT_INPUTS,
          ["--hf-checkpoint is required"], stage="preflight"),
    _rule(MANAGER, "RolloutManager._load_plugins", "no reward function configured",
          ["--prompt-data", "prompts.jsonl"], ["--rm-type", "--custom-rm-path"], stage="loop"),
    _rule(MANAGER, "RolloutManager._load_plugins", "--over-sampling-batch-size",
          ["--over-sampling-batch-size", "3"], ["--over-sampling-batch-size 3", "--rollout-batch-size 4"]),
    _rule(MANAGER, "RolloutManager._train_source", "--prompt-data is required", ["--rm-type", "math"],
          ["--prompt-data is required"], stage="loop"),
    _rule("clawrl/trainer/single_rank.py", "use_single_rank", "needs a trainer of one rank",
          [*ROLLOUT_INPUTS, "--fast-single-rank", "--actor-num-gpus-per-node", "2"],
          ["--fast-single-rank", "this job has 2", "--actor-num-gpus-per-node 2"], stage="loop"),
]  # fmt: skip

# Raises no flag combination reaches once the flags passed validate() and preflight, with why.
INTERNAL = {
    Site(ACTOR, "TrainActor.train", "called while the trainer is offloaded"):
        "call order of the loop (onload before train), not a flag",
    Site(ACTOR, "TrainActor._rollout_log_probs", "needs the rollout's log-probs"):
        "data: a custom generate function returned samples without rollout log-probs",
    Site("clawrl/trainer/optim.py", "clip_grad_norm", "{what} is {value}"): "numerics: a non-finite gradient",
    Site(ACTOR, "TrainActor.save", "needs --save"): "the loop saves the trainer only when --save is set",
    Site("clawrl/trainer/hf_model.py", "HFCausalLM.__init__", "--model-impl hf needs a causal LM"):
        "file: the --hf-checkpoint's architecture has no .model / .lm_head",
    Site("clawrl/trainer/hf_model.py", "HFCausalLM.__init__", "shards `model.layers`"):
        "file: the --hf-checkpoint's architecture has no model.layers",
    Site("clawrl/trainer/hf_model.py", "_segment_lengths", "cu_seqlens ends at"): "invariant of packing",
    Site("clawrl/trainer/hf_model.py", "save_hf_model", "has no parameters"): "file: export source mismatch",
    Site("clawrl/trainer/hf_model.py", "save_hf_model", "no tensors for"): "file: export source mismatch",
    Site("clawrl/trainer/loss.py", "LossFunction.custom", "must return (scalar loss tensor"):
        "plugin: what --custom-loss-function-path returns",
    Site("clawrl/trainer/loss.py", "LossFunction._correct_mismatch", "returned {name} of shape"):
        "plugin: what --custom-tis-function-path returns",
    Site("clawrl/trainer/offload.py", "HostOffload._offload", "called twice"): "call order, not a flag",
    Site("clawrl/trainer/offload.py", "HostOffload._offload", "not resizable"): "tensors of the model, not a flag",
    Site("clawrl/trainer/offload.py", "HostOffload.onload", "without a preceding offload"): "call order",
    Site("clawrl/trainer/packing.py", "plan_micro_batches", "data-parallel size must be >= 1"):
        "the trainer's world size, >= 1 by construction",
    Site("clawrl/trainer/packing.py", "plan_micro_batches", "is smaller than one sample"):
        "data: the length of a generated sample (prompt + response) exceeds --max-tokens-per-gpu",
    Site("clawrl/trainer/critic.py", "build_value_model", "is neither an HF model directory"):
        "file: what the --critic-load directory holds",
    Site("clawrl/trainer/critic.py", "_load_state", "does not fit the --hf-checkpoint architecture"):
        "file: --critic-load holds another architecture's weights",
    Site("clawrl/trainer/critic.py", "Critic.load", "the policy checkpoint is iteration"):
        "file: the --load directory lacks the critic's checkpoint",
    Site("clawrl/trainer/weights.py", "WeightBank.load_", "do not fit the policy model"):
        "file: --ref-load holds another architecture's weights",
    Site(ADV, "_grouped", "rewards must be 1-D"): "invariant: one reward per sample",
    Site(ADV, "_grouped", "are not whole groups"):
        "data: a rollout function or filter returned partial groups",
    Site(ADV, "compute_advantages_and_returns", "rewards for"): "invariant: one reward per sample",
    Site(ADV, "_kl_or_zeros", "needs per-token KL values"):
        "the trainer computes the KL whenever --kl-coef != 0 (validate() ensures a reference model)",
    Site(ADV, "_kl_or_zeros", "kl_N has"): "invariant: one KL value per token",
    Site(ADV, "whiten_advantages", "the loss mask selects no token"):
        "data: every response token of the rollout is masked out",
    Site("clawrl/algo/aggregation.py", "_require_positive", "needs {name} > 0"):
        "the trainer's step counts are >= 1 (--rollout-max-response-len >= 1)",
    Site("clawrl/algo/aggregation.py", "aggregate_loss", "and per-token values"): "invariant: shapes",
    Site("clawrl/algo/aggregation.py", "aggregate_loss", "is not one of"):
        "the trainer maps flags to a known mode (aggregation_mode)",
    Site("clawrl/algo/entropy.py", "log_probs_and_entropy", "expected logits [N, V]"): "invariant: shapes",
    Site("clawrl/algo/entropy.py", "log_probs_and_entropy", "--log-probs-chunk-size"):
        "a constant of the trainer (no such flag)",
    Site("clawrl/algo/kl.py", "kl_estimate", "differ in shape"): "invariant: shapes",
    Site("clawrl/algo/segments.py", "as_lengths", "must be 1-D"): "invariant: shapes",
    Site("clawrl/algo/segments.py", "as_lengths", "must be >= 0"): "invariant: lengths",
    Site("clawrl/algo/segments.py", "as_lengths", "response_lengths sum to"): "invariant: lengths",
    Site("clawrl/data/train_batch.py", "TrainBatch.__post_init__", "entries, tokens has"):
        "data: a sample's fields disagree",
    Site("clawrl/data/train_batch.py", "TrainBatch.__post_init__", "loss mask of"):
        "data: a sample's fields disagree",
    Site("clawrl/data/train_batch.py", "TrainBatch.__post_init__", "no prompt token"):
        "data: a sample without prompt tokens",
    Site("clawrl/data/train_batch.py", "TrainBatch.__post_init__", "rollout_log_probs length"):
        "data: a sample's fields disagree",
    Site(MANAGER, "RolloutManager.num_rollout_for_epochs", "fewer than one --rollout-batch-size"):
        "data: the size of --prompt-data",
    Site(MANAGER, "RolloutManager.load_state_dict", "needs 'data_source'"): "file: a checkpoint's state",
    Site(MANAGER, "RolloutManager._run", "did not return within"): "a deadline, not a flag combination",
    Site(MANAGER, "_post_process", "have different sizes"):
        "data: a rollout function returned groups of different sizes",
    Site(MANAGER, "_with_deadline", "did not finish within"): "a deadline, not a flag combination",
    Site(MANAGER, "_load_tokenizer", "cannot load the tokenizer"): "file: the --hf-checkpoint's tokenizer",
}  # fmt: skip
_CHECKPOINT_FILE = "clawrl/trainer/checkpoint.py"  # every CheckpointError there is about --load's files


def _job_errors(rule: Rule) -> str:
    with pytest.raises(ConfigError) as info:
        job = validate(job_from_namespace(build_job_parser().parse_args([*BASE, *rule.argv])))
        if rule.stage in ("loop", "preflight"):
            check_loop_flags(job, asynchronous=False)
        if rule.stage == "preflight":
            preflight(job)
    return str(info.value)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{Path(r.site.path).stem}:{' '.join(r.argv)}")
def test_each_flag_rule_fails_before_ray_naming_the_flags(rule):
    message = _job_errors(rule)
    assert "\n" not in message
    for name in rule.names:
        assert name in message, (name, message)


def _parse(*argv: str):
    return validate(job_from_namespace(build_job_parser().parse_args([*BASE, *argv])))


def test_the_new_rules_let_the_neighbouring_valid_combinations_pass():
    assert _parse("--advantage-estimator", "rloo").algo.advantage_estimator == "rloo"  # 2 samples a prompt
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        job = _parse("--hf-checkpoint", "m", "--advantage-estimator", estimator, "--kl-coef", "0.1",
                     "--normalize-advantages")  # fmt: skip
        assert job.algo.kl_coef == 0.1
    fits = _parse("--rollout-max-prompt-len", "15", "--sglang-context-length", "16")
    assert fits.data.rollout_max_prompt_len == 15
    message = str(pytest.raises(ConfigError, _parse, "--rollout-max-prompt-len", "16",
                                "--sglang-context-length", "16").value)  # fmt: skip
    assert message.startswith("--rollout-max-prompt-len 16 must be <= --sglang-context-length 16 - 1")


@pytest.mark.parametrize(
    "argv",
    [
        [*ROLLOUT_INPUTS, "--global-batch-size", "8", "--actor-num-gpus-per-node", "8"],  # one sample a rank
        ["--prompt-data", "p.jsonl", "--custom-rm-path", "my.reward"],
        ["--prompt-data", "p.jsonl", "--custom-generate-function-path", "my.generate"],
        ["--rollout-function-path", "my.rollout"],  # makes its own prompts and rewards
        ["--rm-type", "math", "--load-debug-rollout-data", "/nowhere/{rollout_id}.pt"],  # replays dumps
        [
            "--debug-rollout-only",
            *ROLLOUT_INPUTS,
            "--global-batch-size",
            "4",
            "--actor-num-gpus-per-node",
            "8",
        ],
    ],
)
def test_loop_flag_rules_let_valid_jobs_through_to_the_model_check(argv):
    # Past the flag rules, preflight's first check is the model directory, which "m" is not.
    job = _parse("--hf-checkpoint", "m", *argv)
    check_loop_flags(job, asynchronous=False)
    with pytest.raises(ConfigError, match="--hf-checkpoint 'm': no such directory"):
        preflight(job)


# ------------------------------------------------------------------------------------- completeness scan
def _raise_sites() -> list[tuple[str, str, str, int]]:
    """(path, enclosing Class.function, source text, line) of every `raise X(...)` in the scanned files."""
    found = []
    for pattern in SCANNED:
        for file in sorted(ROOT.glob(pattern)):
            source = file.read_text()
            path = file.relative_to(ROOT).as_posix()
            found += _raises_in(ast.parse(source), source, path, [])
    return found


def _raises_in(node, source, path, scope):
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out += _raises_in(child, source, path, [*scope, child.name])
            continue
        if isinstance(child, ast.Raise) and child.exc is not None:  # a bare `raise` re-raises
            text = re.sub(r"\s+", " ", ast.get_source_segment(source, child))
            out.append((path, ".".join(scope), text, child.lineno))
        out += _raises_in(child, source, path, scope)
    return out


def _matches(site: Site, path: str, func: str, text: str) -> bool:
    return site.path == path and site.func == func and site.snippet in text


def test_every_raise_is_a_flag_rule_or_listed_internal():
    flag_sites = {rule.site for rule in RULES}
    unlisted, ambiguous = [], []
    for path, func, text, line in _raise_sites():
        if path == _CHECKPOINT_FILE and text.startswith("raise CheckpointError"):
            continue
        hits = [s for s in (*flag_sites, *INTERNAL) if _matches(s, path, func, text)]
        if not hits:
            unlisted.append(f"{path}:{line} {func}: {text[:100]}")
        elif len(hits) > 1:
            ambiguous.append(f"{path}:{line} {func}: {hits}")
    listing = "\n".join(unlisted)
    assert not unlisted, f"raises that are neither a flag rule (RULES) nor listed internal:\n{listing}"
    assert not ambiguous, "\n".join(ambiguous)


def test_no_listed_site_is_stale():
    sites = _raise_sites()
    stale = [
        s for s in ({rule.site for rule in RULES} | set(INTERNAL))
        if not any(_matches(s, path, func, text) for path, func, text, _ in sites)
    ]  # fmt: skip
    assert not stale, f"listed raise sites that no longer exist (update the table): {stale}"


def test_the_scan_sees_every_raise_statement():
    # A plain text count of `raise Name(` lines in the scanned files: the AST walk must find as many.
    pattern = re.compile(r"^\s*raise [\w.]+\(", re.M)
    by_text = sum(len(pattern.findall(f.read_text())) for p in SCANNED for f in ROOT.glob(p))
    assert len(_raise_sites()) == by_text >= 70
