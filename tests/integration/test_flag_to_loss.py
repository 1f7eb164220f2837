"""Flag-to-loss: every algorithm flag of `clawrl train`, through the real trainer, against an independent
reference (loss_reference.py: plain loops from the formulas, log-probs from transformers in fp64).

Each case is a set of flags. The trainer side (flag_to_loss_worker.py) parses them as `clawrl train` does,
post-processes the rewards of 8 fixed samples (2 prompts x 4; a tool-output span with loss mask 0, a removed
sample, rollout log-probs set off the model's own by hand-chosen amounts) and runs one TrainActor.train:
2 optimizer steps of 4 samples, so the second step is off-policy (old log-probs from before the first step)
and the clip, the dual clip and GSPO's sequence ratio are active. For each step the reference recomputes,
from the same weights, the loss, every logged train/* metric and the gradient. Every case also checks that
the reference itself changes when any of its flags is put back to its default, so a flag the trainer
ignored would fail the comparison.

    .venv/bin/pytest tests/integration/test_flag_to_loss.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from flag_to_loss_worker import (
    MAX_RESPONSE_LEN,
    N_SAMPLES_PER_PROMPT,
    TEMPERATURE,
    job_argv,
    sample,
    train_rollout,
)
from loss_reference import LossFlags, per_sample_mean, reference_step, response_log_probs, rollout_data
from trainer_reference import (
    load_reference_model,
    max_relative_error,
    reference_grads,
    set_weights,
    tiny_checkpoint,
)

from clawrl.trainer.distributed import free_port

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: see tests/conftest.py

WORKER = Path(__file__).with_name("flag_to_loss_worker.py")
PROMPT_LENGTHS = [3, 5, 2, 4, 3, 6, 4, 2]
RESPONSE_LENGTHS = [4, 3, 6, 2, 5, 4, 3, 5]
RAW_REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.5, -0.5]
LOSS_MASKS = {2: [1, 1, 0, 0, 1, 1], 6: [0, 1, 1]}  # tool-output tokens: not trained on
REMOVED = 5  # keeps its place in its group's reward statistics, contributes no loss
# rollout log-prob = the model's own + offset: exp(-offset) spans [0.41, 2.2], beyond the TIS clamps
ROLLOUT_OFFSETS = [0.9, -0.8, 0.05, -0.3, 0.4, -0.05, 0.7]
STEP_IDS = [[0, 1, 2, 3], [4, 5, 6, 7]]
CUSTOM_LOSS = f"{WORKER}:custom_loss"


@dataclass(kw_only=True)
class Assets:
    policy: str
    ref: str
    model: torch.nn.Module
    initial: dict[str, torch.Tensor]
    old: list[list[float]]
    ref_log_probs: list[list[float]]
    samples: list[dict]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Assets:
    root = tmp_path_factory.mktemp("flag_to_loss")
    policy, ref = tiny_checkpoint(root / "policy", seed=0), tiny_checkpoint(root / "ref", seed=1)
    model, ref_model = load_reference_model(policy), load_reference_model(ref)
    gen = torch.Generator().manual_seed(7)
    shapes = list(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True))
    tokens = [torch.randint(1, 500, (p + r,), generator=gen).tolist() for p, r in shapes]
    with torch.no_grad():
        old, ref_lp = (
            [
                response_log_probs(m, t, r, TEMPERATURE)[0].tolist()
                for t, (_, r) in zip(tokens, shapes, strict=True)
            ]
            for m in (model, ref_model)
        )
    offsets = iter(ROLLOUT_OFFSETS * 10)  # cycled over the rollout's tokens in order
    samples = [
        sample(
            index=i,
            group=i // N_SAMPLES_PER_PROMPT,
            tokens=toks,
            response_length=len(old[i]),
            reward=RAW_REWARDS[i],
            loss_mask=LOSS_MASKS.get(i),
            rollout_log_probs=[lp + next(offsets) for lp in old[i]],
            removed=i == REMOVED,
        )
        for i, toks in enumerate(tokens)
    ]
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Assets(policy=policy, ref=ref, model=model, initial=initial, old=old, ref_log_probs=ref_lp,
                  samples=samples)  # fmt: skip


def _masks() -> list[list[int]]:
    return [[0] * r if i == REMOVED else LOSS_MASKS.get(i, [1] * r) for i, r in enumerate(RESPONSE_LENGTHS)]


def _reference_data(assets: Assets, flags: LossFlags):
    return rollout_data(
        flags, tokens=[s["tokens"] for s in assets.samples], response_lengths=RESPONSE_LENGTHS,
        masks=_masks(), raw_rewards=RAW_REWARDS, n=N_SAMPLES_PER_PROMPT, old=assets.old,
        ref=assets.ref_log_probs, rollout=[s["rollout_log_probs"] for s in assets.samples],
    )  # fmt: skip


def _custom_terms(log_probs, old, adv):
    """What flag_to_loss_worker.custom_loss computes, per token."""
    loss = [-a * lp + 0.5 * (lp - o) ** 2 for lp, o, a in zip(log_probs, old, adv, strict=True)]
    return {"loss": loss, "custom_advantage": list(adv)}


def _reference_steps(assets: Assets, flags: LossFlags, weights_after_first, custom: bool, grads: bool):
    """Per optimizer step: (loss value, metrics, gradients or None) from the reference."""
    data = _reference_data(assets, flags)
    out = []
    for step, ids in enumerate(STEP_IDS):
        set_weights(assets.model, assets.initial if step == 0 else weights_after_first)
        with torch.set_grad_enabled(grads):
            loss, metrics = reference_step(
                flags, assets.model, data, ids, temperature=TEMPERATURE, max_response_len=MAX_RESPONSE_LEN,
                custom_terms=_custom_terms if custom else None,
            )  # fmt: skip
        out.append((loss.item(), metrics, reference_grads(assets.model, loss) if grads else None))
    return data, out


def check_against_reference(assets: Assets, flags: LossFlags, result: dict, *, custom: bool = False) -> None:
    """The trainer's metrics and gradients of both optimizer steps equal the reference's."""
    data, steps = _reference_steps(assets, flags, result["weights"][0], custom, grads=True)
    metrics = result["metrics"]
    rollout_want = {"advantages": data.advantages, "rollout_log_probs": data.rollout}
    if not flags.use_rollout_logprobs or flags.get_mismatch_metrics:  # else the recompute pass is skipped
        rollout_want["log_probs"] = data.train
    if flags.use_kl_loss or flags.kl_coef:  # the reference model runs only when a KL term needs it
        rollout_want["ref_log_probs"] = data.ref
    assert {k.removeprefix("rollout/") for k in metrics if k.startswith("rollout/")} == set(rollout_want)
    for name, values in rollout_want.items():
        want = per_sample_mean(values, data.masks)
        assert metrics[f"rollout/{name}"] == pytest.approx(want, rel=1e-5, abs=1e-6), name
    for step, (_, want, want_grads) in enumerate(steps):
        got = metrics["train"][step]
        assert {k.removeprefix("train/") for k in got} - {"grad_norm", "lr"} == set(want), step
        for name, value in want.items():
            assert got[f"train/{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, name)
        assert max_relative_error(result["grads"][step], want_grads) <= 1e-5, step
    _check_flags_matter(assets, flags, result, steps, custom)


def _check_flags_matter(assets, flags, result, steps, custom) -> None:
    """Each non-default flag changes the reference's losses or metrics: the comparison above would catch
    a trainer that ignored it."""
    for f in dataclasses.fields(flags):
        if getattr(flags, f.name) == f.default or f.name == "loss_type":
            continue
        reset = dataclasses.replace(flags, **{f.name: f.default})
        _, other = _reference_steps(assets, reset, result["weights"][0], custom, grads=False)
        changed = any(
            abs(a[1][name] - b[1].get(name, 0.0)) > 1e-4 * max(1.0, abs(a[1][name]))
            for a, b in zip(steps, other, strict=True)
            for name in a[1]
        )
        assert changed, f"--{f.name.replace('_', '-')} {getattr(flags, f.name)} changes nothing in this case"


# --------------------------------------------------------------------------------------------- cases
RPP = dict(normalize_advantages=True)
MIS = "clawrl.algo.tis:mis_function"
MISMATCH_CASES = {
    "rollout_logprobs": LossFlags(use_rollout_logprobs=True),
    "rollout_logprobs_kl_reward": LossFlags(
        advantage_estimator="reinforce_plus_plus", kl_coef=0.5, use_rollout_logprobs=True, **RPP
    ),
    "rollout_logprobs_mismatch_metrics": LossFlags(
        use_rollout_logprobs=True, get_mismatch_metrics=True, custom_tis_function_path=MIS
    ),
    "icepop": LossFlags(
        use_tis=True,
        custom_tis_function_path="clawrl.algo.tis:icepop_function",
        tis_clip=1.3,
        tis_clip_low=0.5,
    ),
    "icepop_metrics_only": LossFlags(
        get_mismatch_metrics=True, custom_tis_function_path="clawrl.algo.tis.icepop_function"
    ),
    "mis_truncate_token": LossFlags(use_tis=True, custom_tis_function_path=MIS, tis_upper_bound=1.5),
    "mis_clip_sequence": LossFlags(
        use_tis=True, custom_tis_function_path=MIS, tis_level="sequence", tis_mode="clip", tis_lower_bound=0.6
    ),
    "mis_mask_geometric": LossFlags(
        use_tis=True,
        custom_tis_function_path=MIS,
        tis_level="geometric",
        tis_mode="mask",
        tis_upper_bound=1.2,
    ),
    "mis_mask_token_per_token": LossFlags(
        use_tis=True, custom_tis_function_path=MIS, tis_mode="mask", calculate_per_token_loss=True
    ),
    "mis_rs_veto": LossFlags(
        use_tis=True,
        custom_tis_function_path=MIS,
        use_rs=True,
        rs_lower_bound=0.45,
        rs_upper_bound=1.2,
        rs_veto_threshold=0.42,
    ),
    "mis_rs_sequence": LossFlags(
        use_tis=True, custom_tis_function_path=MIS, use_rs=True, rs_level="sequence", rs_upper_bound=3.0
    ),
    "mis_metrics_only": LossFlags(get_mismatch_metrics=True, custom_tis_function_path=MIS),
    "mis_rs_without_is": LossFlags(
        get_mismatch_metrics=True, custom_tis_function_path=MIS, use_rs=True, rs_level="geometric"
    ),
}
KITCHEN_SINK = LossFlags(
    normalize_advantages=True, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k3", eps_clip=0.1,
    eps_clip_high=0.3, eps_clip_c=1.05, entropy_coef=0.05, use_tis=True, tis_clip=1.5, tis_clip_low=0.5,
)  # fmt: skip
CASES = {
    # advantage estimators (and the KL penalty in the reward where the estimator has one)
    "grpo": LossFlags(),
    "gspo": LossFlags(advantage_estimator="gspo", eps_clip=0.02, eps_clip_high=0.03),
    "dr_grpo": LossFlags(advantage_estimator="dr_grpo"),
    "rloo": LossFlags(advantage_estimator="rloo"),
    "rpp": LossFlags(
        advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=0.9, kl_loss_type="k2", **RPP
    ),
    "rpp_k1": LossFlags(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, **RPP),
    "rpp_baseline": LossFlags(
        advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5, kl_loss_type="low_var_kl", **RPP
    ),
    "rpp_baseline_k3": LossFlags(
        advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5, kl_loss_type="k3", **RPP
    ),
    "rpp_baseline_raw": LossFlags(
        advantage_estimator="reinforce_plus_plus_baseline", rewards_normalization=False, kl_coef=0.5, **RPP
    ),
    # reward normalisation and whitening
    "grpo_no_std": LossFlags(grpo_std_normalization=False),
    "gspo_raw_rewards": LossFlags(advantage_estimator="gspo", rewards_normalization=False),
    "grpo_whitened": LossFlags(normalize_advantages=True),
    # KL loss estimators
    **{
        f"kl_loss_{kind}": LossFlags(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type=kind)
        for kind in ("k1", "k2", "k3", "low_var_kl")
    },
    # clipping, TIS, entropy
    "clip_higher": LossFlags(eps_clip=0.1, eps_clip_high=0.3),
    "dual_clip": LossFlags(eps_clip_c=1.05),
    "tis": LossFlags(use_tis=True),
    "tis_clamps": LossFlags(use_tis=True, tis_clip=1.5, tis_clip_low=0.5),
    "entropy": LossFlags(entropy_coef=0.05),
    "gspo_tis": LossFlags(advantage_estimator="gspo", use_tis=True),
    # train/rollout mismatch: rollout log-probs as the old policy, TIS functions, MIS, rejection sampling
    **MISMATCH_CASES,
    # aggregation
    "per_token": LossFlags(calculate_per_token_loss=True),
    "dr_grpo_per_token": LossFlags(advantage_estimator="dr_grpo", calculate_per_token_loss=True),
    # loss types
    "sft_loss": LossFlags(loss_type="sft_loss"),
    "kitchen_sink": KITCHEN_SINK,
}


def _argv(assets: Assets, flags: LossFlags, layout: str, custom: bool = False) -> list[str]:
    extra = ["--loss-type", "custom_loss", "--custom-loss-function-path", CUSTOM_LOSS] if custom else []
    return job_argv(assets.policy, assets.ref, layout, [*flags.argv(), *extra])


@pytest.mark.parametrize("name", list(CASES))
def test_flags_match_reference(assets, name):
    flags = CASES[name]
    result = train_rollout(_argv(assets, flags, "packed"), assets.samples)
    check_against_reference(assets, flags, result)


@pytest.mark.parametrize("layout", ["mbs1", "mbs3"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_micro_batching_matches_reference(assets, layout, per_token):
    flags = dataclasses.replace(KITCHEN_SINK, calculate_per_token_loss=per_token)
    result = train_rollout(_argv(assets, flags, layout), assets.samples)
    check_against_reference(assets, flags, result)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_batch_normalize_matches_reference(assets, level):
    """--tis-batch-normalize rescales over one call of the function (a micro-batch): one per step here."""
    flags = LossFlags(use_tis=True, custom_tis_function_path=MIS, tis_level=level, tis_batch_normalize=True,
                      tis_mode="clip", tis_upper_bound=1.8)  # fmt: skip
    result = train_rollout(_argv(assets, flags, "mbs4"), assets.samples)
    check_against_reference(assets, flags, result)


def test_custom_loss_matches_reference(assets):
    flags = LossFlags()
    result = train_rollout(_argv(assets, flags, "packed", custom=True), assets.samples)
    check_against_reference(assets, flags, result, custom=True)


TWO_RANK_CASES = {
    "kitchen_sink": (KITCHEN_SINK, "packed"),
    "kitchen_sink_per_token": (dataclasses.replace(KITCHEN_SINK, calculate_per_token_loss=True), "mbs1"),
    "dr_grpo": (CASES["dr_grpo"], "packed"),
    "gspo": (CASES["gspo"], "mbs1"),
    "rpp": (CASES["rpp"], "packed"),
    "mis_rs_veto": (CASES["mis_rs_veto"], "mbs1"),
    "rollout_logprobs_kl_reward": (CASES["rollout_logprobs_kl_reward"], "packed"),
}


@pytest.mark.slow  # two worker processes start torch and a gloo group: ~15-40 s on 2 shared cores
def test_two_ranks_match_reference(assets, tmp_path):
    spec = {
        "samples": assets.samples,
        "cases": [
            {"argv": _argv(assets, f, layout), "port": free_port()} for f, layout in TWO_RANK_CASES.values()
        ],
    }
    torch.save(spec, tmp_path / "spec.pt")
    out = tmp_path / "out.pt"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--spec",
                str(tmp_path / "spec.pt"),
                "--rank",
                str(rank),
                "--world-size",
                "2",
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-5000:]
    results = torch.load(out, weights_only=True)
    for (name, (flags, _)), result in zip(TWO_RANK_CASES.items(), results, strict=True):
        try:
            check_against_reference(assets, flags, result)
        except AssertionError as e:
            raise AssertionError(f"2 ranks, case {name}: {e}") from e
