"""RolloutManager and EngineRouter against real engine servers: uvicorn on 127.0.0.1 serving a tiny random
model on CPU (two engines for the module; a third, throttled one where a test needs it).

Rewards come from custom reward functions of this module that depend only on sample index / label, so
the numbers (group normalisation, filter drops, eval accuracy) are known by hand whatever the random model
generates. Each engine app counts the requests it receives (an HTTP middleware), which is how the tests see
load spreading, failover and aborts from the engines' side.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import socket
import time

import pytest

from clawrl.config.data import DataConfig
from clawrl.config.eval import EvalConfig
from clawrl.config.job import JobConfig
from clawrl.config.model import ModelConfig
from clawrl.config.rollout import RolloutConfig
from clawrl.config.validate import validate
from clawrl.data.sample import Status
from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.http.app import ServerThread, create_app
from clawrl.engine.http.client import KEEPALIVE_EXPIRY_S, OWN_ENGINE_KEEPALIVE_EXPIRY_S, EngineClient
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from clawrl.rollout.context import rollout_context
from clawrl.rollout.generate import generate, train_sampling_params
from clawrl.rollout.manager import RolloutManager
from clawrl.rollout.router import EngineHealthError, EngineRouter, EngineRouterError

HERE = __name__
GENERATE = ("POST", "/generate")
ABORT = ("POST", "/abort_request")


# ---------------------------------------------------------------------------------------------------------------
# reward functions (deterministic: they ignore the generated text)
# ---------------------------------------------------------------------------------------------------------------
async def rm_index_mod4(args, sample, **kwargs):
    return float(sample.index % 4)


async def rm_const_or_parity(args, sample, **kwargs):
    """Prompts labelled "const" always score 1 (zero-std groups); the others alternate 0, 1."""
    return 1.0 if sample.label == "const" else float(sample.index % 2)


async def rm_label_yes(args, sample, **kwargs):
    return 1.0 if sample.label == "yes" else 0.0


async def generate_one_by_one(args, sample, sampling_params):
    """The default generate function under another name: not batched per group (one request per sample)."""
    from clawrl.rollout.generate import generate

    return await generate(args, sample, sampling_params)


def rollout_through_context(args, rollout_id, data_source, evaluation=False):
    """A synchronous --rollout-function-path that drives the default generate via rollout_context().run."""
    groups = data_source.get_samples(args.rollout_batch_size)
    params = train_sampling_params(args)

    async def generate_all():
        await asyncio.gather(*(generate(args, sample, params) for group in groups for sample in group))

    rollout_context().run(generate_all())
    for group in groups:
        for sample in group:
            sample.reward = float(sample.index % 4)
    return groups


# ---------------------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tiny_tokenizer(2048)
    root = tmp_path_factory.mktemp("rollout-model")
    return str(build_tiny_model(root / "m", vocab_size=2048, tokenizer=tokenizer, tie_word_embeddings=False))


def _start_engine(model_dir: str, max_running_requests: int = 8) -> ServerThread:
    config = EngineConfig(
        model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=256,
        max_running_requests=max_running_requests,
    )  # fmt: skip
    app = create_app(AsyncEngine(Engine(config), step_timeout_s=120))
    app.state.hits = collections.Counter()

    @app.middleware("http")
    async def count_requests(request, call_next):
        app.state.hits[(request.method, request.url.path)] += 1
        return await call_next(request)

    return ServerThread(app).start()


@pytest.fixture(scope="module")
def engines(model_dir):
    servers = [_start_engine(model_dir), _start_engine(model_dir)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def prompt_file(tmp_path):
    def write(name: str, rows: list[dict]) -> str:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    return write


def _prompts(labels: list[str]) -> list[dict]:
    return [
        {"input": f"Question {i}: what is {i} plus {i}?", "label": label} for i, label in enumerate(labels)
    ]


def _job(model_dir, prompt_data, *, eval_data=None, eval_kw=None, algo=None, shuffle=False, **rollout):
    rollout = {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "num_rollout": 4,
               "rollout_max_response_len": 8, **rollout}  # fmt: skip
    job = JobConfig(
        model=ModelConfig(hf_checkpoint=model_dir),
        data=DataConfig(prompt_data=prompt_data, label_key="label", rollout_shuffle=shuffle),
        rollout=RolloutConfig(**rollout),
        eval=EvalConfig(eval_prompt_data=eval_data or {}, **(eval_kw or {})),
    )
    for key, value in (algo or {}).items():
        setattr(job.algo, key, value)
    return validate(job)


def _manager(job, engines, **kw) -> RolloutManager:
    return RolloutManager(job, [e.url for e in engines], rollout_timeout_s=60, abort_timeout_s=20, **kw)


def _generates(server: ServerThread) -> int:
    return server.app.state.hits[GENERATE]


# ---------------------------------------------------------------------------------------------------------------
# RolloutManager
# ---------------------------------------------------------------------------------------------------------------
def test_rollout_batch_rewards_logprobs_weight_versions_and_metrics(model_dir, engines, prompt_file):
    job = _job(model_dir, prompt_file("train", _prompts(["a"] * 8)), custom_rm_path=f"{HERE}.rm_index_mod4")
    before = [_generates(e) for e in engines]
    gc.unfreeze()  # (the module's engines froze this process's heap when they started)
    with _manager(job, engines) as manager:
        # what the manager holds after its set-up (torch, the tokenizer, ...) is frozen: no full pass scans it
        assert gc.get_freeze_count() > 10_000
        batch, metrics = manager.generate(0)
        samples = manager.last_samples
    assert gc.get_freeze_count() == 0  # and thawed when it closes: it may all be garbage now
    # its connections to the run's own engines outlive a train step (the engines' server keeps them 30 s);
    # an external server's idle timeout is not known: the 2 s any server allows
    assert manager.router.keepalive_s == OWN_ENGINE_KEEPALIVE_EXPIRY_S
    assert manager.router.compact_answers  # its own engines answer with packed logprobs
    job.resources.rollout_external_engine_addrs = [e.url for e in engines]
    with _manager(job, engines) as external:
        assert external.router.keepalive_s == KEEPALIVE_EXPIRY_S
        assert not external.router.compact_answers  # SGLang's server has no compact_logprobs field
        assert {c.keepalive_s for c in external.router._clients.values()} == {KEEPALIVE_EXPIRY_S}
    assert 0 <= metrics["perf/rollout_gc_time"] < metrics["perf/rollout_time"]
    assert len(batch) == 2 * 4 and batch.sample_indices == list(range(8))
    assert batch.group_indices == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(0 < r <= 8 for r in batch.response_lengths)
    for log_probs, length in zip(batch.rollout_log_probs, batch.response_lengths, strict=True):
        assert len(log_probs) == length and all(lp <= 0.0 for lp in log_probs)
    version = EngineClient(engines[0].url, timeout=10).get_weight_version()["weight_version"]
    assert [s.weight_versions for s in samples] == [[version]] * 8
    assert [s.status for s in samples] == [
        Status.TRUNCATED if t else Status.COMPLETED for t in batch.truncated
    ]
    # the default generate function sends each prompt group as one batch request; the two groups went one
    # to each engine (least outstanding requests, ties round-robin)
    assert [_generates(e) - b for e, b in zip(engines, before, strict=True)] == [1, 1]

    assert batch.raw_rewards == [0.0, 1.0, 2.0, 3.0] * 2
    # grpo by hand: group {0, 1, 2, 3}: mean 1.5, unbiased std sqrt(5/3) = 1.2909944; (r - 1.5) / (std + 1e-6)
    assert batch.rewards == pytest.approx([-1.1618941, -0.3872980, 0.3872980, 1.1618941] * 2, abs=1e-6)

    lengths = batch.response_lengths
    assert metrics["rollout/raw_reward"] == 1.5
    assert metrics["rollout/response_len/mean"] == pytest.approx(sum(lengths) / 8)
    assert metrics["rollout/response_len/max"] == max(lengths)
    assert metrics["rollout/response_len/min"] == min(lengths)
    assert metrics["rollout/response_len/median"] == pytest.approx(
        sorted(lengths)[3] / 2 + sorted(lengths)[4] / 2
    )
    assert metrics["rollout/truncated_ratio"] == sum(batch.truncated) / 8
    assert metrics["perf/rollout_time"] > 0
    # 2 CPU engines count as 2 rollout devices
    expected_tps = sum(lengths) / metrics["perf/rollout_time"] / 2
    assert metrics["perf/tokens_per_gpu_per_sec"] == pytest.approx(expected_tps)
    assert not any(key.startswith(("rollout/zero_std", "rollout/dynamic_filter")) for key in metrics)
    # the engines' step counters (/get_server_info): each engine ran at least a prefill and 7 decode steps
    # for its group (responses of up to 8 tokens), all inside the rollout
    assert metrics["perf/engine_steps"] >= max(lengths) and 0 < metrics["perf/engine_busy_ratio"] < 1
    assert metrics["perf/engine_busy_time"] == pytest.approx(
        metrics["perf/engine_busy_ratio"] * metrics["perf/rollout_time"], rel=1e-9
    )
    # the engine thread computed on the CPU for part of its steps (CPU engines: the forward itself), never
    # longer than it was inside them; its process (all threads) used at least that much; a CPU engine has
    # no GPU counters to report
    assert 0 < metrics["perf/engine_step_cpu_time"] <= metrics["perf/engine_busy_time"] + 0.01
    assert metrics["perf/engine_process_cpu_time"] >= metrics["perf/engine_step_cpu_time"] - 0.01
    assert "perf/engine_gpu_time" not in metrics and "perf/engine_gpu_wait_time" not in metrics
    # the engine thread's time: inside its steps, idle, applying commands (adding the requests); together
    # not more than the rollout (plus the engine's idle while the counters after it are fetched: < 0.1 s)
    busy, idle, command = (metrics[f"perf/engine_{k}_time"] for k in ("busy", "idle", "command"))
    assert idle >= 0 and command > 0 and busy + idle + command <= metrics["perf/rollout_time"] + 0.1
    # the answer path of the two group calls (engines on this host: the stamps share the client's clock);
    # the call's four parts add up to its round trip, inside the rollout's generation time
    parts = [metrics[f"perf/rollout_request_{k}_time"] for k in ("send", "engine", "answer", "return")]
    assert all(p >= 0 for p in parts) and parts[1] > 0
    assert sum(parts) <= metrics["perf/rollout_generate_time"] + 1e-6
    assert 0 < metrics["perf/rollout_last_answer_time"] <= metrics["perf/rollout_generate_time"]


def test_group_batch_request_gives_each_sample_its_own_request_tokens(model_dir, engines, prompt_file):
    # One batch request per group, one sampling_params entry (seed) per sample: the same tokens, log-probs
    # and statuses as one request per sample, for a quarter of the requests.
    data = prompt_file("train", _prompts(["a"] * 4))
    runs = {}
    for name, generate_path in (("batched", None), ("one_by_one", f"{HERE}.generate_one_by_one")):
        job = _job(model_dir, data, custom_rm_path=f"{HERE}.rm_index_mod4", rollout_max_response_len=12,
                   rollout_temperature=1.0, custom_generate_function_path=generate_path)  # fmt: skip
        before = sum(_generates(e) for e in engines)
        with _manager(job, engines) as manager:
            batch, _ = manager.generate(0)
        runs[name] = (batch, sum(_generates(e) for e in engines) - before)
    (batched, batched_requests), (single, single_requests) = runs["batched"], runs["one_by_one"]
    assert (batched_requests, single_requests) == (2, 8)
    assert batched.tokens == single.tokens
    assert len({tuple(t) for t in batched.tokens}) == 8  # the seeds differ per sample
    assert batched.truncated == single.truncated
    for got, want in zip(batched.rollout_log_probs, single.rollout_log_probs, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    ("algo", "expected"),
    [
        ({"grpo_std_normalization": False}, [-1.5, -0.5, 0.5, 1.5]),  # Dr. GRPO: mean only
        ({"rewards_normalization": False}, [0.0, 1.0, 2.0, 3.0]),
        ({"advantage_estimator": "rloo"}, [-2.0, -2 / 3, 2 / 3, 2.0]),  # r - mean of the other three
    ],
)
def test_reward_post_processing_flags(model_dir, engines, prompt_file, algo, expected):
    job = _job(model_dir, prompt_file("train", _prompts(["a"] * 4)), custom_rm_path=f"{HERE}.rm_index_mod4",
               rollout_batch_size=1, algo=algo)  # fmt: skip
    with _manager(job, engines) as manager:
        batch, _ = manager.generate(0)
    assert batch.raw_rewards == [0.0, 1.0, 2.0, 3.0]
    assert batch.rewards == pytest.approx(expected, abs=1e-6)


def test_zero_std_filter_drops_constant_groups(model_dir, engines, prompt_file):
    labels = ["const", "vary", "const", "vary", "const", "const", "vary", "vary"]
    job = _job(
        model_dir, prompt_file("train", _prompts(labels)), custom_rm_path=f"{HERE}.rm_const_or_parity",
        n_samples_per_prompt=2, over_sampling_batch_size=4,
        dynamic_sampling_filter_path="clawrl.rollout.filters.check_reward_nonzero_std",
    )  # fmt: skip
    with _manager(job, engines) as manager:
        batch, metrics = manager.generate(0)
        samples = manager.last_samples
    assert len(batch) == 4
    assert {s.label for s in samples} == {"vary"}
    assert batch.raw_rewards == [0.0, 1.0, 0.0, 1.0]
    drops = {k: v for k, v in metrics.items() if k.startswith("rollout/dynamic_filter/")}
    # groups 0 and 2 ("const", reward 1) are dropped unless the batch filled before they were judged
    assert set(drops) <= {"rollout/dynamic_filter/drop_zero_std_1.0"}
    assert 0 <= drops.get("rollout/dynamic_filter/drop_zero_std_1.0", 0) <= 2
    assert not any(key.startswith("rollout/zero_std/") for key in metrics)


def test_zero_std_groups_are_counted_when_kept(model_dir, engines, prompt_file):
    job = _job(model_dir, prompt_file("train", _prompts(["const", "vary"])), n_samples_per_prompt=2,
               custom_rm_path=f"{HERE}.rm_const_or_parity")  # fmt: skip
    with _manager(job, engines) as manager:
        batch, metrics = manager.generate(0)
    assert batch.raw_rewards == [1.0, 1.0, 0.0, 1.0]
    assert batch.rewards[:2] == [0.0, 0.0]
    assert metrics["rollout/zero_std/count_1.0"] == 1.0


def test_over_sampling_aborts_leftover_requests(model_dir, prompt_file):
    # One engine that runs 2 requests at a time: 6 groups x 2 samples queue up. Whatever order they finish
    # in, two groups are complete after at most 8 requests, so >= 4 are still queued or running.
    server = _start_engine(model_dir, max_running_requests=2)
    try:
        job = _job(model_dir, prompt_file("train", _prompts(["vary"] * 8)), n_samples_per_prompt=2,
                   over_sampling_batch_size=6, rollout_max_response_len=32,
                   custom_rm_path=f"{HERE}.rm_const_or_parity")  # fmt: skip
        with _manager(job, [server]) as manager:
            batch, metrics = manager.generate(0)
            state = manager.state_dict()
        assert len(batch) == 4
        assert metrics["rollout/aborted_samples"] >= 1
        assert server.app.state.hits[ABORT] >= 1
        assert server.app.state.engine.num_requests == 0
        assert state["data_source"]["source"]["offset"] == 6  # aborted prompts stay consumed, as in slime
    finally:
        server.stop()


def test_eval_metrics_per_dataset(model_dir, engines, prompt_file):
    math_rows = [{"input": "one plus one", "label": "yes"}, {"input": "two plus two", "label": "no"},
                 {"input": "three plus three", "label": "yes"}]  # fmt: skip
    eval_data = {
        "math": prompt_file("math", math_rows),
        "none": prompt_file("none", [{"input": "hello", "label": "no"}]),
    }
    job = _job(model_dir, prompt_file("train", _prompts(["a"] * 4)), custom_rm_path=f"{HERE}.rm_label_yes",
               eval_data=eval_data, eval_kw={"n_samples_per_eval_prompt": 2, "eval_temperature": 0.0,
                                             "eval_max_response_len": 6})  # fmt: skip
    with _manager(job, engines) as manager:
        metrics = manager.eval(0)
        tokenizer = manager.tokenizer
    assert metrics["eval/math"] == pytest.approx(2 / 3)
    assert metrics["eval/none"] == 0.0
    # greedy: both copies of a prompt generate the same; the engine asked directly must agree
    finishes, lengths = [], []
    with EngineClient(engines[0].url, timeout=30) as client:
        for row in math_rows:
            ids = tokenizer(row["input"], add_special_tokens=False)["input_ids"]
            out = client.generate(input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0.0})
            finishes.append(out["meta_info"]["finish_reason"]["type"] == "length")
            lengths.append(out["meta_info"]["completion_tokens"])
    assert metrics["eval/math-truncated_ratio"] == pytest.approx(sum(finishes) / 3)
    assert metrics["eval/math/response_len/mean"] == pytest.approx(sum(lengths) / 3)


def test_state_dict_resume_gives_the_same_next_prompts(model_dir, engines, prompt_file):
    job = _job(model_dir, prompt_file("train", _prompts(["a"] * 3)), custom_rm_path=f"{HERE}.rm_index_mod4",
               shuffle=True)  # fmt: skip
    with _manager(job, engines) as first:
        first.generate(0)
        state = json.loads(json.dumps(first.state_dict()))  # survives a plain-text round trip
        expected, _ = first.generate(1)  # crosses into the second (reshuffled) epoch
    with _manager(job, engines) as resumed:
        resumed.load_state_dict(state)
        again, _ = resumed.generate(1)
    assert again.sample_indices == expected.sample_indices == list(range(8, 16))
    prompts = [t[: len(t) - r] for t, r in zip(expected.tokens, expected.response_lengths, strict=True)]
    prompts_again = [t[: len(t) - r] for t, r in zip(again.tokens, again.response_lengths, strict=True)]
    assert prompts_again == prompts
    # sampling is seeded by --rollout-seed + sample index, so the responses repeat too
    assert again.tokens == expected.tokens


def test_sync_rollout_function_reaches_the_engines_through_the_context(model_dir, engines, prompt_file):
    job = _job(
        model_dir,
        prompt_file("train", _prompts(["a"] * 4)),
        rollout_function_path=f"{HERE}.rollout_through_context",
    )
    with _manager(job, engines) as manager:
        batch, metrics = manager.generate(0)
        samples = manager.last_samples
    assert len(batch) == 8 and batch.raw_rewards == [0.0, 1.0, 2.0, 3.0] * 2
    assert all(
        len(lp) == r > 0 for lp, r in zip(batch.rollout_log_probs, batch.response_lengths, strict=True)
    )
    assert all(len(s.weight_versions) == 1 for s in samples)
    assert metrics["rollout/raw_reward"] == 1.5


# ---------------------------------------------------------------------------------------------------------------
# EngineRouter
# ---------------------------------------------------------------------------------------------------------------
def _payload(max_new_tokens: int = 4) -> dict:
    return {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": max_new_tokens},
        "return_logprob": True,
    }


def test_router_spreads_load_and_keeps_sessions(engines):
    async def main():
        router = EngineRouter([e.url for e in engines], request_timeout_s=30, health_timeout_s=10)
        try:
            before = [_generates(e) for e in engines]
            outputs = await asyncio.gather(*(router.generate(_payload()) for _ in range(8)))
            spread = [_generates(e) - b for e, b in zip(engines, before, strict=True)]
            before = [_generates(e) for e in engines]
            for _ in range(4):
                await router.generate(_payload(), session_id="episode-1")
            session = [_generates(e) - b for e, b in zip(engines, before, strict=True)]
            return outputs, spread, session, router.stats()
        finally:
            await router.aclose()

    outputs, spread, session, stats = asyncio.run(main())
    assert all(len(o["output_ids"]) == 4 for o in outputs)
    assert spread == [4, 4]
    assert sorted(session) == [0, 4]  # one engine serves the whole session
    assert all(s["outstanding"] == 0 for s in stats.values())


def test_router_gives_a_replacement_engine_the_same_connection_expiry():
    router = EngineRouter(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"], keepalive_s=OWN_ENGINE_KEEPALIVE_EXPIRY_S
    )
    router.replace("http://127.0.0.1:2", "http://127.0.0.1:3")
    assert router.urls == ["http://127.0.0.1:1", "http://127.0.0.1:3"]
    assert {c.keepalive_s for c in router._clients.values()} == {OWN_ENGINE_KEEPALIVE_EXPIRY_S}
    assert (
        EngineRouter(["http://127.0.0.1:1"])._clients["http://127.0.0.1:1"].keepalive_s == KEEPALIVE_EXPIRY_S
    )


def test_router_fails_over_when_an_engine_is_stopped(model_dir, engines):
    stopped = _start_engine(model_dir)
    stopped.stop()
    live = engines[0]

    async def main(urls):
        router = EngineRouter(urls, request_timeout_s=30, health_timeout_s=10)
        try:
            return [await router.generate(_payload()) for _ in range(4)]
        finally:
            await router.aclose()

    before = _generates(live)
    outputs = asyncio.run(main([stopped.url, live.url]))
    assert len(outputs) == 4 and _generates(live) - before == 4
    with pytest.raises(EngineRouterError, match=f"failed on 1 engine.*{stopped.url}.*ClientConnectorError"):
        asyncio.run(main([stopped.url]))


def test_check_health_reports_dead_engines_within_the_deadline(model_dir, engines):
    stopped = _start_engine(model_dir)
    stopped.stop()
    hung = socket.socket()  # accepts connections (kernel backlog) but never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    live = engines[1].url

    async def main(urls):
        router = EngineRouter(urls, request_timeout_s=30, health_timeout_s=1.0)
        try:
            return await router.check_health()
        finally:
            await router.aclose()

    try:
        assert asyncio.run(main([live]))[live]["ok"] is True
        started = time.monotonic()
        with pytest.raises(EngineHealthError) as info:
            asyncio.run(main([live, hung_url, stopped.url]))
        elapsed = time.monotonic() - started
    finally:
        hung.close()
    assert elapsed < 3.0
    message = str(info.value)
    assert "2 of 3 engine(s) failed" in message and hung_url in message and stopped.url in message
    assert f"{live}:" not in message
    assert info.value.statuses[live]["ok"] is True
    assert info.value.statuses[hung_url]["ok"] is False
