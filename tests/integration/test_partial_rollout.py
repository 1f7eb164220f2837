"""--partial-rollout through a real RolloutManager and a real engine server (tiny random model, CPU).

One engine that runs one request at a time, --rollout-batch-size 1 with --over-sampling-batch-size 3 and
single-sample groups: rollout 0 keeps the first group to finish and aborts the other two, one of which was
running (its partial response is kept: the filter below holds the manager's event loop after the first
group finishes until the engine has generated a few tokens of the next request, so the abort finds it
mid-way; a fixed sleep was not enough on a loaded 2-core CI machine, where the engine thread at times had
no token yet and rollout 1 then had nothing to resume). The
engine then loads new weights as version "1" (the same file: what changes is the version) and rollout 1
resumes the partial sample. The filter keeps, in rollout 1, only a group with a two-segment sample, so the
batch is the resumed sample whatever order the engine runs its requests in.

    .venv/bin/pytest tests/integration/test_partial_rollout.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import time

import pytest

from clawrl.config.data import DataConfig
from clawrl.config.job import JobConfig
from clawrl.config.model import ModelConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.validate import validate
from clawrl.data.sample import Sample, Status
from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.http.app import ServerThread, create_app
from clawrl.engine.http.client import EngineClient
from clawrl.models.tiny import build_tiny_model
from clawrl.rollout.manager import RolloutManager

HERE = __name__
MAX_RESPONSE = 256  # long enough that the request running at the abort is only part-way through
_ENGINE: list[Engine] = []  # the engine fixture's Engine, read by the filter below


async def rm_zero(args, sample, **kwargs):
    return 0.0


def keep_first_round_or_resumed(args, samples: list[Sample], **kwargs) -> bool:
    """Rollout 0 (fresh groups on version 0): keep, after holding the manager's loop until the engine has
    generated part of the next request. Later: keep only a resumed partial group."""
    fresh = all(s.weight_versions == ["0"] and "start_rollout_id" not in s.metadata for s in samples)
    if fresh:
        # blocks the manager's event loop (not the engine's thread): no abort is sent meanwhile
        _wait_for_a_started_request(min_tokens=4, timeout_s=30.0)
        return True
    return any(len(s.weight_versions) >= 2 for s in samples)


def _wait_for_a_started_request(min_tokens: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = list(_ENGINE[0].scheduler.running)  # a copy: the engine thread changes the list
        if any(len(seq.output_token_ids) >= min_tokens for seq in running):
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine generated fewer than {min_tokens} tokens of a request in {timeout_s} s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("partial") / "m", vocab_size=2048))


@pytest.fixture
def engine(model_dir):
    config = EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=256,
                          max_running_requests=1)  # fmt: skip
    core = Engine(config)
    _ENGINE[:] = [core]
    server = ServerThread(create_app(AsyncEngine(core, step_timeout_s=120))).start()
    yield server
    server.stop()
    _ENGINE.clear()


def _job(model_dir: str, tmp_path, **rollout) -> JobConfig:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(
        "".join(json.dumps({"input": f"Question {i}: add {i} and {i}."}) + "\n" for i in range(40))
    )
    return validate(
        JobConfig(
            model=ModelConfig(hf_checkpoint=model_dir),
            data=DataConfig(prompt_data=str(prompts)),
            rollout=RolloutConfig(
                rollout_batch_size=1,
                n_samples_per_prompt=1,
                over_sampling_batch_size=3,
                num_rollout=2,
                rollout_max_response_len=MAX_RESPONSE,
                custom_rm_path=f"{HERE}.rm_zero",
                dynamic_sampling_filter_path=f"{HERE}.keep_first_round_or_resumed",
                **rollout,
            ),  # fmt: skip
        )
    )


def _buffer(manager: RolloutManager) -> list[Sample]:
    return [Sample.from_dict(d) for group in manager.state_dict()["data_source"]["buffer"] for d in group]


@pytest.mark.parametrize("mask_offpolicy", [False, True])
def test_aborted_sample_is_resumed_with_its_tokens_log_probs_and_versions(
    model_dir, engine, tmp_path, mask_offpolicy
):
    job = _job(model_dir, tmp_path, partial_rollout=True, mask_offpolicy_in_partial_rollout=mask_offpolicy)
    with RolloutManager(job, [engine.url], rollout_timeout_s=60, abort_timeout_s=30) as manager:
        _, first = manager.generate(0)
        leftovers = _buffer(manager)
        EngineClient(engine.url, timeout=60).update_weights_from_disk(model_dir, weight_version="1")
        batch, second = manager.generate(1)
        [resumed] = manager.last_samples

    # rollout 0: one group kept, the two aborted ones requeued (tagged with the rollout that started them)
    assert first["rollout/partial/requeued_groups"] == 2.0 and len(leftovers) == 2
    assert all(s.metadata["start_rollout_id"] == 0 for s in leftovers)
    assert first["rollout/weight_staleness/max"] == 0.0
    partials = [s for s in leftovers if s.status == Status.ABORTED and s.response_length > 0]
    assert len(partials) == 1, [(s.status, s.response_length) for s in leftovers]
    [partial] = partials
    assert 0 < partial.response_length < MAX_RESPONSE and partial.weight_versions == ["0"]
    assert len(partial.rollout_log_probs) == partial.response_length

    # rollout 1: the same sample, continued from prompt + partial response on version 1
    assert resumed.index == partial.index and resumed.metadata["start_rollout_id"] == 0
    assert resumed.weight_versions == ["0", "1"]
    assert resumed.tokens[: len(partial.tokens)] == partial.tokens
    continuation = resumed.tokens[len(partial.tokens) :]
    assert 0 < len(continuation) <= MAX_RESPONSE - partial.response_length  # the budget left
    assert resumed.response_length == partial.response_length + len(continuation)
    assert resumed.status in (Status.COMPLETED, Status.TRUNCATED)
    assert resumed.rollout_log_probs[: partial.response_length] == partial.rollout_log_probs
    old = [0] * partial.response_length if mask_offpolicy else [1] * partial.response_length
    assert resumed.loss_mask == old + [1] * len(continuation)
    assert batch.tokens == [resumed.tokens] and batch.rollout_log_probs == [resumed.rollout_log_probs]
    assert batch.loss_masks == [resumed.loss_mask]
    assert second["rollout/weight_staleness/max"] == second["rollout/weight_staleness/mean"] == 1.0
    assert second["rollout/partial/resumed_samples"] >= 1.0

    # The engine really continued the partial response: the same request (input = prompt + partial, the
    # sample's seed, the remaining budget) reproduces the continuation and its log-probs.
    replay = EngineClient(engine.url, timeout=60).generate(
        input_ids=partial.tokens,
        sampling_params={"temperature": 1.0, "max_new_tokens": len(continuation), "seed": 42 + partial.index},
        return_logprob=True,
    )
    assert replay["output_ids"] == continuation
    logprobs = [pair[0] for pair in replay["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(resumed.rollout_log_probs[partial.response_length :], abs=1e-5)


def test_without_the_flag_aborted_partials_are_dropped(model_dir, engine, tmp_path):
    job = _job(model_dir, tmp_path)
    with RolloutManager(job, [engine.url], rollout_timeout_s=60, abort_timeout_s=30) as manager:
        _, metrics = manager.generate(0)
        assert _buffer(manager) == []
    # one leftover was running, one queued (or it finished during the filter's pause: then only one)
    assert metrics["rollout/aborted_samples"] >= 1.0
    assert not any(key.startswith("rollout/partial/") for key in metrics)
