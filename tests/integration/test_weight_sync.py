"""Weight sync for real: trainer-side model -> engine servers (uvicorn on 127.0.0.1) over shared memory
(colocated, CPU) and over a gloo broadcast group (1 trainer rank + 2 engines), with the version flip.

Model "a" is what the engines start with; model "b" (other seed) is the trainer's, loaded un-fused as the
trainer holds it and exported with the trainer's own iterators (iter_full_tensors / iter_weight_buckets).
"""

import glob
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import pytest
import torch

from clawrl.engine.async_engine import AsyncEngine
from clawrl.engine.config import EngineConfig
from clawrl.engine.core.engine import Engine
from clawrl.engine.core.request import SamplingParams
from clawrl.engine.http.app import ServerThread, create_app
from clawrl.engine.http.client import EngineClient, EngineClientError
from clawrl.models.hf_io import load_model
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from clawrl.trainer.weights import iter_full_tensors, iter_weight_buckets
from clawrl.weight_sync import WeightMismatchError, WeightSyncError, make_sender, verify_engine_weights
from clawrl.weight_sync.checksum import tensor_checksum
from clawrl.weight_sync.cycle import Transport, push_weights
from clawrl.weight_sync.flat import ALIGN_BYTES, plan_flat_groups

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 17, 300, 42], [7, 8, 9], [1000, 3, 64, 64, 2]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-sync")
    tokenizer = build_tiny_tokenizer(2048)
    # Untied: with tied random embeddings greedy decoding just repeats the last token, whatever the seed.
    kwargs = dict(vocab_size=2048, tokenizer=tokenizer, tie_word_embeddings=False)
    return str(build_tiny_model(root / "a", seed=0, **kwargs)), str(
        build_tiny_model(root / "b", seed=1, **kwargs)
    )


@pytest.fixture(scope="module")
def trainer_model(models):
    """The trainer's view of model b: un-fused HF layout, fp32 (as TrainActor builds it on CPU)."""
    return load_model(models[1], fused=False, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def trainer_checksums(trainer_model):
    return {name: tensor_checksum(t) for name, t in iter_full_tensors(trainer_model)}


@pytest.fixture(scope="module")
def reference_outputs(models):
    """Greedy outputs of an engine that loaded model b from disk: what a synced engine must produce."""
    engine = Engine(EngineConfig(model_path=models[1]))
    return [r["output_ids"] for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, **GREEDY))]


@contextmanager
def serve(model_dir, count=1):
    """`count` engine servers on model_dir; yields their URLs."""
    with ExitStack() as stack:
        urls = []
        for _ in range(count):
            engine = AsyncEngine(Engine(EngineConfig(model_path=model_dir)), step_timeout_s=120)
            urls.append(stack.enter_context(ServerThread(create_app(engine))).url)
        yield urls


def greedy(url, prompts=PROMPTS, max_new_tokens=8):
    with EngineClient(url, timeout=60) as client:
        out = client.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new_tokens, **GREEDY})
    return [o["output_ids"] for o in out]


def sync(sender, model, version, bucket_bytes):
    sender.begin(version)
    for bucket in iter_weight_buckets(iter_full_tensors(model), bucket_bytes):
        sender.send(bucket)
    return sender.finish()


def our_segments():
    return glob.glob("/dev/shm/clawrl_w_*")


# ---------------------------------------------------------------------------------------------------
# layout


def test_flat_layout_groups_by_dtype_and_aligns_offsets():
    groups = plan_flat_groups(
        ["a", "b", "c", "d"], ["float32", "bfloat16", "float32", "bfloat16"], [[3], [2, 5], [4, 4], []]
    )
    f32, bf16 = groups
    assert (f32.dtype, f32.names, bf16.dtype, bf16.names) == ("float32", ["a", "c"], "bfloat16", ["b", "d"])
    # float32: a at 0 (3 elements), c at the next 256-byte boundary = element 64; bf16: d at element 128.
    assert (f32.offsets, f32.numel, bf16.offsets, bf16.numel) == (
        [0, ALIGN_BYTES // 4],
        64 + 16,
        [0, 128],
        129,
    )
    with pytest.raises(ValueError, match=r"dtypes\[1\]: unknown dtype 'complex64'"):
        plan_flat_groups(["a", "b"], ["float32", "complex64"], [[1], [1]])
    with pytest.raises(ValueError, match=r"names\[1\] = 'a' appears twice"):
        plan_flat_groups(["a", "a"], ["float32", "float32"], [[1], [1]])


# ---------------------------------------------------------------------------------------------------
# colocated (shared memory)


def test_colocated_sync_changes_outputs_flips_version_and_matches_checksums(
    models, trainer_model, trainer_checksums, reference_outputs
):
    with serve(models[0]) as (url,):
        before = greedy(url)
        assert before != reference_outputs  # the two checkpoints really generate differently
        with pytest.raises(WeightMismatchError):
            verify_engine_weights([url], trainer_checksums)
        with make_sender("colocated", engine_urls=[url]) as sender:
            versions = sync(sender, trainer_model, "7", bucket_bytes=256 * 1024)
            assert len(sender.stats) > 3  # several buckets
        assert versions == {url: "7"}
        assert EngineClient(url).get_weight_version()["weight_version"] == "7"
        assert greedy(url) == reference_outputs
        verify_engine_weights([url], trainer_checksums, expected_version="7")
        assert our_segments() == []  # every segment unlinked after the engine acknowledged it


def test_bucket_smaller_than_one_tensor_sends_one_tensor_per_bucket(models, trainer_model, trainer_checksums):
    num_tensors = len(list(trainer_model.parameters()))
    with serve(models[0]) as (url,), make_sender("colocated", engine_urls=[url], max_inflight=3) as sender:
        sync(sender, trainer_model, "one-by-one", bucket_bytes=1)
        assert len(sender.stats) == num_tensors
        verify_engine_weights([url], trainer_checksums, expected_version="one-by-one")


def test_tied_embeddings_sync_and_checksums(tmp_path):
    # A tied model has no lm_head.weight of its own on either side; the engine's LM head follows the embedding.
    tokenizer = build_tiny_tokenizer(1024)
    kwargs = dict(vocab_size=1024, tokenizer=tokenizer, tie_word_embeddings=True)
    start, target = (
        build_tiny_model(tmp_path / "a", seed=0, **kwargs),
        build_tiny_model(tmp_path / "b", seed=1, **kwargs),
    )
    trainer = load_model(target, fused=False)
    checksums = {name: tensor_checksum(t) for name, t in iter_full_tensors(trainer)}
    assert "lm_head.weight" not in checksums and "model.embed_tokens.weight" in checksums
    with serve(str(start)) as (url,), make_sender("colocated", engine_urls=[url]) as sender:
        sync(sender, trainer, "tied", bucket_bytes=64 * 1024)
        verify_engine_weights([url], checksums, expected_version="tied")
        reference = Engine(EngineConfig(model_path=str(target)))
        expected = reference.generate(PROMPTS, SamplingParams(max_new_tokens=4, **GREEDY))
        assert greedy(url, max_new_tokens=4) == [r["output_ids"] for r in expected]


def test_sync_during_generation_switches_the_requests_later_tokens(models, trainer_model):
    prompt, total = [30, 31, 32], 400
    with serve(models[0]) as (url,):
        chunks, started = [], threading.Event()

        def consume():
            with EngineClient(url, timeout=60) as client:
                params = {"max_new_tokens": total, **GREEDY}
                for chunk in client.generate(input_ids=prompt, sampling_params=params, return_logprob=True,
                                             stream=True):  # fmt: skip
                    chunks.append(chunk)
                    started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(30)
        with make_sender("colocated", engine_urls=[url]) as sender:
            sync(sender, trainer_model, "live", bucket_bytes=1 << 20)
        reader.join(60)
    final = chunks[-1]
    versions = final["meta_info"]["output_token_weight_versions"]
    assert len(final["output_ids"]) == total and final["meta_info"]["finish_reason"]["type"] == "length"
    switch = versions.index("live")  # the request was neither aborted nor restarted
    assert 0 < switch < total and set(versions[:switch]) == {"0"} and set(versions[switch:]) == {"live"}
    # After the switch the request continues exactly as model b continues the same tokens.
    engine_b = Engine(EngineConfig(model_path=models[1]))
    expected = engine_b.generate(
        [prompt + final["output_ids"][:switch]], SamplingParams(max_new_tokens=5, **GREEDY)
    )
    assert final["output_ids"][switch : switch + 5] == expected[0]["output_ids"]


# ---------------------------------------------------------------------------------------------------
# broadcast (gloo group: trainer rank 0 + 2 engines)


def test_broadcast_sync_to_two_engines(models, trainer_model, trainer_checksums, reference_outputs):
    with serve(models[0], count=2) as urls:
        with make_sender("broadcast", engine_urls=urls, backend="gloo", timeout_s=30) as sender:
            assert sync(sender, trainer_model, "b1", bucket_bytes=512 * 1024) == dict.fromkeys(urls, "b1")
            verify_engine_weights(urls, trainer_checksums, expected_version="b1")
            # The group stays for the next sync; a sub-tensor bucket size works here too.
            assert sync(sender, trainer_model, "b2", bucket_bytes=1) == dict.fromkeys(urls, "b2")
        for url in urls:
            assert greedy(url) == reference_outputs
        verify_engine_weights(urls, trainer_checksums, expected_version="b2")


# ---------------------------------------------------------------------------------------------------
# failures: clear errors within deadlines


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens once the socket is closed


def test_engine_down_is_named_within_the_deadline(models):
    down = dead_url()
    with serve(models[0]) as (url,):
        started = time.monotonic()
        with (
            make_sender("colocated", engine_urls=[url, down], timeout_s=5) as sender,
            pytest.raises(WeightSyncError, match=f"engine {down} failed pause_generation") as info,
        ):
            sender.begin("x")
        assert info.value.url == down and time.monotonic() - started < 5
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=f"engine {down} failed init_weights_update_group"):
            make_sender("broadcast", engine_urls=[url, down], backend="gloo", timeout_s=2)
        assert time.monotonic() - started < 5


def test_engine_that_never_answers_times_out_naming_it(models):
    with socket.socket() as silent:  # accepts connections, never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with (
            make_sender("colocated", engine_urls=[url], timeout_s=1) as sender,
            pytest.raises(WeightSyncError, match=f"engine {url} failed pause_generation.*timed out"),
        ):
            sender.begin("x")
        assert time.monotonic() - started < 5


def test_checksum_mismatch_names_the_engine_and_tensors(models, trainer_model, trainer_checksums):
    with serve(models[0]) as (url,):
        with make_sender("colocated", engine_urls=[url]) as sender:
            sync(sender, trainer_model, "3", bucket_bytes=1 << 20)
        wrong = dict(trainer_checksums)
        wrong["model.layers.1.mlp.down_proj.weight"] = "0" * 64
        del wrong["model.norm.weight"]
        with pytest.raises(WeightMismatchError) as info:
            verify_engine_weights([url], wrong, expected_version="4")
    message = str(info.value)
    assert f"engine {url}: weight_version '3', expected '4'" in message
    assert f"engine {url}: 2 of {len(wrong)} tensors differ" in message
    assert "model.layers.1.mlp.down_proj.weight: sha256" in message
    assert "model.norm.weight: on the engine but not in the trainer's weights" in message


def test_malformed_update_is_a_400_naming_the_field(models):
    with serve(models[0]) as (url,), EngineClient(url, timeout=30) as client:
        with pytest.raises(EngineClientError) as info:
            client.update_weights_from_tensor(transport="shared_memory", names=["model.norm.weight"],
                                              dtypes=["float32"], shapes=[[64]], handles=[{"name": "../etc/passwd"}])  # fmt: skip
        assert info.value.status_code == 400 and "handles: a shared_memory handle is" in info.value.message
        with pytest.raises(EngineClientError) as info:
            client.update_weights_from_distributed(names=[], dtypes=[], shapes=[], group_name="nope")
        assert (
            info.value.status_code == 400
            and "group_name 'nope': no such weight-update group" in info.value.message
        )
        assert client.get_weight_version()["weight_version"] == "0"


# ---------------------------------------------------------------------------------------------------
# one sync from start to end (clawrl.weight_sync.cycle.push_weights, what every trainer rank runs)


def test_push_weights_syncs_flips_the_version_and_checks_the_checksums(
    models, trainer_model, trainer_checksums, reference_outputs
):
    fp32_bytes = 4 * sum(p.numel() for p in trainer_model.parameters())
    with serve(models[0]) as (url,):
        transport = Transport(kind="colocated", engine_urls=[url], options={"max_inflight": 3})
        buckets = iter_weight_buckets(iter_full_tensors(trainer_model), 256 * 1024)
        metrics = push_weights(transport, buckets, "p1", checksums=lambda: trainer_checksums)
        assert metrics["perf/update_weights_bytes"] == float(fp32_bytes)
        assert metrics["perf/update_weights_time"] > 0 and metrics["perf/check_weight_update_time"] > 0
        assert greedy(url) == reference_outputs
        wrong = {**trainer_checksums, "model.norm.weight": "0" * 64}
        with pytest.raises(WeightMismatchError, match=rf"engine {url}: 1 of \d+ tensors differ: model\.norm"):
            buckets = iter_weight_buckets(iter_full_tensors(trainer_model), 1 << 20)
            push_weights(transport, buckets, "p2", checksums=lambda: wrong)
        assert EngineClient(url).get_weight_version()["weight_version"] == "p2"  # synced, then checked


def test_push_weights_frees_the_buckets_in_flight_when_a_later_bucket_fails(models, trainer_model):
    good = next(iter_weight_buckets(iter_full_tensors(trainer_model), 1 << 20))
    bad = [("model.extra", torch.zeros(4, dtype=torch.complex64))]  # a dtype weight sync does not carry
    with serve(models[0]) as (url,):
        transport = Transport(kind="colocated", engine_urls=[url], options={"max_inflight": 4})
        with pytest.raises(ValueError, match="cannot send tensors of dtype torch.complex64"):
            push_weights(transport, iter([good, bad]), "broken")
        assert our_segments() == []  # the good bucket's segment was unlinked although it was never retired
        assert EngineClient(url).get_weight_version()["weight_version"] == "0"  # no flip after a failure
