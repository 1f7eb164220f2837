"""Tensor-parallel sharding rules (clawrl/models/tp.py) and the placement of tensor-parallel engines.

    .venv/bin/pytest tests/unit/test_models_tp.py -x -q -p no:cacheprovider

The processes themselves (two ranks over gloo) are tested in tests/integration/test_engine_tp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clawrl.cluster.placement import plan_placement
from clawrl.config.resources import ResourcesConfig
from clawrl.models.config import ModelArgs
from clawrl.models.tp import RowParallelLinear, TensorParallel, check_shardable, local_args

QWEN_7B = ModelArgs(arch="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                    num_kv_heads=4, head_dim=128, intermediate_size=18944)  # fmt: skip


def test_shard_shapes_and_slices_of_a_7b_shape():
    shard = local_args(QWEN_7B, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (14, 2, 9472)
    rank1 = TensorParallel(rank=1, size=2)
    # rank 1: query heads 14..27 (rows 1792..3583), KV heads 2..3 (rows 256..511), MLP columns 9472..
    assert rank1.hf_slice("model.layers.3.self_attn.q_proj.weight", QWEN_7B) == (0, 1792, 1792)
    assert rank1.hf_slice("model.layers.3.self_attn.k_proj.bias", QWEN_7B) == (0, 256, 256)
    assert rank1.hf_slice("model.layers.3.self_attn.o_proj.weight", QWEN_7B) == (1, 1792, 1792)
    assert rank1.hf_slice("model.layers.0.mlp.up_proj.weight", QWEN_7B) == (0, 9472, 9472)
    assert rank1.hf_slice("model.layers.0.mlp.down_proj.weight", QWEN_7B) == (1, 9472, 9472)
    # replicated: norms, embedding, LM head, a row-parallel bias
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.o_proj.bias"):  # fmt: skip
        assert rank1.hf_slice(name, QWEN_7B) is None, name


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    args = ModelArgs(arch="qwen2", vocab_size=64, hidden_size=64, num_layers=1, num_heads=8, num_kv_heads=2,
                     head_dim=8, intermediate_size=64)  # fmt: skip
    assert local_args(args, 4).num_kv_heads == 1
    # ranks 0, 1 read KV head 0 (their query heads 0..3), ranks 2, 3 read KV head 1 (query heads 4..7)
    starts = [TensorParallel(rank=r, size=4).slices(args)["kv"] for r in range(4)]
    assert starts == [(0, 8), (0, 8), (8, 8), (8, 8)]


def test_unshardable_models_are_one_error_naming_the_flag_and_counts():
    with pytest.raises(ValueError) as error:
        check_shardable(QWEN_7B, 8)
    assert str(error.value) == (
        "--rollout-num-gpus-per-engine / --tp-size 8: the model cannot be split: "
        "num_attention_heads=28 is not a multiple of 8"
    )
    odd_kv = ModelArgs(arch="qwen2", vocab_size=64, hidden_size=48, num_layers=1, num_heads=12, num_kv_heads=3,
                       head_dim=4, intermediate_size=64)  # fmt: skip
    with pytest.raises(ValueError, match="num_key_value_heads=3 neither divides nor is a multiple of 2"):
        check_shardable(odd_kv, 2)
    with pytest.raises(ValueError, match="supports 1, 2, 4 or 8 ranks"):
        check_shardable(QWEN_7B, 3)


def test_row_parallel_emulation_adds_the_parts_in_rank_order():
    torch.manual_seed(0)
    layer = RowParallelLinear(8, 3, bias=True, tp=None, num_parts=2)
    x = torch.randn(5, 8)
    expected = (
        F.linear(x[:, :4], layer.weight[:, :4]) + F.linear(x[:, 4:], layer.weight[:, 4:])
    ) + layer.bias
    assert torch.equal(layer(x), expected)


def test_placement_gives_each_engine_its_gpus():
    res = ResourcesConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    split = plan_placement(res, cluster_gpus=8)
    assert (split.engine_slots, split.engine_tp_size, split.num_slots, split.num_engines) == ([2, 4], 2, 6, 2)
    res = ResourcesConfig(actor_num_gpus_per_node=4, colocate=True, rollout_num_gpus_per_engine=2)
    colocated = plan_placement(res, cluster_gpus=4)
    assert (colocated.engine_slots, colocated.num_slots) == ([0, 2], 4)
    cpu = plan_placement(ResourcesConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2,
                                         rollout_num_gpus_per_engine=2), cluster_gpus=0)  # fmt: skip
    assert (cpu.mode, cpu.engine_slots, cpu.num_slots) == ("cpu", [1], 3)
