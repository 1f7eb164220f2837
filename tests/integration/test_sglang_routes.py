"""The engine's SGLang control and weight-update routes, request and response shapes, against a real server
(uvicorn on 127.0.0.1, tiny fp32 model): what an SGLang v0.5 server answers and what slime sends.

Model "a" is what the engine serves; model "b" (other seed) is the new weights. The SGLang broadcast layout
(one broadcast per tensor) is driven by hand from a gloo rank 0 in this process, and by the
`sglang_distributed` sender (clawrl/weight_sync/sglang.py).

    .venv/bin/pytest tests/integration/test_sglang_routes.py -x -q -p no:cacheprovider
"""

from __future__ import annotations

import datetime
import threading

import httpx
import pytest
import torch
import torch.distributed as dist
from cpu_server import cpu_server

from clawrl.models.loader import iter_safetensors
from clawrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from clawrl.weight_sync import make_sender, verify_engine_weights
from clawrl.weight_sync.checksum import tensor_checksum
from clawrl.weight_sync.wire import broadcast_from_rank0, create_group


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-routes")
    kwargs = dict(vocab_size=2048, tokenizer=build_tiny_tokenizer(2048), tie_word_embeddings=False)
    return str(build_tiny_model(root / "a", seed=0, **kwargs)), str(
        build_tiny_model(root / "b", seed=1, **kwargs)
    )


@pytest.fixture(scope="module")
def new_weights(models):
    """Model b's tensors as the engine holds them (fp32, HF names, packed rows split as stored)."""
    return [(name, tensor.to(torch.float32)) for name, tensor in iter_safetensors(models[1])]


@pytest.fixture
def server(models):
    with cpu_server(models[0]) as running:
        yield running.url


def post(url, route, body=None, method="POST"):
    return httpx.request(method, url + route, json=body, timeout=60)


def checksums(url):
    return httpx.get(url + "/weights_checksum", timeout=60).json()


def test_get_server_info_has_sglangs_fields_and_the_model(server):
    for route in ("/get_server_info", "/server_info"):
        info = httpx.get(server + route, timeout=30).json()
        assert info["dtype"] == "float32" and info["tp_size"] == 1 and info["context_length"] == 2048
        assert info["max_req_input_len"] == 2047
        assert info["model_type"] == "qwen2" and info["architectures"] == ["Qwen2ForCausalLM"]
        assert info["vocab_size"] == 2048 and info["weight_version"] == "0"
        assert info["model_path"].endswith("/a") and info["version"]


def test_pause_continue_and_flush_answer_like_sglang(server):
    reply = post(server, "/pause_generation", {})
    assert reply.status_code == 200
    assert reply.json() == {"success": True, "message": "Generation paused successfully.", "mode": "abort",
                            "num_aborted": 0}  # fmt: skip
    bad = post(server, "/pause_generation", {"mode": "later"})
    assert bad.status_code == 400 and "mode" in bad.json()["message"]
    assert post(server, "/continue_generation", {}).json()["message"] == "Generation continued successfully."
    assert post(server, "/flush_cache", method="GET").status_code == 200
    assert post(server, "/flush_cache").status_code == 200


def test_update_weights_from_disk_loads_the_dir_with_the_given_version(server, models, new_weights):
    reply = post(server, "/update_weights_from_disk", {"model_path": models[1], "weight_version": "7"})
    assert reply.status_code == 200
    body = reply.json()
    assert body["success"] is True and body["num_paused_requests"] == 0 and body["weight_version"] == "7"
    state = checksums(server)
    assert state["weight_version"] == "7"
    assert state["checksums"] == {name: tensor_checksum(t) for name, t in new_weights}
    missing = post(server, "/update_weights_from_disk", {"model_path": models[1] + "-missing"})
    assert missing.status_code == 400 and models[1] + "-missing" in missing.json()["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"master_port": 1, "rank_offset": 1, "world_size": 2}, ["master_address", "required"]),
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}, ["rank_offset", "0"]),
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
         ["nccl", "CUDA"]),
    ],
)  # fmt: skip
def test_init_weights_update_group_rejects_bad_bodies_naming_the_field(server, body, words):
    reply = post(server, "/init_weights_update_group", body)
    assert reply.status_code == 400
    assert all(word in reply.json()["message"] for word in words), reply.json()


def test_update_weights_from_distributed_without_a_group_is_a_400(server):
    reply = post(server, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
    assert reply.status_code == 400 and "'weight_update_group'" in reply.json()["message"]


def join_group(url, port, world_size=2, group_name="weight_update_group"):
    """rank 0 here (hosting the store), the engine joins through the route; returns (group, reply)."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)  # fmt: skip
    body = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": world_size,
            "group_name": group_name, "backend": "gloo"}  # fmt: skip
    replies = []
    joining = threading.Thread(target=lambda: replies.append(post(url, "/init_weights_update_group", body)))
    joining.start()
    group = create_group(backend="gloo", rank=0, world_size=world_size, group_name=group_name, timeout_s=30,
                         store=store)  # fmt: skip
    joining.join(60)
    return group, store, replies[0]


def send_per_tensor(url, group, named, body_extra):
    """SGLang's layout: the route with names/dtypes/shapes, then one broadcast per tensor in that order."""
    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], **body_extra}  # fmt: skip
    replies = []
    call = threading.Thread(
        target=lambda: replies.append(post(url, "/update_weights_from_distributed", body))
    )
    call.start()
    for _, tensor in named:
        broadcast_from_rank0(group, tensor.contiguous().clone(), 30)
    call.join(60)
    return replies[0]


def test_sglang_per_tensor_layout_loads_and_takes_the_version(server, new_weights):
    group, _store, joined = join_group(server, 0)
    assert joined.status_code == 200
    assert joined.json()["success"] is True and "message" in joined.json()
    half = len(new_weights) // 2
    first = send_per_tensor(server, group, new_weights[:half], {"flush_cache": False})
    assert first.status_code == 200, first.text
    assert first.json()["success"] is True and first.json()["num_tensors"] == half
    assert first.json()["weight_version"] == "0"  # no version given: it stays
    second = send_per_tensor(server, group, new_weights[half:], {"weight_version": "5"})
    assert second.json()["weight_version"] == "5"
    state = checksums(server)
    assert state["weight_version"] == "5"
    assert state["checksums"] == {name: tensor_checksum(t) for name, t in new_weights}
    destroyed = post(server, "/destroy_weights_update_group", {})  # SGLang's default group name
    assert destroyed.json()["success"] is True and destroyed.json()["destroyed"] is True


def test_malformed_distributed_bodies_are_400s_naming_the_field(server):
    group, _store, joined = join_group(server, 0, group_name="g")
    assert joined.status_code == 200
    uneven = post(server, "/update_weights_from_distributed",
                  {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"})  # fmt: skip
    assert uneven.status_code == 400 and "names, dtypes, shapes" in uneven.json()["message"]
    layout = post(server, "/update_weights_from_distributed",
                  {"names": [], "dtypes": [], "shapes": [], "group_name": "g", "load_format": "zip"})  # fmt: skip
    assert layout.status_code == 400 and "load_format" in layout.json()["message"]
    dtype = post(server, "/update_weights_from_distributed",
                 {"names": ["x"], "dtypes": ["float7"], "shapes": [[1]], "group_name": "g"})  # fmt: skip
    assert dtype.status_code == 400 and "float7" in dtype.json()["message"]
    post(server, "/destroy_weights_update_group", {"group_name": "g"})


def test_sglang_distributed_sender_syncs_and_resumes_generation(server, new_weights):
    trainer = {name: tensor_checksum(t) for name, t in new_weights}
    with make_sender("sglang_distributed", engine_urls=[server], backend="gloo", timeout_s=30) as sender:
        sender.begin("3")
        for start in range(0, len(new_weights), 3):  # buckets of 3 tensors
            sender.send(new_weights[start : start + 3])
        assert sender.finish() == {server: "3"}
    verify_engine_weights([server], trainer, expected_version="3")
    reply = post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200 and reply.json()["meta_info"]["weight_version"] == "3"
