"""Checks of a training job's inputs that need no Ray and no GPU, run before anything starts.

    preflight(job)        # ConfigError naming the flag, file (and line) and the bad value; nothing is written

What a job would otherwise discover 10-30 s later inside a Ray actor's traceback: the model directory
(exists, config.json readable, an architecture the trainer and the engine implement), the prompt datasets
(readable, every line valid JSON, --input-key / --label-key present), the reward (a known --rm-type, or a
--custom-rm-path that imports and has a callable signature), the other plugin paths (import and callable),
the dumps a replay reads, and the output directory (creatable and writable). Rules between flags are not
here: `validate` and `check_loop_flags` (clawrl/config/loop_rules.py) run first.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from clawrl.config.errors import ConfigError
from clawrl.config.job import JobConfig

# Plugin flags checked by import; the reward and the generate function have their own signature checks.
_PLUGIN_FLAGS = {
    "rollout_function_path": "--rollout-function-path",
    "dynamic_sampling_filter_path": "--dynamic-sampling-filter-path",
    "custom_loss_function_path": "--custom-loss-function-path",
    "custom_env_path": "--custom-env-path",
    "custom_tis_function_path": "--custom-tis-function-path",
}


def preflight(job: JobConfig) -> None:
    """Raise ConfigError for the first unusable input (see the module docstring)."""
    _model(job)
    _datasets(job)
    _plugins(job)
    _replay(job)
    _stall_points()
    _output(job)


def _stall_points() -> None:
    from clawrl.stall_points import ENV_VAR, POINTS, unknown

    bad = unknown()
    if bad:
        raise ConfigError(f"{ENV_VAR}: unknown stall point {bad[0]!r}; known: {', '.join(POINTS)}")


def _model(job: JobConfig) -> None:
    from clawrl.models.config import SUPPORTED_ARCHS

    m = job.model
    if not m.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required: the HF directory of the initial policy (unset)")
    root = Path(m.hf_checkpoint)
    if not root.is_dir():
        raise ConfigError(f"--hf-checkpoint {m.hf_checkpoint!r}: no such directory")
    config = root / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise ConfigError(f"--hf-checkpoint {m.hf_checkpoint!r}: cannot read {config}: {error}") from None
    if model_type in SUPPORTED_ARCHS:
        return
    # Other architectures: the trainer needs --model-impl hf, the engine serves them through transformers.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if m.model_impl == "native" or not known:
        who = "the trainer (--model-impl native)" if known else "transformers (as a causal LM)"
        raise ConfigError(
            f"--hf-checkpoint {m.hf_checkpoint!r}: model_type {model_type!r} is not supported by {who}; "
            f"supported: {', '.join(SUPPORTED_ARCHS)} natively, and with --model-impl hf any causal-LM "
            "model_type transformers knows (mistral, gemma, phi3, ...)"
        )


def _datasets(job: JobConfig) -> None:
    d = job.data
    if d.prompt_data:
        _dataset(d.prompt_data, "--prompt-data", job)
    for name, path in job.eval.eval_prompt_data.items():
        _dataset(path, f"--eval-prompt-data {name}", job)


def _dataset(spec: str, flag: str, job: JobConfig) -> None:
    from clawrl.data.dataset import DatasetError, read_located_rows

    try:
        rows = read_located_rows(spec)
    except DatasetError as error:
        raise ConfigError(f"{flag}: {error}") from None
    if not rows:
        raise ConfigError(f"{flag} {spec!r}: no rows")
    keys = [("--input-key", job.data.input_key), ("--label-key", job.data.label_key)]
    for row in rows:
        for key_flag, key in keys:
            if key is not None and key not in row.data:
                raise ConfigError(
                    f"{flag}: {row.where}: no {key_flag} {key!r} field (fields: {sorted(row.data)[:8]})"
                )


def _plugins(job: JobConfig) -> None:
    from clawrl.config.plugins import PluginError, load_function

    r = job.rollout
    try:
        if r.rm_type or r.custom_rm_path:
            _reward(job)
        if r.custom_generate_function_path:
            from clawrl.rollout.hooks import GenerateFunctions

            GenerateFunctions(r.custom_generate_function_path)
        for section in (job.rollout, job.train, job.algo):
            for name, flag in _PLUGIN_FLAGS.items():
                path = getattr(section, name, None)
                if path:
                    load_function(path, flag)
    except (PluginError, ValueError) as error:
        raise ConfigError(str(error)) from None
    except Exception as error:  # the plugin's own module failed to import
        raise ConfigError(f"a plugin module failed to import: {type(error).__name__}: {error}") from None


def _reward(job: JobConfig) -> None:
    from clawrl.rollout.rewards import build_reward_fn

    r = job.rollout
    fn = build_reward_fn(rm_type=r.rm_type, custom_rm_path=r.custom_rm_path, rm_url=r.rm_url,
                         reward_key=r.reward_key, args=job.to_namespace())  # fmt: skip
    asyncio.run(fn.aclose())


def _replay(job: JobConfig) -> None:
    if job.debug.load_debug_rollout_data:
        from clawrl.rollout.replay import ReplaySource

        ReplaySource(job).num_rollout()  # every dump the run will read exists


def _output(job: JobConfig) -> None:
    for flag, path in (("--output-dir", job.logging.output_dir), ("--save", job.model.save)):
        if path:
            _writable(flag, Path(path))
    metrics = Path(job.logging.output_dir or "") / "metrics.jsonl"
    if job.logging.output_dir and not job.model.load and metrics.is_file() and metrics.stat().st_size > 0:
        raise ConfigError(
            f"--output-dir {job.logging.output_dir!r} already holds a run's metrics ({metrics}); "
            "choose another directory, or resume that run with --load"
        )


def _writable(flag: str, path: Path) -> None:
    """The directory exists and is writable, or its nearest existing parent is (nothing is created)."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {str(path)!r}: {probe} is not writable")
