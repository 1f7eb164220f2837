"""The two half-runs and replay, end to end on CPU through the real stack (Ray, engine over HTTP, FSDP2).

1. `--debug-rollout-only --save-debug-rollout-data`: engines and rollouts only; no trainer actor is created;
   every rollout and eval leaves a dump.
2. A normal run with `--dump-details DIR`: rollout dumps, train dumps and the tokenizer under DIR.
3. `--load-debug-rollout-data DIR/rollout_data/{rollout_id}.pt`: no engine actor is created, and the
   replayed run's train/* metrics equal the normal run's exactly (fp32 CPU, same seed).
4. Replaying the rollout-only dumps: rollout 0 was generated from the same weights with the same seeds, so
   its samples and its training step equal the normal run's.

The runs happen in this process (one Ray instance for the module) so the test can list the Ray actors each
run created, dead ones included.
"""

import json
from pathlib import Path

import pytest
import torch
from loop_assets import REWARD, build_loop_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_loop_assets(tmp_path_factory.mktemp("halves"), num_train=32, num_eval=4)


def _flags(assets, out, *extra):
    return [
        "--hf-checkpoint", assets["model"], "--prompt-data", assets["train"], "--input-key", "input",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--rollout-temperature", "0.9", "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-3",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--num-rollout", "2", "--output-dir", str(out), "--run-name", out.name, *extra,
    ]  # fmt: skip


def _train(*args) -> set[str]:
    """Run `clawrl train` in this process; returns the class names of the Ray actors it created."""
    from ray._private import state

    from clawrl.cli.main import main

    before = set(state.actors())
    assert main(["train", *args]) == 0
    return {info["ActorClassName"] for key, info in state.actors().items() if key not in before}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("train/")}


def test_halves_dump_and_replay(assets, ray_session, tmp_path):
    from clawrl.debug.dump import load_rollout_dump, load_train_dump

    # 1. rollout half only, with an eval before and after
    rollout_dir = tmp_path / "rollout_only"
    actors = _train(*_flags(assets, tmp_path / "ro", "--debug-rollout-only",
                            "--save-debug-rollout-data", f"{rollout_dir}/{{rollout_id}}.pt",
                            "--eval-prompt-data", "demo", assets["eval"], "--eval-interval", "1"))  # fmt: skip
    assert "TrainWorker" not in actors and "EngineActor" in actors, actors
    assert sorted(p.name for p in rollout_dir.iterdir()) == [
        "0.pt",
        "1.pt",
        "eval_0.pt",
        "eval_1.pt",
        "eval_2.pt",
    ]
    rows = _rows(tmp_path / "ro")
    assert all(not k.startswith("train/") for r in rows for k in r)
    assert rows[0]["rollout/raw_reward"] > 0 and "eval/demo" in rows[0]
    dump = load_rollout_dump(rollout_dir / "0.pt")
    assert len(dump.samples) == 4 and dump.meta["sampling_params"]["temperature"] == 0.9
    assert all(s.response and s.rollout_log_probs for s in dump.samples)

    # 2. a normal run that dumps everything
    details = tmp_path / "details"
    normal = _rows_of_run(assets, tmp_path / "normal", "--dump-details", str(details))
    assert (details / "tokenizer" / "tokenizer_config.json").exists()
    train_dump = load_train_dump(details / "train_data" / "0.pt")
    assert [s["rollout_position"] for s in train_dump["samples"]] == [0, 1, 2, 3]
    first = train_dump["samples"][0]
    assert first["log_probs"].shape == (first["response_length"],)
    assert torch.equal(first["log_probs"], first["ref_log_probs"])  # step 0: policy == reference
    assert first["kl"].abs().max().item() == 0.0 and first["entropy"].shape == first["log_probs"].shape

    # 3. replay the normal run's rollouts: no engine, identical training
    actors = _train(*_flags(assets, tmp_path / "replay", "--load-debug-rollout-data",
                            f"{details}/rollout_data/{{rollout_id}}.pt"))  # fmt: skip
    assert "EngineActor" not in actors and "TrainWorker" in actors, actors
    replayed = _rows(tmp_path / "replay")
    assert [r["step"] for r in replayed] == [0, 1]
    for a, b in zip(normal, replayed, strict=True):
        assert _train_metrics(a) and _train_metrics(a) == _train_metrics(b)

    # 4. the rollout-only run's rollout 0 is the normal run's rollout 0
    normal_dump = load_rollout_dump(details / "rollout_data" / "0.pt")
    assert [s.tokens for s in dump.samples] == [s.tokens for s in normal_dump.samples]
    _train(
        *_flags(
            assets, tmp_path / "replay_ro", "--load-debug-rollout-data", f"{rollout_dir}/{{rollout_id}}.pt"
        )
    )
    step0 = _rows(tmp_path / "replay_ro")[0]
    for key, value in _train_metrics(normal[0]).items():
        # engine log-probs carry batching-dependent fp32 noise (~1e-7) between runs; all else is exact
        tol = {"abs": 1e-6} if key.startswith("train/train_rollout") else {"rel": 0, "abs": 0}
        assert step0[key] == pytest.approx(value, **tol), key


def _rows_of_run(assets, out: Path, *extra) -> list[dict]:
    actors = _train(*_flags(assets, out, *extra))
    assert {"TrainWorker", "EngineActor"} <= actors
    return _rows(out)


def test_missing_dump_names_the_file(assets, ray_session, tmp_path, capsys):
    from clawrl.cli.main import main

    template = f"{tmp_path}/none/{{rollout_id}}.pt"
    code = main(["train", *_flags(assets, tmp_path / "missing", "--load-debug-rollout-data", template)])
    assert code == 2
    assert f"{tmp_path}/none/0.pt" in capsys.readouterr().err
