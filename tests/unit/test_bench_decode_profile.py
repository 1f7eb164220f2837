"""bench/engine_decode_profile.py's pure parts: the GPU's busy time as a union of kernel intervals, and the
kernel families the table groups by. Nothing is timed here."""

import pytest
from bench_scripts import load_bench, unload_bench


@pytest.fixture(scope="module")
def profile_bench():
    yield load_bench("engine_decode_profile")
    unload_bench("engine_decode_profile")


def test_busy_time_counts_overlapping_kernels_once(profile_bench):
    # [0, 4) and [2, 5) overlap -> 5; [7, 8) -> 1; [8, 10) touches it -> 2 more: 8 in all
    assert profile_bench.busy_union([(7, 8), (0, 4), (2, 5), (8, 10)]) == 8
    assert profile_bench.busy_union([]) == 0


def test_kernel_families(profile_bench):
    family = profile_bench.family
    assert family("_decode_kernel") == "attention"
    assert family("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert family("_fused_rms_norm_kernel") == "norm/rope/act"
    assert family("_sample_kernel") == "sampling"
    assert (
        family("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>")
        == "copy/fill"
    )
    assert family("something_else") == "other"


def test_the_true_on_policy_kernels_have_their_families(profile_bench):
    family = profile_bench.family
    assert family("_linear_kernel") == "matmul"
    assert family("_log_probs_kernel") == "sampling"
    assert family("_attention_kernel") == "attention"
    assert family("_rms_norm_kernel") == "norm/rope/act"
