"""GPU smoke run of the whole loop: `clawrl train --colocate` for 3 rollouts on one GPU, step-time breakdown.

Builds a random-weight Qwen2.5-0.5B-shaped checkpoint locally (bench/engine_throughput.py's builder: real
151936-row vocabulary, an 8192-token local tokenizer), writes the demo's arithmetic prompts, then runs the
real stack: Ray, an engine actor serving HTTP, one FSDP2 trainer actor sharing the GPU (colocated, with
offload), CUDA-IPC weight sync with --check-weight-update-equal. Rewards come from a test reward that varies
between samples (a random model never answers arithmetic), so every step really updates the weights.

    PYTHONPATH=. python bench/gpu_smoke.py --out $OUT/smoke            # H200
    .venv/bin/python bench/gpu_smoke.py --shape tiny --no-colocate --out /tmp/smoke   # CPU check of the script
    PYTHONPATH=. python bench/gpu_smoke.py --out $OUT/ppo -- --advantage-estimator ppo   # any extra train flags
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("rollout", "train", "update_weights", "log_probs", "ref_log_probs", "actor_train")


def _engine_bench():
    spec = importlib.util.spec_from_file_location(
        "engine_throughput", ROOT / "bench" / "engine_throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b", choices=("0.5b", "1.5b", "tiny"))
    p.add_argument("--out", required=True, help="output directory (metrics.jsonl, summary.json)")
    p.add_argument("--workdir", default="/tmp/clawrl-gpu-smoke")
    p.add_argument("--num-rollout", type=int, default=3)
    p.add_argument("--no-colocate", action="store_true")
    p.add_argument("--fault-tolerance", action="store_true",
                   help="--use-fault-tolerance: --ci-test then kills engine 0 at rollout 2; the run must replace "
                   "it, resync and finish (needs --num-rollout >= 3)")  # fmt: skip
    p.add_argument(
        "extra", nargs="*", help="more `clawrl train` flags, after `--` (e.g. -- --advantage-estimator ppo)"
    )
    a = p.parse_args()
    import torch

    from clawrl.demo.task import TaskSpec, write_task_files

    work = Path(a.workdir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    ckpt = _engine_bench().build_checkpoint(work / f"ckpt-{a.shape}", a.shape, init_std=0.02, device=device)
    data = write_task_files(work / "data", TaskSpec(), seed=0, num_train=512, num_eval=32)
    print(f"checkpoint + data in {time.perf_counter() - started:.1f} s", flush=True)
    out = Path(a.out)
    flags = [
        "--hf-checkpoint", str(ckpt), "--prompt-data", str(data["train"]), "--input-key", "input",
        "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", str(ROOT / "tests" / "integration" / "loop_reward.py") + ":reward",
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "256",
        "--rollout-temperature", "1.0", "--global-batch-size", "256", "--use-kl-loss", "--kl-loss-coef", "0.0",
        "--lr", "1e-6", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384", "--check-weight-update-equal", "--ci-test",
        # random weights: log-probs near -log(vocab) and no language, so those two --ci-test bounds are opened
        "--ci-log-probs-margin", "20", "--ci-text-max-bad-char-ratio", "1", "--ci-text-max-repetition", "1",
        "--ci-text-max-empty-ratio", "1",
        "--num-rollout", str(a.num_rollout), "--output-dir", str(out), "--run-name", "gpu-smoke",
    ]  # fmt: skip
    if not a.no_colocate:
        flags.append("--colocate")
    flags += a.extra
    if a.fault_tolerance:
        flags += ["--use-fault-tolerance", "--rollout-health-check-interval", "5",
                  "--rollout-health-check-timeout", "10"]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "train", *flags], cwd=ROOT)
    wall = time.perf_counter() - started
    print(f"clawrl train exited {result.returncode} after {wall:.1f} s", flush=True)
    if result.returncode != 0:
        return result.returncode
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print_breakdown(rows)
    if a.fault_tolerance:
        restarts = sum(row.get("rollout/engine_restarts", 0.0) for row in rows)
        print(f"engine restarts: {restarts:g} (expected 1)", flush=True)
        if restarts != 1:
            return 1
    (out / "summary.json").write_text(json.dumps({"wall_s": wall, "steps": rows}, indent=1))
    return 0


def print_breakdown(rows: list[dict]) -> None:
    print("\nstep-time breakdown (seconds)")
    print(
        f"{'rollout':>8}" + "".join(f"{name:>16}" for name in PHASES) + f"{'tok/s/gpu':>12}{'grad_norm':>11}"
    )
    for row in rows:
        cells = "".join(f"{row.get(f'perf/{name}_time', float('nan')):>16.3f}" for name in PHASES)
        print(f"{row['step']:>8}{cells}{row.get('perf/tokens_per_gpu_per_sec', 0):>12.0f}"
              f"{row.get('train/grad_norm', 0):>11.3g}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
