"""Cross-flag validation and derived defaults of a job, following slime's `slime_validate_args`.

`validate(job)` returns a resolved copy (the input is untouched) and is idempotent, so a config read back
from a checkpoint validates to itself. The first broken rule raises one ConfigError naming the flags and
values. The rules (slime's batch-size relations and its argument validation, for the flags clawrl has):

- eval: --eval-interval needs --eval-prompt-data; unset eval sampling values take the rollout's.
- model: --ref-load defaults to --hf-checkpoint (the reference is the initial policy); the KL terms
  (--use-kl-loss, --kl-coef != 0) need one of them; an explicit, different --ref-load must exist;
  --save-interval needs --save; with --lora-rank and the native decoder, --target-modules names its
  linear layers.
- algorithm: --eps-clip-high defaults to --eps-clip; --kl-coef and --kl-loss-coef not both non-zero;
  reinforce_plus_plus[_baseline] need --normalize-advantages; --tis-clip-low <= --tis-clip; --kl-coef only
  with an estimator that folds it into the reward (ppo, reinforce_plus_plus[_baseline]: slime ignores it
  elsewhere, clawrl's advantage code refuses it); rloo needs --n-samples-per-prompt >= 2.
- critic: --critic-load, --critic-lr, --critic-lr-warmup-iters and --num-critic-only-steps need
  --advantage-estimator ppo; ppo needs --loss-type policy_loss and --model-impl native, an existing
  --critic-load, --min-lr <= --critic-lr (which defaults to --lr).
- train/rollout mismatch (slime's rules, then flags slime would silently ignore): --use-tis and
  --use-rollout-logprobs exclude each other; --get-mismatch-metrics needs --custom-tis-function-path;
  --custom-tis-function-path needs --use-tis or --get-mismatch-metrics; both need --loss-type policy_loss;
  the MIS flags (--tis-level ... --rs-veto-threshold) need --custom-tis-function-path, the --rs-* ones
  --use-rs; bounds are ordered; --tis-batch-normalize works at token or sequence level.
- batch sizes: --num-steps-per-rollout k sets --global-batch-size = rollout samples // k (a given one must
  agree), else it defaults to all of them, and must divide them (num_steps_per_rollout is filled in);
  --over-sampling-batch-size defaults to and is >= --rollout-batch-size; --use-dynamic-batch-size needs
  --max-tokens-per-gpu; --n-samples-per-prompt 1 turns off std normalisation.
- run length: --num-rollout or --num-epoch; --num-epoch needs --prompt-data.
- partial rollouts: --partial-rollout needs requests left over to keep (--over-sampling-batch-size >
  --rollout-batch-size, or a --dynamic-sampling-filter-path whose drops cause refills), clawrl's default
  rollout (not --rollout-function-path) and a generate function that can continue a partial response (not
  the multi-turn one); --mask-offpolicy-in-partial-rollout and --max-weight-staleness need it.
- a job a loop runs: `check_loop_flags` in clawrl/config/loop_rules.py, called by `clawrl train[-async]`
  after validate (validate() alone also resolves partial jobs built in Python).
- resources: --offload sets both offloads; --colocate defaults both to on and --rollout-num-gpus to the
  trainer's GPUs; unset offloads become False; --rollout-num-gpus-per-engine divides --rollout-num-gpus;
  --multi-node defaults to on with --ray-address.
- rewards and losses: --rm-type remote_rm needs --rm-url; --loss-type custom_loss needs its function path;
  --min-lr <= --lr.
- lengths: --rollout-max-prompt-len <= --sglang-context-length - 1 (room for one response token).
- debugging: --debug-rollout-only and --debug-train-only exclude each other; --load-debug-rollout-data implies
  --debug-train-only, which needs it (nothing else to train on); --dump-details DIR sets the rollout and train
  dump templates under DIR; the two templates differ; a template is a str.format string whose only field is
  {rollout_id} (without it every dump overwrites one file: a warning); --fault-injection names an engine
  the job has (after the resources are resolved); --debug-rollout-only turns off --colocate and both
  offloads and gives the trainer's GPUs to the engines; --ci-test implies
  --check-weight-update-equal when weights are synced.
- external engines (--rollout-external-engine-addrs): clawrl starts no engine, so --colocate,
  --rollout-num-gpus > 0, --offload-rollout, --fault-injection and --debug-train-only (which generates
  nothing) are refused.
- --true-on-policy-mode (alias --true-on-policy): refused with MoE checkpoints, --model-impl hf, LoRA,
  --rollout-num-gpus-per-engine > 1, external engines, and without CUDA (unless TRITON_INTERPRET=1).
- weight transport: --update-weight-transport disk needs --update-weight-disk-dir, and the disk flags need
  it; distributed (a broadcast group) cannot share GPUs (--colocate).
- output: --run-name defaults to run-<timestamp>, --output-dir to outputs/<run name>.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time

from clawrl.config.algo import AlgoConfig
from clawrl.config.errors import ConfigError, flag_of
from clawrl.config.fault import FaultSpec
from clawrl.config.job import JobConfig
from clawrl.config.templates import check_template
from clawrl.config.train import NATIVE_LINEAR_MODULES, parse_target_modules

logger = logging.getLogger(__name__)

# Estimators whose advantages use --kl-coef (slime: grpo/gspo ignore it and use the KL loss instead).
_KL_REWARD_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def validate(job: JobConfig) -> JobConfig:
    """A copy of `job` with derived defaults filled in; ConfigError on the first broken cross-flag rule."""
    job = copy.deepcopy(job)
    for rule in (
        _eval,
        _model_paths,
        _algorithm,
        _mismatch,
        _critic,
        _batch_sizes,
        _partial_rollout,
        _run_length,
        _debug,
        _external_engines,
        _true_on_policy,
        _weight_transport,
        _resources,
        _fault_target,
        _rewards_and_losses,
        _prompt_fits_context,
        _output,
    ):
        rule(job)
    return job


def _eval(job: JobConfig) -> None:
    e, r = job.eval, job.rollout
    if e.eval_interval is not None and not e.eval_prompt_data:
        raise ConfigError(
            f"--eval-interval {e.eval_interval} requires --eval-prompt-data NAME PATH [NAME PATH ...]"
        )
    for name in ("temperature", "top_p", "top_k", "max_response_len"):
        if getattr(e, f"eval_{name}") is None:
            setattr(e, f"eval_{name}", getattr(r, f"rollout_{name}"))


def _model_paths(job: JobConfig) -> None:
    m, a = job.model, job.algo
    if m.ref_load is None:
        m.ref_load = m.hf_checkpoint
    elif m.ref_load != m.hf_checkpoint and not os.path.exists(m.ref_load):
        raise ConfigError(f"--ref-load {m.ref_load!r} does not exist")
    if (a.use_kl_loss or a.kl_coef != 0) and m.ref_load is None:
        why = "--use-kl-loss" if a.use_kl_loss else f"--kl-coef {a.kl_coef}"
        raise ConfigError(f"{why} needs a reference model: give --hf-checkpoint or --ref-load (both unset)")
    if job.model.save_interval is not None and job.model.save is None and job.model.save_hf is None:
        raise ConfigError(
            f"--save-interval {job.model.save_interval} requires --save DIR or --save-hf TEMPLATE"
        )
    targets = set(parse_target_modules(job.train.target_modules)) - {"all-linear", *NATIVE_LINEAR_MODULES}
    if job.train.lora_rank and m.model_impl == "native" and targets:  # other models' names: at build time
        raise ConfigError(
            f"--target-modules {job.train.target_modules!r}: {sorted(targets)} name no linear layer of the "
            f"native decoder; its linear layers are {', '.join(NATIVE_LINEAR_MODULES)} (or all-linear)"
        )


def _algorithm(job: JobConfig) -> None:
    a = job.algo
    if a.eps_clip_high is None:
        a.eps_clip_high = a.eps_clip
    if a.kl_coef != 0 and a.kl_loss_coef != 0:
        raise ConfigError(
            f"--kl-coef {a.kl_coef} and --kl-loss-coef {a.kl_loss_coef} are both non-zero; use one "
            "(--kl-coef penalises the reward, --kl-loss-coef weights a KL loss)"
        )
    if a.advantage_estimator.startswith("reinforce_plus_plus") and not a.normalize_advantages:
        raise ConfigError(f"--advantage-estimator {a.advantage_estimator} requires --normalize-advantages")
    if a.tis_clip_low > a.tis_clip:
        raise ConfigError(f"--tis-clip-low {a.tis_clip_low} must be <= --tis-clip {a.tis_clip}")
    if a.kl_coef != 0 and a.advantage_estimator not in _KL_REWARD_ESTIMATORS:
        # slime ignores it silently; clawrl's advantage code refuses it, so refuse it here, before Ray.
        raise ConfigError(
            f"--kl-coef {a.kl_coef} has no effect with --advantage-estimator {a.advantage_estimator} (its "
            "advantage is the reward alone); use --use-kl-loss --kl-loss-coef, or an estimator that folds "
            f"the KL into the reward: {', '.join(_KL_REWARD_ESTIMATORS)}"
        )
    n = job.rollout.n_samples_per_prompt
    if a.advantage_estimator == "rloo" and n < 2:
        raise ConfigError(
            f"--advantage-estimator rloo needs --n-samples-per-prompt >= 2, got {n}: its baseline is the "
            "mean reward of the prompt's other samples"
        )
    if a.kl_loss_coef != 0 and not a.use_kl_loss:
        logger.warning("--kl-loss-coef %s has no effect without --use-kl-loss", a.kl_loss_coef)


# MIS settings read only by a --custom-tis-function-path function (clawrl.algo.tis:mis_function).
_MIS_FIELDS = ("tis_level", "tis_mode", "tis_upper_bound", "tis_lower_bound", "tis_batch_normalize", "use_rs",
               "rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")  # fmt: skip
_RS_FIELDS = ("rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")


def _mismatch(job: JobConfig) -> None:
    a, loss_type = job.algo, job.train.loss_type
    if a.use_tis and a.use_rollout_logprobs:
        raise ConfigError(
            "--use-tis and --use-rollout-logprobs exclude each other: with --use-rollout-logprobs the old "
            "log-probs are the rollout's, so there is no train/rollout ratio to correct"
        )
    if a.get_mismatch_metrics and a.custom_tis_function_path is None:
        raise ConfigError(
            "--get-mismatch-metrics requires --custom-tis-function-path MODULE:FN (unset), e.g. "
            "clawrl.algo.tis:mis_function"
        )
    if a.custom_tis_function_path is not None and not (a.use_tis or a.get_mismatch_metrics):
        raise ConfigError(
            f"--custom-tis-function-path {a.custom_tis_function_path!r} is only called with --use-tis or "
            "--get-mismatch-metrics (neither is set)"
        )
    corrected = "--use-tis" if a.use_tis else "--get-mismatch-metrics" if a.get_mismatch_metrics else None
    if corrected and loss_type != "policy_loss":
        raise ConfigError(f"{corrected} applies to --loss-type policy_loss only, got --loss-type {loss_type}")
    if a.use_rollout_logprobs and a.get_mismatch_metrics:
        logger.info("--use-rollout-logprobs with --get-mismatch-metrics: the train log-prob pass still runs")
    _mis_settings(a)


def _mis_settings(a) -> None:
    defaults = AlgoConfig()
    changed = [n for n in _MIS_FIELDS if getattr(a, n) != getattr(defaults, n)]
    given = {n: flag_of(n) if getattr(a, n) is True else f"{flag_of(n)} {getattr(a, n)}" for n in changed}
    if changed and a.custom_tis_function_path is None:
        raise ConfigError(
            f"{given[changed[0]]} is read only by a --custom-tis-function-path function such as "
            "clawrl.algo.tis:mis_function (unset)"
        )
    unused_rs = [n for n in _RS_FIELDS if n in changed]
    if unused_rs and not a.use_rs:
        raise ConfigError(f"{given[unused_rs[0]]} has no effect without --use-rs")
    tis_low = a.tis_lower_bound if a.tis_lower_bound is not None else 1.0 / a.tis_upper_bound
    if a.tis_mode != "truncate" and not tis_low < a.tis_upper_bound:
        raise ConfigError(
            f"--tis-lower-bound {tis_low} must be < --tis-upper-bound {a.tis_upper_bound} (--tis-mode {a.tis_mode})"
        )
    rs_low = a.rs_lower_bound if a.rs_lower_bound is not None else tis_low
    rs_high = a.rs_upper_bound if a.rs_upper_bound is not None else a.tis_upper_bound
    if a.use_rs and not rs_low < rs_high:
        raise ConfigError(
            f"rejection bounds out of order: --rs-lower-bound {rs_low} must be < --rs-upper-bound {rs_high} "
            "(unset ones default to the IS bounds)"
        )
    if a.tis_batch_normalize and a.use_tis and a.tis_level == "geometric":
        raise ConfigError("--tis-batch-normalize works with --tis-level token or sequence, got geometric")


def _batch_sizes(job: JobConfig) -> None:
    r, t = job.rollout, job.train
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    counted = (
        f"--rollout-batch-size {r.rollout_batch_size} x --n-samples-per-prompt {r.n_samples_per_prompt}"
        f" = {samples} samples per rollout"
    )
    if t.num_steps_per_rollout is not None:
        steps = t.num_steps_per_rollout
        if samples % steps:
            raise ConfigError(f"--num-steps-per-rollout {steps} must divide the {counted}")
        if t.global_batch_size is not None and t.global_batch_size != samples // steps:
            raise ConfigError(
                f"--global-batch-size {t.global_batch_size} disagrees with --num-steps-per-rollout {steps}: "
                f"{counted} // {steps} = {samples // steps}"
            )
        t.global_batch_size = samples // steps
    elif t.global_batch_size is None:
        t.global_batch_size = samples
        logger.info("--global-batch-size not set: using all %d samples of a rollout (one step)", samples)
    if samples % t.global_batch_size:
        raise ConfigError(f"--global-batch-size {t.global_batch_size} must divide the {counted}")
    t.num_steps_per_rollout = samples // t.global_batch_size

    if r.over_sampling_batch_size is None:
        r.over_sampling_batch_size = r.rollout_batch_size
    if r.over_sampling_batch_size < r.rollout_batch_size:
        raise ConfigError(
            f"--over-sampling-batch-size {r.over_sampling_batch_size} must be >= "
            f"--rollout-batch-size {r.rollout_batch_size}"
        )
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        raise ConfigError("--use-dynamic-batch-size requires --max-tokens-per-gpu N (unset)")
    if r.n_samples_per_prompt == 1 and job.algo.grpo_std_normalization:
        job.algo.grpo_std_normalization = False
        logger.info("--n-samples-per-prompt 1: group std normalisation turned off")


def _run_length(job: JobConfig) -> None:
    num_rollout, num_epoch = job.rollout.num_rollout, job.data.num_epoch
    if num_rollout is None and num_epoch is None:
        if job.debug.load_debug_rollout_data:
            return  # a replay runs as many rollouts as there are dumps
        raise ConfigError("one of --num-rollout or --num-epoch is required (both unset)")
    if num_epoch is None:
        return
    if num_rollout is not None:
        logger.info(
            "--num-rollout %d and --num-epoch %d both set: --num-epoch is ignored", num_rollout, num_epoch
        )
    elif job.data.prompt_data is None:
        raise ConfigError(f"--num-epoch {num_epoch} requires --prompt-data (epochs count passes over it)")


def _resources(job: JobConfig) -> None:
    r = job.resources
    if r.offload:
        r.offload_train = r.offload_rollout = True
    derived = ""
    if r.colocate:
        r.offload_train = True if r.offload_train is None else r.offload_train
        r.offload_rollout = True if r.offload_rollout is None else r.offload_rollout
        if r.rollout_num_gpus is None:
            r.rollout_num_gpus = r.actor_num_gpus
            derived = (
                f" (from --colocate: --actor-num-nodes {r.actor_num_nodes}"
                f" x --actor-num-gpus-per-node {r.actor_num_gpus_per_node})"
            )
    r.offload_train = bool(r.offload_train)
    r.offload_rollout = bool(r.offload_rollout)
    if r.multi_node is None:
        r.multi_node = r.ray_address is not None  # a joined cluster may span hosts
    if r.rollout_num_gpus is not None and r.rollout_num_gpus % r.rollout_num_gpus_per_engine:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {r.rollout_num_gpus_per_engine} must divide "
            f"--rollout-num-gpus {r.rollout_num_gpus}{derived}"
        )


_CRITIC_FLAGS = {
    "critic_load": None,
    "critic_lr": None,
    "critic_lr_warmup_iters": 0,
    "num_critic_only_steps": 0,
}
"""The critic's flags and their defaults: set to anything else without ppo, they would be ignored."""


def _critic(job: JobConfig) -> None:
    """ppo's critic: the policy loss with the native model; --critic-lr defaults to --lr."""
    a, t = job.algo, job.train
    component = {"num_critic_only_steps": a}
    if a.advantage_estimator != "ppo":
        for name, default in _CRITIC_FLAGS.items():
            value = getattr(component.get(name, t), name)
            if value != default:
                raise ConfigError(
                    f"{flag_of(name)} {value} needs --advantage-estimator ppo (the only estimator with a "
                    f"critic), got --advantage-estimator {a.advantage_estimator}"
                )
        return
    if t.loss_type != "policy_loss":
        raise ConfigError(
            f"--advantage-estimator ppo trains a critic for the policy loss; --loss-type {t.loss_type} "
            "uses no advantages (use --loss-type policy_loss)"
        )
    if job.model.model_impl != "native":
        raise ConfigError(
            f"--advantage-estimator ppo builds its critic from clawrl's native decoder; --model-impl "
            f"{job.model.model_impl} is not supported with it (use --model-impl native)"
        )
    if t.critic_load is not None and not os.path.exists(t.critic_load):
        raise ConfigError(f"--critic-load {t.critic_load!r} does not exist")
    if t.critic_lr is None:
        t.critic_lr = t.lr
    if t.min_lr > t.critic_lr:
        raise ConfigError(
            f"--min-lr {t.min_lr} must be <= --critic-lr {t.critic_lr} (the critic decays to it)"
        )


def _rewards_and_losses(job: JobConfig) -> None:
    r, t = job.rollout, job.train
    if r.rm_type == "remote_rm" and r.rm_url is None:
        raise ConfigError("--rm-type remote_rm requires --rm-url URL (unset)")
    if t.loss_type == "custom_loss" and t.custom_loss_function_path is None:
        raise ConfigError("--loss-type custom_loss requires --custom-loss-function-path MODULE.FN (unset)")
    if t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} must be <= --lr {t.lr}")


def _prompt_fits_context(job: JobConfig) -> None:
    """slime's rule: a prompt of the longest kept length leaves room for at least one response token."""
    prompt_len, context = job.data.rollout_max_prompt_len, job.engine.sglang_context_length
    if prompt_len is not None and context is not None and prompt_len > context - 1:
        raise ConfigError(
            f"--rollout-max-prompt-len {prompt_len} must be <= --sglang-context-length {context} - 1: "
            "a prompt of that length leaves no room for a response token"
        )


def _debug(job: JobConfig) -> None:
    d = job.debug
    if d.debug_rollout_only and (d.debug_train_only or d.load_debug_rollout_data):
        other = "--debug-train-only" if d.debug_train_only else "--load-debug-rollout-data"
        raise ConfigError(f"--debug-rollout-only and {other} exclude each other: pick one half of the run")
    if d.load_debug_rollout_data and not d.debug_train_only:
        d.debug_train_only = True
        logger.info("--load-debug-rollout-data: --debug-train-only turned on (no engines are started)")
    if d.debug_train_only and not d.load_debug_rollout_data:
        raise ConfigError(
            "--debug-train-only needs --load-debug-rollout-data TEMPLATE: without engines it has nothing to train on"
        )
    if d.dump_details:
        d.save_debug_rollout_data = os.path.join(d.dump_details, "rollout_data", "{rollout_id}.pt")
        d.save_debug_train_data = os.path.join(d.dump_details, "train_data", "{rollout_id}.pt")
    if d.save_debug_train_data and d.save_debug_train_data == d.save_debug_rollout_data:
        raise ConfigError(
            f"--save-debug-train-data and --save-debug-rollout-data are the same template "
            f"{d.save_debug_train_data!r}: the train dump would overwrite the rollout dump"
        )
    for name in ("save_debug_rollout_data", "load_debug_rollout_data", "save_debug_train_data"):
        if getattr(d, name) is not None:
            check_template(getattr(d, name), "--" + name.replace("_", "-"))
    if d.debug_rollout_only:
        _rollout_only_resources(job)
    _fault(job)
    if (
        job.ci.ci_test
        and not job.ci.check_weight_update_equal
        and not (d.debug_rollout_only or d.debug_train_only)
    ):
        job.ci.check_weight_update_equal = True
        logger.info("--ci-test: --check-weight-update-equal turned on")


def _fault(job: JobConfig) -> None:
    f, d = job.fault, job.debug
    if f.ci_fault_tolerance and not f.use_fault_tolerance:
        f.use_fault_tolerance = True
    if job.ci.ci_test and f.use_fault_tolerance and f.fault_injection is None and not d.debug_train_only:
        # slime's CI fault injection: engine 0 dies once at the first rollout with id >= 2
        f.fault_injection = "engine=0,rollout=2,mode=kill"
        logger.info("--ci-test --use-fault-tolerance: engine 0 will be killed once at rollout 2")
    if f.fault_injection is not None and d.debug_train_only:
        raise ConfigError(
            f"--fault-injection {f.fault_injection!r} needs engines; --debug-train-only starts none"
        )


def _external_engines(job: JobConfig) -> None:
    """--rollout-external-engine-addrs: the engines run elsewhere; flags about local engines are refused."""
    r, f = job.resources, job.fault
    addrs = r.rollout_external_engine_addrs
    if not addrs:
        return
    given = " ".join(addrs)
    conflicts = [
        ("--colocate", r.colocate),
        (f"--rollout-num-gpus {r.rollout_num_gpus}", bool(r.rollout_num_gpus)),
        ("--offload-rollout", bool(r.offload_rollout) or r.offload),
        (f"--fault-injection {f.fault_injection!r}", f.fault_injection is not None),
        ("--debug-train-only", job.debug.debug_train_only),
    ]
    for flag, present in conflicts:
        if present:
            raise ConfigError(
                f"{flag} cannot be combined with --rollout-external-engine-addrs {given}: clawrl starts no "
                "engine of its own then (it generates with the servers at those addresses)"
            )


def _true_on_policy(job: JobConfig) -> None:
    """--true-on-policy-mode: what the batch-invariant kernels (clawrl/models/batch_invariant.py) cannot run."""
    m, r = job.model, job.resources
    if not m.uses_true_on_policy:
        return
    flag = "--true-on-policy-mode" if m.true_on_policy_mode else "--true-on-policy"
    conflicts = [
        ("--model-impl hf (its kernels are clawrl's native Qwen2/Qwen3/Llama code)", m.model_impl == "hf"),
        (f"--lora-rank {job.train.lora_rank} (the engines serve merged weights)", job.train.lora_rank > 0),
        (f"--rollout-num-gpus-per-engine {r.rollout_num_gpus_per_engine} (tensor-parallel engines)",
         r.rollout_num_gpus_per_engine > 1),
        ("--rollout-external-engine-addrs (engines clawrl does not run)", bool(r.rollout_external_engine_addrs)),
        (f"--hf-checkpoint {m.hf_checkpoint} (an MoE model; dense models only)", _is_moe(m.hf_checkpoint)),
    ]  # fmt: skip
    for what, present in conflicts:
        if present:
            raise ConfigError(f"{flag} cannot be combined with {what}")
    if not r.ray_address and os.environ.get("TRITON_INTERPRET") != "1" and not _has_cuda():
        raise ConfigError(f"{flag} needs CUDA GPUs: its Triton kernels run on CPU only under the interpreter "
                          "(TRITON_INTERPRET=1, for tests)")  # fmt: skip


def _is_moe(model_dir: str | None) -> bool:
    path = os.path.join(model_dir or "", "config.json")
    if not model_dir or not os.path.isfile(path):
        return False  # a missing checkpoint is reported where it is loaded
    with open(path) as f:
        hf = json.load(f)
    return "moe" in str(hf.get("model_type", "")) or bool(
        hf.get("num_experts") or hf.get("num_local_experts")
    )


def _has_cuda() -> bool:
    import torch  # only with --true-on-policy-mode: validate() stays torch-free otherwise

    return torch.cuda.is_available()


def _weight_transport(job: JobConfig) -> None:
    m = job.model
    if m.update_weight_transport == "disk" and not m.update_weight_disk_dir:
        raise ConfigError(
            "--update-weight-transport disk needs --update-weight-disk-dir DIR (a directory the engines can read)"
        )
    if m.update_weight_transport != "disk" and (m.update_weight_disk_dir or m.update_weight_disk_keep_files):
        flag = "--update-weight-disk-dir" if m.update_weight_disk_dir else "--update-weight-disk-keep-files"
        raise ConfigError(f"{flag} is used only with --update-weight-transport disk, got "
                          f"--update-weight-transport {m.update_weight_transport or '(default)'}")  # fmt: skip
    if m.update_weight_transport == "distributed" and job.resources.colocate:
        raise ConfigError(
            "--update-weight-transport distributed cannot be used with --colocate (a broadcast group needs the "
            "engines on GPUs of their own); drop one of them"
        )


def _fault_target(job: JobConfig) -> None:
    """--fault-injection names an engine the job has (the built-in engine takes one GPU slot each)."""
    spec, r = job.fault.fault_injection, job.resources
    if spec is None or r.rollout_num_gpus is None:  # unresolved GPU counts: a partial job built in Python
        return
    num_engines = r.rollout_num_gpus // r.rollout_num_gpus_per_engine
    if FaultSpec.parse(spec).engine >= num_engines:
        raise ConfigError(
            f"--fault-injection {spec!r}: the job has {num_engines} engine(s) (--rollout-num-gpus "
            f"{r.rollout_num_gpus} / --rollout-num-gpus-per-engine {r.rollout_num_gpus_per_engine}), "
            f"numbered from 0"
        )


def _rollout_only_resources(job: JobConfig) -> None:
    """slime's adjustments for --debug-rollout-only: no trainer, so its GPUs go to the engines."""
    res = job.resources
    if res.colocate:
        if res.rollout_num_gpus is None:
            res.rollout_num_gpus = res.actor_num_gpus
            logger.info(
                "--debug-rollout-only: --rollout-num-gpus %d (the trainer's GPUs)", res.rollout_num_gpus
            )
        res.colocate = False
        logger.info("--debug-rollout-only: --colocate turned off (no trainer to share the GPUs with)")
    if res.offload or res.offload_train or res.offload_rollout:
        logger.info("--debug-rollout-only: --offload-train and --offload-rollout turned off")
    res.offload = False
    res.offload_train = res.offload_rollout = False


def _partial_rollout(job: JobConfig) -> None:
    from clawrl.config.rollout import MULTI_TURN_GENERATE_PATHS

    r = job.rollout
    for name in ("mask_offpolicy_in_partial_rollout", "max_weight_staleness"):
        value = getattr(r, name)
        if value not in (None, False) and not r.partial_rollout:
            shown = "" if value is True else f" {value}"
            raise ConfigError(
                f"{flag_of(name)}{shown} only acts on resumed partial samples: add --partial-rollout"
            )
    if not r.partial_rollout:
        return
    if r.rollout_function_path is not None:
        raise ConfigError(
            f"--partial-rollout acts on clawrl's default rollout; --rollout-function-path "
            f"{r.rollout_function_path} replaces it (a custom rollout keeps partial groups itself through "
            "data_source.add_samples)"
        )
    if r.custom_generate_function_path in MULTI_TURN_GENERATE_PATHS:
        raise ConfigError(
            f"--partial-rollout with --custom-generate-function-path {r.custom_generate_function_path}: "
            "multi-turn tool episodes cannot be continued from a partial response"
        )
    if r.over_sampling_batch_size == r.rollout_batch_size and r.dynamic_sampling_filter_path is None:
        raise ConfigError(
            f"--partial-rollout keeps over-sampled requests aborted when the batch is full, but with "
            f"--over-sampling-batch-size {r.over_sampling_batch_size} = --rollout-batch-size "
            f"{r.rollout_batch_size} and no --dynamic-sampling-filter-path no request is ever left over: "
            "raise --over-sampling-batch-size"
        )


def _output(job: JobConfig) -> None:
    log = job.logging
    if log.run_name is None:
        log.run_name = time.strftime("run-%Y%m%d-%H%M%S")
    if log.output_dir is None:
        log.output_dir = os.path.join("outputs", log.run_name)
