"""`clawrl debug send`: send a prompt file's prompts to any OpenAI-compatible chat endpoint and write the
responses as JSON lines (the first check of a model or a chat template, independent of training).

    clawrl debug send --url http://127.0.0.1:30000 --prompt-data prompts.jsonl --input-key input \\
        --n-samples-per-prompt 2 --rollout-max-response-len 64 --output responses.jsonl

Each row's `--input-key` value is a chat message list, or a string sent as one user message. Every prompt
is sent N times (`--n-samples-per-prompt`) to POST {url}/v1/chat/completions; the model name comes from
GET /v1/models (the first listed), else "default". Output, one line per response in row order:
`{"row_index", "repeat_index", **row, "response"}`. The URL may end in /v1 or not. Every request has a
deadline (`--timeout`); a server that cannot be reached is one error before any prompt is sent.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from clawrl.config.errors import ConfigError
from clawrl.data.dataset import read_rows
from clawrl.engine.http.client import EngineClient, EngineClientError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument(
        "--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000 (or .../v1)"
    )
    parser.add_argument("--prompt-data", required=True, metavar="FILE",
                        help="jsonl or parquet prompt file (file@[a:b] slices rows)")  # fmt: skip
    parser.add_argument("--input-key", default="input", help="row key of the prompt (default: input)")
    parser.add_argument(
        "--n-samples-per-prompt", type=int, default=1, help="responses per prompt (default: 1)"
    )
    parser.add_argument("--rollout-max-response-len", type=int, default=1024,
                        help="max_tokens of each request (default: 1024)")  # fmt: skip
    parser.add_argument("--rollout-temperature", type=float, default=1.0, help="temperature (default: 1.0)")
    parser.add_argument("--rollout-top-p", type=float, default=1.0, help="top_p (default: 1.0)")
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    parser.add_argument(
        "--output", default=None, metavar="FILE", help="write JSON lines here (default: stdout)"
    )


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    rows = read_rows(args.prompt_data)
    messages = [_messages(row, args.input_key, i) for i, row in enumerate(rows)]
    base = _base_url(args.url)
    with EngineClient(base, timeout=args.timeout) as client:
        model = args.model or _model_name(client, base)
        jobs = [(i, k) for i in range(len(rows)) for k in range(args.n_samples_per_prompt)]

        def send(job: tuple[int, int]) -> dict[str, Any]:
            row_index, repeat_index = job
            text = _chat(client, model, messages[row_index], args)
            return {"row_index": row_index, "repeat_index": repeat_index, **rows[row_index], "response": text}

        out: TextIO = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115
        try:
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                for record in pool.map(send, jobs):  # map yields in job order
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
        finally:
            if out is not sys.stdout:
                out.close()
    if args.output:
        print(f"{len(jobs)} responses to {len(rows)} prompts written to {args.output}", file=sys.stderr)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    for flag, value, low in (("--n-samples-per-prompt", args.n_samples_per_prompt, 1),
                             ("--rollout-max-response-len", args.rollout_max_response_len, 1),
                             ("--concurrency", args.concurrency, 1)):  # fmt: skip
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")


def _base_url(url: str) -> str:
    """The server root: clients add /v1/..., and users paste either form."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _messages(row: dict[str, Any], key: str, row_index: int) -> list[dict[str, Any]]:
    if key not in row:
        raise ConfigError(f"--input-key {key!r}: row {row_index} has no such key (it has {sorted(row)})")
    prompt = row[key]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return prompt
    raise ConfigError(
        f"--input-key {key!r}: row {row_index} holds a {type(prompt).__name__}; expected a string or a list "
        "of chat messages with a 'role'"
    )


def _model_name(client: EngineClient, base: str) -> str:
    """The first model the server lists; "default" when it lists none or has no /v1/models route. A server
    that cannot be reached at all fails here, before any prompt is sent."""
    try:
        listed = client.models(timeout=min(client.timeout, 30.0))
    except EngineClientError as err:
        if err.status_code is None:
            raise ConfigError(f"--url {base}: cannot reach the server: {err}") from None
        return "default"
    data = listed.get("data") if isinstance(listed, dict) else None
    if data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return "default"


def _chat(client: EngineClient, model: str, messages: list[dict], args: argparse.Namespace) -> str:
    try:
        out = client.chat_completions(messages, model=model, max_tokens=args.rollout_max_response_len,
                                      temperature=args.rollout_temperature, top_p=args.rollout_top_p)  # fmt: skip
    except EngineClientError as err:
        raise ConfigError(f"--url {client.base_url}: {err}") from None
    try:
        return out["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise ConfigError(
            f"--url {client.base_url}: not an OpenAI chat completion: {json.dumps(out)[:200]}"
        ) from None
