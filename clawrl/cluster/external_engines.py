"""Engines clawrl did not start (`--rollout-external-engine-addrs HOST:PORT ...`): SGLang servers or clawrl engines.

    pool = ExternalEnginePool(["10.0.0.5:30000"], hf_checkpoint="/models/qwen")
    urls = pool.start(timeout_s=60)           # discovery + the same-model check; no process is started
    metrics = sync_from_disk(trainer, urls, "3", disk_dir="/shared/w", export_dtype="bfloat16")

Discovery asks each server `GET /get_server_info` (SGLang v0.5; newer servers: `/server_info`) for its
model path, dtype, context length and version, and compares the served model with --hf-checkpoint's
config.json: `model_type`, `architectures` and `vocab_size`, taken from the server's answer (clawrl engines
report them) or from the config.json at the server's model_path when this machine can read it. A mismatch
is one ExternalEngineError naming the address and the differing values. Generation then goes through
SGLang's `/generate` (the rollout's only engine route), weight updates through SGLang's routes: the
broadcast (clawrl/weight_sync/sglang.py) or `sync_from_disk` below.

An external engine that dies is not ours to restart: with --use-fault-tolerance its failed health check
ends the run with an error naming the address (`restart` below), and the run resumes from its last
checkpoint once the server is back.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawrl.cluster.deadline import ActorInfo

if TYPE_CHECKING:
    from clawrl.cluster.train_group import TrainGroup

logger = logging.getLogger(__name__)

COMPARED_FIELDS = ("model_type", "architectures", "vocab_size")
"""What must agree between an external engine's model and --hf-checkpoint."""


class ExternalEngineError(RuntimeError):
    """An external engine that cannot be used: unreachable, another model, or dead; names its address."""


@dataclass(kw_only=True)
class ExternalEngineInfo:
    """What discovery learned about one external engine."""

    url: str
    """http://HOST:PORT."""
    model_path: str | None = None
    """The model the server loaded (its --model-path)."""
    dtype: str | None = None
    """Its dtype ("bfloat16", "float32", "auto", ...)."""
    context_length: int | None = None
    """Its context length, when the server states it."""
    version: str | None = None
    """The server's software version (SGLang's or clawrl's)."""
    model: dict[str, Any] = field(default_factory=dict)
    """model_type / architectures / vocab_size of the served model, where known."""


def engine_url(addr: str) -> str:
    return addr if addr.startswith(("http://", "https://")) else f"http://{addr}"


def discover(url: str, timeout_s: float = 30.0) -> ExternalEngineInfo:
    """Server info of the engine at `url`; ExternalEngineError naming it when it does not answer."""
    from clawrl.engine.http.client import EngineClient, EngineClientError

    with EngineClient(url, timeout=timeout_s) as client:
        try:
            client.health()
            try:
                info = client.get_server_info()
            except EngineClientError as error:
                if error.status_code != 404:
                    raise
                info = client._call("GET", "/server_info")  # SGLang renamed the route after v0.5
        except EngineClientError as error:
            raise ExternalEngineError(
                f"external engine {url} (--rollout-external-engine-addrs) does not answer: {error}. clawrl "
                "does not start external engines: start the server at that address first"
            ) from None
    context = info.get("context_length") or info.get("max_req_input_len")
    result = ExternalEngineInfo(url=url, model_path=info.get("model_path"), dtype=info.get("dtype"),
                                context_length=int(context) if context else None,
                                version=str(info.get("version")) if info.get("version") else None)  # fmt: skip
    result.model = {key: info[key] for key in COMPARED_FIELDS if info.get(key) is not None}
    if len(result.model) < len(COMPARED_FIELDS) and result.model_path:
        config = _read_config(result.model_path)  # SGLang's answer lacks them: its config.json, if readable
        result.model = {**{k: config[k] for k in COMPARED_FIELDS if k in config}, **result.model}
    return result


def check_same_model(info: ExternalEngineInfo, hf_checkpoint: str | None) -> None:
    """ExternalEngineError when the engine serves a model of another architecture or vocabulary than
    --hf-checkpoint; a warning when neither its answer nor its config.json tells."""
    expected = _read_config(hf_checkpoint) if hf_checkpoint else {}
    compared = [key for key in COMPARED_FIELDS if key in expected and key in info.model]
    if not compared:
        logger.warning("external engine %s: cannot tell whether it serves --hf-checkpoint's model (it reports "
                       "model_path %r, unreadable here); make sure it does", info.url, info.model_path)  # fmt: skip
        return
    differ = [
        f"{key} {info.model[key]!r} != {expected[key]!r}"
        for key in compared
        if info.model[key] != expected[key]
    ]
    if differ:
        raise ExternalEngineError(
            f"external engine {info.url} serves another model than --hf-checkpoint {hf_checkpoint}: "
            f"{'; '.join(differ)} (engine's model_path {info.model_path!r}); start it with the same model"
        )


def _read_config(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


class ExternalEnginePool:
    """The engines of --rollout-external-engine-addrs, in the place of an EnginePool (same attributes the
    run uses); it starts, stops and restarts nothing."""

    weight_transport = "sglang_distributed"
    """The clawrl.weight_sync transport that reaches them (SGLang's broadcast payloads)."""

    def __init__(self, addrs: list[str], *, hf_checkpoint: str | None) -> None:
        self.urls = [engine_url(addr) for addr in addrs]
        self.hf_checkpoint = hf_checkpoint
        self.infos: list[ExternalEngineInfo] = []
        self.num_restarts = 0

    def start(self, timeout_s: float) -> list[str]:
        """Discover every engine and check its model; their URLs."""
        self.infos = [discover(url, min(timeout_s, 60.0)) for url in self.urls]
        for info in self.infos:
            check_same_model(info, self.hf_checkpoint)
            logger.info("external engine %s: model %s, dtype %s, context %s, server version %s", info.url,
                        info.model_path, info.dtype, info.context_length, info.version)  # fmt: skip
        return list(self.urls)

    def actor_infos(self) -> list[ActorInfo]:
        return []  # not Ray actors: no stacks to ask them for

    def restart(self, index: int, timeout_s: float) -> str:
        raise ExternalEngineError(
            f"external engine {self.urls[index]} failed its health check; clawrl did not start it "
            "(--rollout-external-engine-addrs) and cannot restart it: restart the server at that address, "
            "then resume the run from its last checkpoint (--load)"
        )

    def stop(self, timeout_s: float) -> None:
        """Nothing to stop: the servers outlive the run."""


def sync_from_disk(trainer: TrainGroup, urls: list[str], version: str, *, disk_dir: str, keep_files: bool = False,
                   export_dtype: str | None = None, verify: bool = False, timeout_s: float = 600.0) -> dict[str, float]:  # fmt: skip
    """--update-weight-transport disk: the trainer writes its weights as a HF directory
    `disk_dir/weight_v{version:06d}` (in `export_dtype`), then every engine pauses, loads it
    (`POST /update_weights_from_disk {model_path, weight_version}`), flushes its cache and continues.
    With `verify` every engine's checksums must equal the trainer's (clawrl engines: GET /weights_checksum)."""
    from clawrl.weight_sync import verify_engine_weights

    started = time.perf_counter()
    path = Path(disk_dir) / f"weight_v{int(version):06d}"
    trainer.export_hf(str(path), dtype=export_dtype)
    written = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(len(urls), 1)) as pool:
        list(pool.map(lambda url: _load_from_disk(url, str(path), version, timeout_s), urls))
    metrics = {"perf/update_weights_time": time.perf_counter() - started,
               "perf/update_weights_write_time": written - started}  # fmt: skip
    if verify:
        checked = time.perf_counter()
        verify_engine_weights(urls, trainer.checksums(), expected_version=version, timeout_s=timeout_s)
        metrics["perf/check_weight_update_time"] = time.perf_counter() - checked
    if not keep_files:
        shutil.rmtree(path, ignore_errors=True)
    return metrics


def _load_from_disk(url: str, path: str, version: str, timeout_s: float) -> None:
    """One engine: pause -> load `path` as `version` (the load flushes the prefix cache) -> continue; errors
    name the engine."""
    from clawrl.engine.http.client import EngineClient, EngineClientError

    with EngineClient(url, timeout=timeout_s) as client:
        try:
            client.pause_generation(mode="in_place")
            reply = client.update_weights_from_disk(path, weight_version=version)
            if isinstance(reply, dict) and reply.get("success") is False:
                raise EngineClientError(str(reply.get("message")), route="/update_weights_from_disk")
            client.continue_generation()
        except EngineClientError as error:
            raise ExternalEngineError(
                f"weight update from disk: engine {url} failed to load {path}: {error}"
            ) from None
