"""Shared helpers of the GPU end-to-end tests (tests/e2e/test_*.py).

Each test is a plain script the GPU workflow runs as `clawrl gpu-lock-exec --count NUM_GPUS -- python
tests/e2e/<file>`: prepare() fetches the model and dataset into the CI cache if they are missing, execute()
runs a real `clawrl train` whose in-run `--ci-test` checks (metric stream) and `--check-weight-update-equal`
(checksums after every sync) make it exit non-zero on any numeric problem. Under pytest on a machine without
a GPU they are skipped (marker `gpu`).

Environment: CLAWRL_TEST_MODELS_DIR (default /root/models), CLAWRL_TEST_DATASETS_DIR (/root/datasets),
CLAWRL_TEST_OUTPUT_DIR (/tmp/clawrl-e2e), CLAWRL_TEST_ENABLE_EVAL (1), CLAWRL_TEST_ENABLE_INFINITE_RUN (false);
for W&B (wandb_flags): WANDB_API_KEY, GITHUB_RUN_ID, GITHUB_COMMIT_NAME.

Proxies: prepare() downloads through the proxy variables of the environment (the CI passes them into the
job container); the training command is launched without any of them (PROXY_VARIABLES), because its HTTP
calls go to the engines on this machine and must not be sent to a proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Removed from the training command's environment; both spellings, since tools differ in which they read.
PROXY_VARIABLES = tuple(
    spelling
    for name in ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy", "no_proxy")
    for spelling in (name, name.upper())
)
# One W&B group for every run of this process when GITHUB_RUN_ID is unset (a local run).
LOCAL_RUN_ID = time.strftime("%y%m%d-%H%M%S", time.gmtime())
_wandb_notice_printed = False


def env_flag(name: str, default: str = "false") -> bool:
    """true/1 -> True, false/0 -> False; anything else is an error naming the variable."""
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false", ""):
        return False
    raise ValueError(f"{name}={value!r}: expected true/false/1/0")


def models_dir() -> Path:
    return Path(os.environ.get("CLAWRL_TEST_MODELS_DIR", "/root/models"))


def datasets_dir() -> Path:
    return Path(os.environ.get("CLAWRL_TEST_DATASETS_DIR", "/root/datasets"))


def hf_download(repo: str, local_dir: Path, *, dataset: bool = False) -> Path:
    """Fetch `repo` into `local_dir` once (the CI cache keeps it); one clear error when that is impossible."""
    if local_dir.is_dir() and any(local_dir.iterdir()):
        return local_dir
    cli = shutil.which("hf") or shutil.which("huggingface-cli")
    if cli is None:
        raise RuntimeError(
            f"{local_dir} is missing and neither `hf` nor `huggingface-cli` is installed to fetch {repo}"
        )
    command = [cli, "download", repo, "--local-dir", str(local_dir)]
    if dataset:
        command[2:2] = ["--repo-type", "dataset"]
    subprocess.run(command, check=True)
    return local_dir


def training_env() -> dict[str, str]:
    """This process's environment without the proxy variables, for the training command."""
    return {name: value for name, value in os.environ.items() if name not in PROXY_VARIABLES}


def wandb_flags(test_file: str) -> list[str]:
    """W&B flags for a test's training run; none (and a notice, once per process) without WANDB_API_KEY.

    Project `clawrl-<test file stem>`, group `<GITHUB_RUN_ID or UTC time>_<GITHUB_COMMIT_NAME>`, so one CI run
    groups its tests. The key itself stays in the environment (clawrl and wandb read WANDB_API_KEY there), not
    on the command line that run_clawrl prints.
    """
    global _wandb_notice_printed
    if not os.environ.get("WANDB_API_KEY"):
        if not _wandb_notice_printed:
            print("W&B skipped: WANDB_API_KEY is not set", flush=True)
            _wandb_notice_printed = True
        return []
    group = os.environ.get("GITHUB_RUN_ID") or LOCAL_RUN_ID
    if os.environ.get("GITHUB_COMMIT_NAME"):
        group += "_" + os.environ["GITHUB_COMMIT_NAME"]
    return ["--use-wandb", "--wandb-project", f"clawrl-{Path(test_file).stem}", "--wandb-group", group]


def run_clawrl(command: str, flags: list[str], output_dir: Path, timeout_s: float = 3 * 3600) -> list[dict]:
    """Run `clawrl <command> <flags>` (fresh output dir, no proxy variables), stream its output, return its
    metrics.jsonl rows."""
    shutil.rmtree(output_dir, ignore_errors=True)
    args = [sys.executable, "-m", "clawrl.cli.main", command, *flags, "--output-dir", str(output_dir)]
    print("EXEC:", " ".join(args), flush=True)
    subprocess.run(args, check=True, cwd=ROOT, timeout=timeout_s, env=training_env())
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def output_dir(test_file: str) -> Path:
    base = Path(os.environ.get("CLAWRL_TEST_OUTPUT_DIR", "/tmp/clawrl-e2e"))
    return base / Path(test_file).stem


def gsm8k_flags(model: Path, data: Path) -> list[str]:
    """The GSM8K GRPO recipe of slime's short test, on our flags."""
    return [
        "--hf-checkpoint", str(model), "--ref-load", str(model),
        "--prompt-data", str(data / "train.parquet"), "--input-key", "messages", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "gsm8k",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "1024",
        "--rollout-temperature", "0.8", "--over-sampling-batch-size", "16",
        "--dynamic-sampling-filter-path", "clawrl.rollout.filters.check_reward_nonzero_std",
        "--global-batch-size", "32", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
        "--use-kl-loss", "--kl-loss-coef", "0.0", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.0",
        "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--ci-test", "--check-weight-update-equal",
    ]  # fmt: skip


# Fault tolerance as in slime's short tests: a health check every 5 s, 10 s to answer, from the rollout's
# start. Together with --ci-test this kills engine 0 once at rollout 2; the run must recover and finish.
FAULT_TOLERANCE_FLAGS = [
    "--use-fault-tolerance", "--rollout-health-check-interval", "5", "--rollout-health-check-timeout", "10",
    "--rollout-health-check-first-wait", "0",
]  # fmt: skip


def engine_restarts(rows: list[dict]) -> int:
    """Engine restarts over the whole run (each metrics row counts those since the previous row)."""
    return round(sum(row.get("rollout/engine_restarts", 0.0) for row in rows))


def eval_flags(data: Path, interval: int) -> list[str]:
    if not env_flag("CLAWRL_TEST_ENABLE_EVAL", "1"):
        return []
    return [
        "--eval-interval", str(interval), "--eval-prompt-data", "gsm8k", str(data / "test.parquet"),
        "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "1024", "--eval-top-k", "1",
    ]  # fmt: skip


def prepare_gsm8k() -> tuple[Path, Path]:
    model = hf_download("Qwen/Qwen2.5-0.5B-Instruct", models_dir() / "Qwen2.5-0.5B-Instruct")
    data = hf_download("zhuzilin/gsm8k", datasets_dir() / "gsm8k", dataset=True)
    return model, data
