"""bench/engine_throughput.py's peer logic: the time-cap plan, the table cells and ratios, the --peers flag,
and a failing peer process reported as a row instead of ending the run.

bench/ is not a package, so the script is loaded from its file. Nothing is timed here.
"""

from __future__ import annotations

import argparse
import math

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def bench():
    yield load_bench("engine_throughput")
    unload_bench("engine_throughput")


def test_plan_keeps_the_work_that_fits_the_cap(bench):
    # 16 tokens in 2 s -> 256 tokens in 32 s <= 60 s
    assert bench.plan_peer_work(256, 256, 16, 2.0, 60.0) == (256, 256)


def test_plan_cuts_new_tokens_first(bench):
    # estimate 16 * 256 / 16 = 256 s; 256 * 60 / 256 = 60 tokens (60 s at 1 s per token)
    assert bench.plan_peer_work(256, 256, 16, 16.0, 60.0) == (256, 60)


def test_plan_cuts_prompts_when_the_probe_alone_is_over_the_cap(bench):
    # 16 tokens already take 120 s: tokens stay at the probe's 16, prompts 256 * 60 / 120 = 128
    assert bench.plan_peer_work(256, 256, 16, 120.0, 60.0) == (128, 16)
    # never below one prompt
    assert bench.plan_peer_work(4, 256, 16, 1e6, 1.0) == (1, 16)


def test_peer_cell_shows_rate_cap_and_failure(bench):
    ran = {"tok_s": 12345.6, "num_prompts": 256, "new_tokens": 256, "capped": False}
    assert bench.peer_cell(ran) == "12,346"
    capped = {"tok_s": 999.4, "num_prompts": 128, "new_tokens": 16, "capped": True}
    assert bench.peer_cell(capped) == "999 (128 x 16 capped)"
    assert bench.peer_cell({"error": "RuntimeError: boom"}) == "n/a (RuntimeError: boom)"
    assert bench.peer_cell(None) == "not run"


def test_best_peer_ignores_failures(bench):
    peers = {
        "generate": {"tok_s": 3000.0},
        "static-compile": {"error": "x"},
        "generate-batch": {"tok_s": 9000.0},
    }
    assert bench.best_peer(peers) == ("generate-batch", 9000.0)
    name, tok_s = bench.best_peer({"generate": {"error": "x"}})
    assert name == "-" and math.isnan(tok_s)


def test_peer_rows_ratio_against_the_engines_best_schedule(bench):
    row = {
        "shape": "0.5b",
        "batch": 256,
        "engine": {"overlap": {"tok_s": 120000.0}, "plain": {"tok_s": 90000.0}, "schedules_agree": {}},
        "peers": {
            "generate": {"tok_s": 4000.0, "num_prompts": 256, "new_tokens": 256, "capped": False},
            "static-compile": {"error": "timed out after 300 s (--peer-timeout)"},
            "generate-batch": {"tok_s": 8000.0, "num_prompts": 256, "new_tokens": 64, "capped": True},
        },
    }
    lines = bench.peer_rows(row)
    assert len(lines) == 3
    assert lines[0].split()[-1] == "30.0x"  # 120000 / 4000
    assert "n/a (timed out after 300 s (--peer-timeout))" in lines[1] and lines[1].split()[-1] == "-"
    assert "generate-batch (best)" in lines[2] and "(256 x 64 capped)" in lines[2]
    assert lines[2].split()[-1] == "15.0x"  # 120000 / 8000


def test_peers_flag(bench):
    assert bench.parse_args([]).peers == list(bench.PEERS)
    assert bench.parse_args(["--peers", "generate-batch,generate"]).peers == ["generate-batch", "generate"]
    assert bench.parse_args(["--peers", "none"]).peers == []
    assert bench.parse_args(["--skip-hf"]).peers == []
    with pytest.raises(argparse.ArgumentTypeError, match="unknown peer.*'vllm'"):
        bench.peer_list("generate,vllm")


def test_a_failing_peer_process_is_a_row_not_a_crash(bench, tmp_path):
    args = bench.parse_args(["--device", "cpu", "--workdir", str(tmp_path), "--peer-timeout", "120"])
    result = bench.run_peer_process("generate", tmp_path / "no-such-model", 2, args)
    assert "error" in result and "tok_s" not in result
    assert "no-such-model" in result["error"]  # the loader's own reason, carried to the table
    assert bench.peer_cell(result).startswith("n/a (")
