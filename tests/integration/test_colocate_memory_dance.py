"""The colocated engine's memory dance as the loop drives it: release everything, resume weights, sync, resume
the rest, generate. A tag left released makes the engine hold requests forever (found on the H200: a release
of all tags resumed only "weights" and "kv_cache", and rollout 2 hung), so every phase is checked here."""

import threading

import pytest

from clawrl.config.engine import GENERATION_MEMORY_TAGS, MEMORY_TAGS, SYNC_MEMORY_TAGS
from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.http.app import ServerThread, create_app
from clawrl.engine.http.client import EngineClient
from clawrl.loops.run import release_engine_memory, resume_engine_memory


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from clawrl.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("m") / "m", vocab_size=512)
    engine = Engine(EngineConfig(model_path=str(path), num_kv_blocks=64))
    with ServerThread(create_app(AsyncEngine(engine))) as srv:
        yield srv


def _generate(url, out):
    out.append(
        EngineClient(url, timeout=60).generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    )


def test_release_then_two_phase_resume_lets_generation_finish(server):
    urls = [server.url]
    assert sorted(MEMORY_TAGS) == sorted([*SYNC_MEMORY_TAGS, *GENERATION_MEMORY_TAGS])  # each resumed once
    release_engine_memory(urls, MEMORY_TAGS)
    results = []
    request = threading.Thread(target=_generate, args=(server.url, results))
    request.start()
    resume_engine_memory(urls, SYNC_MEMORY_TAGS)
    request.join(1.0)
    assert request.is_alive() and not results  # held: generation memory is still released
    resume_engine_memory(urls, GENERATION_MEMORY_TAGS)
    request.join(30.0)
    assert not request.is_alive()
    assert len(results[0]["output_ids"]) == 4
    assert EngineClient(server.url).get_model_info() is not None
