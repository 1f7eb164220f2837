"""The engine's JSON (clawrl/fast_json.py): logprobs round-trip bit for bit, numpy and torch
values encode as their Python values, bad input is a ValueError like json.loads'."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch

from clawrl import fast_json


def test_floats_round_trip_bit_for_bit_and_match_the_standard_library():
    rng = random.Random(0)
    values = [struct.unpack("f", struct.pack("f", -rng.random() * 20))[0] for _ in range(2000)]
    values += [-0.0, 5e-324, -1.7976931348623157e308, -1e-7]
    body = {"output_token_logprobs": [[v, i, None] for i, v in enumerate(values)]}
    decoded = fast_json.loads(fast_json.dumps(body))
    assert [struct.pack("d", e[0]) for e in decoded["output_token_logprobs"]] == [
        struct.pack("d", v) for v in values
    ]
    assert json.loads(fast_json.dumps(body)) == body == fast_json.loads(json.dumps(body))


def test_numpy_and_torch_values_encode_as_python_values():
    body = {
        "a": np.float32(0.5),
        "b": np.arange(3),
        "c": torch.tensor([1, 2]),
        "d": torch.tensor(2.5),
        3: "x",
    }
    assert fast_json.loads(fast_json.dumps(body)) == {
        "a": 0.5,
        "b": [0, 1, 2],
        "c": [1, 2],
        "d": 2.5,
        "3": "x",
    }


def test_an_unencodable_value_names_its_type():
    with pytest.raises(TypeError, match="object"):
        fast_json.dumps({"x": object()})


def test_non_finite_floats_become_null():
    assert fast_json.loads(fast_json.dumps([float("nan"), float("-inf")])) == [None, None]


@pytest.mark.parametrize("bad", [b"", b"{", b"[1,]", "nope"])
def test_bad_json_is_a_value_error(bad):
    with pytest.raises(ValueError):
        fast_json.loads(bad)


def test_packed_floats_keep_every_bit_and_bad_text_names_the_field():
    rng = random.Random(1)
    values = [-rng.random() * 30 for _ in range(500)] + [-0.0, 5e-324, float("-inf"), -1.7976931348623157e308]
    packed = fast_json.pack_floats(values)
    assert [struct.pack("<d", v) for v in fast_json.unpack_floats(packed)] == [
        struct.pack("<d", v) for v in values
    ]
    assert fast_json.pack_floats([-0.25, -1.5]) == "AAAAAAAA0L8AAAAAAAD4vw=="  # little-endian float64 bytes
    nan = fast_json.unpack_floats(fast_json.pack_floats([float("nan")]))
    assert len(nan) == 1 and nan[0] != nan[0]
    assert fast_json.unpack_floats("") == [] and fast_json.pack_floats([]) == ""
    with pytest.raises(ValueError, match=r"meta_info.x is not base64: 'no!'"):
        fast_json.unpack_floats("no!", field="meta_info.x")
    with pytest.raises(ValueError, match=r"meta_info.x holds 3 bytes, not a whole number of float64 values"):
        fast_json.unpack_floats("AAAA", field="meta_info.x")


def test_version_runs_group_consecutive_values():
    assert fast_json.version_runs(["3", "3", "4", "4", "4", "3"]) == [["3", 2], ["4", 3], ["3", 1]]
    assert fast_json.version_runs([]) == []
