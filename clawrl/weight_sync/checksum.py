"""Per-tensor checksums of weights, and `--check-weight-update-equal`: engines must hold the trainer's bits.

    trainer = {name: tensor_checksum(t) for name, t in named_tensors}      # or TrainActor.checksums(dtype)
    verify_engine_weights(engine_urls, trainer, expected_version="3")     # raises WeightMismatchError

Both sides hash HF-named tensors in the dtype the engine runs in: the trainer converts before it sends, so
a correct sync leaves every engine tensor bit-identical to the trainer's converted one. The engine computes
its side on `GET /weights_checksum` (clawrl.engine.weight_receiver).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

SHOWN_DIFFERENCES = 5
"""How many differing tensors per engine the mismatch error lists."""


class WeightMismatchError(RuntimeError):
    """Engine weights differ from the trainer's after a sync; the message lists engines and tensors."""


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes and dtype/shape: equal iff bit-identical."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy())  # hashed in place (buffer protocol)
    return digest.hexdigest()


def checksum_differences(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """One line per tensor that differs, is missing from `actual`, or is extra in it (sorted by name)."""
    lines = []
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            lines.append(f"{name}: missing on the engine")
        elif name not in expected:
            lines.append(f"{name}: on the engine but not in the trainer's weights")
        elif expected[name] != actual[name]:
            lines.append(f"{name}: sha256 {actual[name][:12]}... != trainer's {expected[name][:12]}...")
    return lines


def verify_engine_weights(
    engine_urls: Sequence[str],
    trainer_checksums: Mapping[str, str],
    *,
    expected_version: str | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Compare every engine's `GET /weights_checksum` with the trainer's; one WeightMismatchError naming
    each differing engine, its first differing tensors and (when given) a wrong weight version."""
    from clawrl.engine.http.client import EngineClient

    problems = []
    for url in engine_urls:
        with EngineClient(url, timeout=timeout_s) as client:
            reply = client.weights_checksum()
        version = str(reply.get("weight_version"))
        lines = checksum_differences(trainer_checksums, reply.get("checksums", {}))
        if expected_version is not None and version != str(expected_version):
            problems.append(f"engine {url}: weight_version {version!r}, expected {str(expected_version)!r}")
        if lines:
            shown = "; ".join(lines[:SHOWN_DIFFERENCES])
            more = f" (and {len(lines) - SHOWN_DIFFERENCES} more)" if len(lines) > SHOWN_DIFFERENCES else ""
            problems.append(
                f"engine {url}: {len(lines)} of {len(trainer_checksums)} tensors differ: {shown}{more}"
            )
    if problems:
        raise WeightMismatchError("--check-weight-update-equal failed: " + " | ".join(problems))
