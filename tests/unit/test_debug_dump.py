"""Rollout / train dump formats (clawrl/debug/dump.py): round trips, safety against pickle payloads, slime's
layout, per-sample validation, the subsample rule and template checks."""

import logging
import os
import pickle

import pytest
import torch

from clawrl.config.errors import ConfigError
from clawrl.config.templates import check_template
from clawrl.data.sample import Sample, Status
from clawrl.debug.dump import (
    ROLLOUT_FORMAT_VERSION,
    DumpError,
    config_hash,
    dump_path,
    load_rollout_dump,
    load_train_dump,
    save_rollout_dump,
    save_train_dump,
    subsample,
)


def _sample(i: int, **kw) -> Sample:
    fields = dict(
        group_index=i // 2, index=i, rollout_id=0, prompt=[{"role": "user", "content": f"q{i}"}],
        tokens=[5, 6, 7, 8 + i], response=f"r{i}", response_length=2, label="4", reward=float(i % 2),
        loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.25], weight_versions=["0"], status=Status.TRUNCATED,
        metadata={"k": [1, 2]},
    )  # fmt: skip
    fields.update(kw)
    return Sample(**fields)


META = {
    "weight_version": "0", "weight_versions": ["0"], "sampling_params": {"temperature": 0.9, "top_p": 1.0},
    "tokenizer": "/models/tiny", "config_hash": "0123456789abcdef", "kind": "eval",
    "metrics": {"eval/demo": 0.5}, "datasets": {"demo": [0, 1]},
}  # fmt: skip


def test_rollout_dump_round_trip_and_layout(tmp_path):
    samples = [_sample(0), _sample(1)]
    path = save_rollout_dump(
        tmp_path / "a" / "b" / "eval_3.pt", rollout_id="eval_3", samples=samples, meta=META
    )
    assert path == tmp_path / "a" / "b" / "eval_3.pt"
    assert os.listdir(path.parent) == ["eval_3.pt"]  # the temporary file is gone
    raw = torch.load(path, weights_only=True)
    assert raw["format_version"] == ROLLOUT_FORMAT_VERSION == 1
    assert raw["kind"] == "clawrl-rollout-data" and raw["category"] == "eval"
    assert raw["rollout_id"] == "eval_3" and raw["samples"][0]["status"] == "truncated"
    dump = load_rollout_dump(path)
    assert dump.source_format == "clawrl" and dump.rollout_id == "eval_3" and dump.category == "eval"
    assert [s.to_dict() for s in dump.samples] == [s.to_dict() for s in samples]
    assert dump.meta["sampling_params"] == {"temperature": 0.9, "top_p": 1.0}
    assert dump.meta["datasets"] == {"demo": [0, 1]} and dump.meta["metrics"] == {"eval/demo": 0.5}


def test_numpy_values_are_stored_plain_and_objects_refused(tmp_path):
    np = pytest.importorskip("numpy")
    sample = _sample(0, metadata={"score": np.float32(0.5), "arr": np.arange(3)})
    path = save_rollout_dump(tmp_path / "0.pt", rollout_id=0, samples=[sample], meta={})
    meta = load_rollout_dump(path).samples[0].metadata
    assert meta["score"] == 0.5 and type(meta["score"]) is float
    assert torch.equal(meta["arr"], torch.arange(3))
    with pytest.raises(ValueError, match=r"samples'\]\[0\]\['metadata'\]\['obj'\].*object"):
        save_rollout_dump(
            tmp_path / "1.pt", rollout_id=1, samples=[_sample(0, metadata={"obj": object()})], meta={}
        )
    assert not (tmp_path / "1.pt").exists()


class _Hook:
    """Unpickling this would create a marker file: proves whether loading runs code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"rollout_id": 0, "samples": [], "x": _Hook(marker)}, path)
    with pytest.raises(DumpError, match=r"evil\.pt: refused: the file holds pickled Python objects"):
        load_rollout_dump(path)
    with pytest.raises(DumpError, match=r"evil\.pt: refused"):
        load_train_dump(path)
    assert not marker.exists()
    # and the payload really is live: an unsafe load would have created the file
    pickle.loads(pickle.dumps(_Hook(marker))).close()
    assert marker.exists()


def test_missing_and_garbage_files_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.pt: no such dump file"):
        load_rollout_dump(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_text("hello")
    with pytest.raises(DumpError, match=r"junk\.pt: not a readable torch file"):
        load_rollout_dump(tmp_path / "junk.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(DumpError, match=r"list\.pt: not a rollout dump"):
        load_rollout_dump(tmp_path / "list.pt")


def test_newer_format_and_wrong_kind_refused(tmp_path):
    torch.save(
        {"format_version": 2, "kind": "clawrl-rollout-data", "rollout_id": 0, "samples": []}, tmp_path / "a"
    )
    with pytest.raises(DumpError, match="format_version 2 is not one this clawrl reads"):
        load_rollout_dump(tmp_path / "a")
    save_train_dump(tmp_path / "t.pt", {"format_version": 1, "kind": "clawrl-train-data", "samples": []})
    with pytest.raises(DumpError, match="kind is 'clawrl-train-data', expected 'clawrl-rollout-data'"):
        load_rollout_dump(tmp_path / "t.pt")


def _slime_sample(i: int) -> dict:
    """A sample dict with the keys slime's Sample.to_dict writes (some of which clawrl does not declare)."""
    return {
        "group_index": 0, "index": i, "prompt": "What is 2+2?", "tokens": [1, 2, 3, 4, 5],
        "multimodal_inputs": None, "multimodal_train_inputs": None, "response": " 4", "response_length": 2,
        "label": "4", "reward": 1.0, "loss_mask": [1, 1], "weight_versions": ["3"],
        "rollout_log_probs": [-0.1, -0.2], "rollout_routed_experts": None, "remove_sample": False,
        "status": "completed", "metadata": {}, "train_metadata": None, "non_generation_time": 0.0,
        "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                      "completion_token_num": 0},
        "prefix_cache_info": {"cached_tokens": 3, "total_prompt_tokens": 3},
    }  # fmt: skip


def test_slime_dump_is_read(tmp_path):
    torch.save({"rollout_id": 7, "samples": [_slime_sample(0), _slime_sample(1)]}, tmp_path / "7.pt")
    dump = load_rollout_dump(tmp_path / "7.pt")
    assert dump.source_format == "slime" and dump.rollout_id == 7 and dump.category == "train"
    assert dump.meta == {}
    first = dump.samples[0]
    assert first.status is Status.COMPLETED and first.tokens == [1, 2, 3, 4, 5] and first.reward == 1.0
    assert first.extra["prefix_cache_info"] == {"cached_tokens": 3, "total_prompt_tokens": 3}
    assert first.to_dict()["spec_info"]["spec_verify_ct"] == 0  # extras survive a re-dump


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": [1, 1, 1]}, "sample 1 \\(index 1\\): loss_mask has 3 entries, response_length is 2"),
        ({"rollout_log_probs": [-0.1]}, "sample 1 \\(index 1\\): rollout_log_probs has 1 entries"),
        ({"response_length": 9}, "sample 1 \\(index 1\\): response_length 9 is not between 0 and the 5"),
        ({"tokens": "abc"}, "sample 1 \\(index 1\\): tokens must be a list of token ids"),
        ({"status": "exploded"}, "sample 1: 'exploded' is not a valid Status"),
    ],
)
def test_inconsistent_sample_named(tmp_path, change, message):
    bad = {**_slime_sample(1), **change}
    torch.save({"rollout_id": 0, "samples": [_slime_sample(0), bad]}, tmp_path / "0.pt")
    with pytest.raises(DumpError, match=message):
        load_rollout_dump(tmp_path / "0.pt")


def test_train_dump_round_trip(tmp_path):
    payload = {
        "format_version": 1, "kind": "clawrl-train-data", "rollout_id": 2, "world_size": 1,
        "samples": [{"rollout_position": 0, "tokens": torch.tensor([1, 2, 3]), "log_probs": torch.tensor([-0.5]),
                     "returns": None, "reward": 0.25}],
        "metrics": {"train/loss": 0.125},
    }  # fmt: skip
    path = save_train_dump(tmp_path / "x" / "2.pt", payload)
    back = load_train_dump(path)
    assert back["metrics"] == {"train/loss": 0.125} and back["samples"][0]["returns"] is None
    assert torch.equal(back["samples"][0]["tokens"], torch.tensor([1, 2, 3]))


# n = int(len * ratio); first ceil(n/2), last floor(n/2)
@pytest.mark.parametrize(
    ("length", "ratio", "expected"),
    [
        (3, 0.01, []), (3, 0.5, [0]), (3, 1.0, [0, 1, 2]),
        (4, 0.01, []), (4, 0.5, [0, 3]), (4, 1.0, [0, 1, 2, 3]),
        (7, 0.01, []), (7, 0.5, [0, 1, 6]), (7, 1.0, [0, 1, 2, 3, 4, 5, 6]),
        (10, 0.5, [0, 1, 2, 8, 9]), (10, 0.7, [0, 1, 2, 3, 7, 8, 9]),
    ],
)  # fmt: skip
def test_subsample_table(length, ratio, expected):
    assert subsample(list(range(length)), ratio) == expected


def test_subsample_rejects_bad_ratio():
    with pytest.raises(ValueError, match="subsample ratio must be in \\(0, 1\\], got 0"):
        subsample([1, 2], 0)


def test_templates(caplog):
    assert dump_path("d/{rollout_id}.pt", 3).as_posix() == "d/3.pt"
    assert dump_path("d/{rollout_id}.pt", "eval_3").as_posix() == "d/eval_3.pt"
    check_template("d/{rollout_id}/{rollout_id}.pt", "--save-debug-rollout-data")
    check_template("d/{rollout_id:>5}_{{x}}.pt", "--save-debug-rollout-data")
    with pytest.raises(
        ConfigError, match=r"--save-debug-train-data 'd/\{rank\}.pt': only \{rollout_id\}.*\{rank\}"
    ):
        check_template("d/{rank}.pt", "--save-debug-train-data")
    with pytest.raises(
        ConfigError, match=r"--load-debug-rollout-data 'd/\{rollout_id.pt' is not a valid template"
    ):
        check_template("d/{rollout_id.pt", "--load-debug-rollout-data")
    with pytest.raises(ConfigError, match=r"--load-debug-rollout-data 'd/\{\}.pt': only"):
        check_template("d/{}.pt", "--load-debug-rollout-data")
    with pytest.raises(ConfigError, match="is not a valid template"):
        check_template("d/{rollout_id:03d}.pt", "--save-debug-rollout-data")  # eval ids are strings
    with caplog.at_level(logging.WARNING, logger="clawrl.debug.dump"):
        check_template("d/fixed_unique.pt", "--save-debug-rollout-data")
        check_template("d/fixed_unique.pt", "--save-debug-rollout-data")
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["--save-debug-rollout-data 'd/fixed_unique.pt' has no {rollout_id}: every dump overwrites "
                        "d/fixed_unique.pt"]  # fmt: skip


def test_config_hash_is_canonical():
    a = config_hash({"b": 1, "a": {"y": [1, 2], "x": None}})
    assert a == config_hash({"a": {"x": None, "y": [1, 2]}, "b": 1})
    assert len(a) == 16 and int(a, 16) >= 0
    assert a != config_hash({"b": 2, "a": {"y": [1, 2], "x": None}})
