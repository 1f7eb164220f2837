"""`clawrl engine`: serve a HF model directory with the built-in engine over SGLang's and OpenAI's HTTP APIs.

    clawrl engine --model-path /tmp/tiny-qwen2 --port 30000
    curl -s localhost:30000/generate -d '{"text": "hello", "sampling_params": {"max_new_tokens": 8}}'

Flag names follow SGLang's server (`--mem-fraction-static`, `--max-running-requests`, `--disable-cuda-graph`).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "engine",
        help="serve a model with the built-in engine (SGLang /generate + OpenAI API)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--model-path", required=True, help="HF model directory (config.json, safetensors, tokenizer)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available"
    )
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="CUDA: fraction of device memory for weights + KV cache")  # fmt: skip
    p.add_argument("--max-running-requests", type=int, default=256, help="most sequences decoding at once")
    p.add_argument("--context-length", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")  # fmt: skip
    p.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps without CUDA graphs")
    p.add_argument("--true-on-policy-mode", "--true-on-policy", action="store_true",
                   help="batch-invariant kernels: logprobs a trainer in the same mode recomputes bit for bit")  # fmt: skip
    p.add_argument("--reasoning-parser", choices=("qwen3", "deepseek-r1"), default=None,
                   help="chat replies put <think>...</think> in message.reasoning_content (per request: "
                        "separate_reasoning)")  # fmt: skip
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (1, 2, 4, 8): heads and MLP columns sharded over that many processes")  # fmt: skip
    p.add_argument(
        "--served-model-name", default=None, help="model id in the OpenAI API (default: --model-path)"
    )
    p.add_argument("--step-timeout-s", type=float, default=300.0,
                   help="an engine step running longer than this fails all requests, dumping stacks")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    return p


def _error(message: str) -> int:
    print(f"clawrl engine: error: {message}", file=sys.stderr)
    return 2


def _check_model_path(model_path: str) -> str | None:
    path = Path(model_path)
    if not path.exists():
        return f"--model-path {model_path!r} does not exist"
    if not path.is_dir():
        return f"--model-path {model_path!r} is not a directory"
    if not (path / "config.json").is_file():
        return f"--model-path {model_path!r} has no config.json (expected a Hugging Face model directory)"
    return None


def _resolve_device_dtype(device: str, dtype: str) -> tuple[str, str]:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def run(args: argparse.Namespace) -> int:
    problem = _check_model_path(args.model_path)
    if problem:
        return _error(problem)
    if not 0 < args.port < 65536:
        return _error(f"--port must be in 1..65535, got {args.port}")
    if args.step_timeout_s <= 0:
        return _error(f"--step-timeout-s must be > 0, got {args.step_timeout_s}")
    from clawrl.engine.config import EngineConfig
    from clawrl.engine.http.app import serve

    try:
        device, dtype = _resolve_device_dtype(args.device, args.dtype)
        config = EngineConfig(
            model_path=args.model_path, device=device, dtype=dtype, mem_fraction_static=args.mem_fraction_static,
            max_running_requests=args.max_running_requests, context_length=args.context_length,
            enable_cuda_graph=not args.disable_cuda_graph and device == "cuda", tp_size=args.tp_size,
            true_on_policy_mode=args.true_on_policy_mode,
        )  # fmt: skip
        serve(config, host=args.host, port=args.port, step_timeout_s=args.step_timeout_s,
              served_model_name=args.served_model_name, log_level=args.log_level,
              reasoning_parser=args.reasoning_parser)  # fmt: skip
    except ValueError as error:  # bad flags or a model directory the engine cannot load
        # EngineConfig names its fields ("EngineConfig.mem_fraction_static"); show them as this command's flags.
        return _error(re.sub(r"EngineConfig\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(error)))
    return 0
