"""Tensor-parallel engine on CPU: a TP=2 engine (rank 0 here + one worker process, gloo) against TP=1.

    .venv/bin/pytest tests/integration/test_engine_tp.py -x -q -p no:cacheprovider

What "equal to TP=1" means: column-parallel layers (q/k/v, gate/up) compute exactly the full matmul's
columns, but a row-parallel layer (o_proj, down_proj) adds two partial sums, which rounds differently from
one sum over the whole hidden size. So the exact reference is a one-process TP=1 engine whose row-parallel
sums are split the same way (`emulate_split_sums`): tokens and log-probs must be bit-equal to it. Against
the plain TP=1 engine the tokens are equal and the log-probs differ by float rounding only (4.8e-7 measured).
"""

from __future__ import annotations

import pytest
import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.weight_receiver import WeightReceiver
from clawrl.models.loader import iter_safetensors
from clawrl.models.tiny import build_tiny_model
from clawrl.models.tp import emulate_split_sums

PROMPTS = [[1, 5, 9, 200, 7], list(range(10, 40)), [3]]  # the 30-token prompt fills a prefix-cache block
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Both ranks share the machine's cores: with several threads each, OpenMP's spin-waits make every
    # collective wait for a descheduled thread (one step took seconds on a loaded 2-core machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        "base": str(build_tiny_model(root / "base", vocab_size=2048, hidden_size=64, num_layers=2)),
        "update": str(build_tiny_model(root / "update", vocab_size=2048, hidden_size=64, num_layers=2, seed=1)),
        # one KV head: with 2 ranks it is replicated, each rank keeping it for its 2 query heads
        "mqa": str(build_tiny_model(root / "mqa", vocab_size=2048, hidden_size=64, num_layers=2, num_kv_heads=1)),
    }  # fmt: skip


def _engine(path: str, tp_size: int = 1, *, split_sums: int = 1) -> Engine:
    engine = Engine(EngineConfig(model_path=path, tp_size=tp_size, num_kv_blocks=64))
    if split_sums > 1:
        emulate_split_sums(engine.model, split_sums)
    return engine


@pytest.fixture(scope="module")
def tp2(models):
    engine = _engine(models["base"], tp_size=2)
    yield engine
    engine.close()


def _outputs(engine: Engine) -> list[tuple[list[int], list[float]]]:
    results = engine.generate(PROMPTS, GREEDY) + engine.generate(PROMPTS, SAMPLED)
    return [(r["output_ids"], r["logprobs"]) for r in results]


def test_tp2_equals_the_split_sum_tp1_reference_exactly(models, tp2):
    reference = _outputs(_engine(models["base"], split_sums=2))
    got = _outputs(tp2)
    assert got == reference  # bit-equal floats, not approx
    assert all(len(ids) == 12 for ids, _ in got)


def test_tp2_matches_the_plain_tp1_engine_up_to_rounding(models, tp2):
    plain, got = _outputs(_engine(models["base"])), _outputs(tp2)
    assert [ids for ids, _ in got] == [ids for ids, _ in plain]
    diffs = [abs(a - b) for (_, x), (_, y) in zip(got, plain, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(diffs) < 1e-5


def test_a_weight_update_reaches_every_rank(models, tp2):
    reference = _engine(models["base"], split_sums=2)
    before = _outputs(tp2)
    update = list(iter_safetensors(models["update"]))
    for engine in (tp2, reference):  # what WeightReceiver does for one bucket, then the finish message
        engine.load_weight_bucket(update[:5])
        engine.load_weight_bucket(update[5:])
        engine.set_weight_version("7")
    after = _outputs(tp2)
    assert after != before  # the worker's shard changed too: otherwise the sums would mix old and new
    assert after == _outputs(reference)
    # checksums of the gathered full tensors equal those of the one-process engine's
    tp_sums, one_sums = WeightReceiver(tp2).checksums(), WeightReceiver(reference).checksums()
    assert tp_sums == one_sums and tp_sums["weight_version"] == "7"
    # and loading the base weights from disk brings every rank back
    tp2.update_weights_from_disk(models["base"])
    assert _outputs(tp2) == before


def test_replicated_kv_head_with_two_ranks(models):
    engine = _engine(models["mqa"], tp_size=2)
    try:
        assert engine.kv_cache.k[0].shape[2] == 1  # the one KV head, kept by both ranks
        assert _outputs(engine) == _outputs(_engine(models["mqa"], split_sums=2))
    finally:
        engine.close()


def test_workers_stop_with_the_engine(models):
    engine = _engine(models["mqa"], tp_size=2)
    procs = engine.tp.procs
    engine.close()
    assert [p.poll() for p in procs] == [0]
    with pytest.raises(ValueError, match="tp_size must be 1, 2, 4 or 8, got 3"):
        EngineConfig(model_path=models["mqa"], tp_size=3)
