"""Fault tolerance end to end on CPU: an engine killed (or hung) in the middle of rollout 2 is detected by
the health monitor, replaced, loaded with the current weights (checksums compared with the trainer's), and
the requests it was serving are re-sent, so every rollout still has all its samples.

Runs happen in this process (one Ray instance for the module), 2 engines (1 in the train-async test), 1
trainer rank, tiny model.
"""

import json
from pathlib import Path

import pytest
from loop_assets import REWARD, build_loop_assets

pytestmark = pytest.mark.slow
SAMPLES_PER_ROLLOUT = 3 * 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("fault"), num_train=32, num_eval=4)


def _flags(assets, out: Path, num_rollout: int, *extra):
    return [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "48",
        "--rollout-temperature", "0.9", "--use-kl-loss", "--kl-loss-coef", "0.0", "--lr", "1e-3",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
        "--num-rollout", str(num_rollout), "--ci-test", "--ci-log-probs-margin", "100",
        "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "4",
        "--save-debug-rollout-data", f"{out}/dumps/{{rollout_id}}.pt",
        "--output-dir", str(out), "--run-name", out.name, *extra,
    ]  # fmt: skip


def _run(command: str, *args) -> list[dict]:
    from clawrl.cli.main import main

    assert main([command, *args]) == 0
    out = Path(args[args.index("--output-dir") + 1])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _samples_per_rollout(out: Path, num_rollout: int) -> list[int]:
    from clawrl.debug.dump import load_rollout_dump

    return [len(load_rollout_dump(out / "dumps" / f"{k}.pt").samples) for k in range(num_rollout)]


def _same_rollouts(a: dict, b: dict) -> None:
    for key, value in a.items():
        if key.startswith(("perf/", "time", "rollout/engine_restarts", "rollout/requests_retried")):
            continue
        # engine log-probs carry batching-dependent fp32 noise (~1e-7) between runs
        tol = (
            {"abs": 1e-6} if key.startswith(("train/train_rollout", "rollout/rollout_log")) else {"rel": 1e-6}
        )
        assert b[key] == pytest.approx(value, **tol), key


@pytest.fixture(scope="module")
def undisturbed(assets, ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("undisturbed")
    return _run("train", *_flags(assets, out, 2))


def test_engine_killed_at_rollout_2_is_replaced_with_nothing_lost(assets, ray_session, undisturbed, tmp_path):
    out = tmp_path / "killed"
    rows = _run("train", *_flags(assets, out, 4, "--use-fault-tolerance"))  # --ci-test: kill engine 0 at 2
    assert _samples_per_rollout(out, 4) == [SAMPLES_PER_ROLLOUT] * 4
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert rows[2]["rollout/requests_retried"] >= 1  # requests in flight on engine 0 were re-sent
    # --ci-test implies --check-weight-update-equal: the replacement's weights were compared with the
    # trainer's when it joined and after every later sync (a mismatch raises); the versions followed
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    for a, b in zip(undisturbed, rows[:2], strict=True):
        _same_rollouts(a, b)


def test_hung_engine_is_detected_by_the_deadline_and_replaced(assets, ray_session, undisturbed, tmp_path):
    out = tmp_path / "hung"
    rows = _run("train", *_flags(assets, out, 3, "--use-fault-tolerance", "--fault-injection",
                                 "engine=1,rollout=2,mode=hang"))  # fmt: skip
    assert _samples_per_rollout(out, 3) == [SAMPLES_PER_ROLLOUT] * 3
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 0.0, 1.0]
    assert rows[2]["rollout/requests_retried"] >= 1  # the frozen engine's requests finished elsewhere
    for a, b in zip(undisturbed, rows[:2], strict=True):
        _same_rollouts(a, b)


def test_train_async_with_its_only_engine_killed_waits_for_the_replacement(assets, ray_session, tmp_path):
    # One engine, as on a one-GPU colocated run: when it dies no engine is left, so every request in flight
    # waits for the replacement. The rollout manager must still take the routing change while its rollout is
    # blocked (it once could not: a rollout in flight held its only thread until the deadline).
    out = tmp_path / "async"
    rows = _run("train-async", *_flags(assets, out, 3, "--ci-fault-tolerance", "--rollout-num-gpus", "1"))
    assert _samples_per_rollout(out, 3) == [SAMPLES_PER_ROLLOUT] * 3
    assert sum(r["rollout/engine_restarts"] for r in rows) == 1.0
    assert sum(r["rollout/requests_retried"] for r in rows) >= 1
