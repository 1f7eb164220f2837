"""bench/train_throughput.py: the FLOP count by hand, the padded baseline's batches, and a full CPU run
(--shape tiny) that exercises every phase the H200 run has, ending with no failed phase."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flops_of_the_qwen25_15b_shape(bench):
    shape = bench.SHAPES["1.5b"]
    # Qwen2.5-1.5B: 1.31 B non-embedding weights (28 x 46.79 M) + the 151936 x 1536 tied LM head.
    params = 28 * (2 * 1536 * 1536 + 2 * 256 * 1536 + 3 * 1536 * 8960) + 151936 * 1536
    assert params == 1_543_569_408
    attention = 6 * 28 * 1536 * (2048**2 * 4)
    assert bench.model_flops(shape, [2048] * 4) == 6 * params * 8192 + attention


def test_padded_micro_batches_respect_the_budget(bench):
    tokens = [[5] * n for n in (3, 9, 4, 7, 2)]
    batches = bench.padded_micro_batches(tokens, budget=20, device=torch.device("cpu"))
    assert [ids.shape for ids, _, _ in batches] == [(2, 9), (2, 9), (1, 9)]  # rows = 20 // 9
    ids, mask, labels = batches[0]
    assert mask[0].tolist() == [1] * 3 + [0] * 6 and labels[0, 3:].eq(-100).all()


def test_tiny_cpu_run_completes_every_phase(bench, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only spins on the shared 2-core machine
    try:
        _run_tiny(bench, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _run_tiny(bench, tmp_path):
    out = tmp_path / "train.json"
    code = bench.main(["--device", "cpu", "--shape", "tiny", "--steps", "1", "--warmup", "0",
                       "--json-out", str(out), "--model-dir", str(tmp_path / "model")])  # fmt: skip
    results = json.loads(out.read_text())
    assert code == 0 and "errors" not in results
    for key in ("fast_fixed", "fast_varlen", "fsdp_fixed", "fsdp_varlen", "hf_fixed", "hf_varlen"):
        assert results[key]["tokens_per_s"] > 0 and results[key]["mfu"] > 0, key
    assert results["fast_varlen"]["num_micro_batches"] == 1  # 12 sequences of <= 512 tokens in 8192
    assert results["hf_varlen"]["padded_tokens"] == 12 * max(results["varlen_lengths"])
    for key in ("ratio_fast_fixed", "ratio_fsdp_varlen", "ratio_fast_over_fsdp_fixed"):
        assert results[key] > 0, key
    # both paths train the same model on the same batch: the same loss (fp32 on CPU: bit for bit)
    assert results["fast_fixed"]["loss"] == results["fsdp_fixed"]["loss"]
