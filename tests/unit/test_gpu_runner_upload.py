"""The GPU runner's batched upload (`_to_device`): every tensor starts 16-byte aligned in the shared buffer.

Triton compiles one variant of a kernel per pattern of 16-byte-aligned pointer arguments. Views at offsets
that followed the batch's lengths made rollouts with new prompt lengths compile new prefill kernels inside
the engine's step (0.1-1.5 s per rollout on an H200, bench/loop_step.py's per-rollout table). The tensors
here are on the CPU; on CUDA the same offsets apply to the device buffer (tests/gpu/test_engine_gpu.py
checks that no kernel is recompiled).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from clawrl.engine.runner.gpu_runner import _to_device


@pytest.mark.parametrize("lengths", [(1, 2, 3), (3, 3, 1, 0, 5), (0, 0, 1), (7,), (2, 4, 6)])
def test_every_part_keeps_its_values_and_starts_16_byte_aligned(lengths):
    values = itertools.count(1)
    parts = [[next(values) for _ in range(n)] for n in lengths]
    parts[0] = np.asarray(parts[0], dtype=np.int32)  # any integer sequence is taken
    tensors = _to_device(parts, torch.device("cpu"))
    assert [t.tolist() for t in tensors] == [list(map(int, p)) for p in parts]
    assert all(t.dtype == torch.int64 for t in tensors)
    base = tensors[0].data_ptr() - tensors[0].storage_offset() * 8
    assert [(t.data_ptr() - base) % 16 for t in tensors] == [0] * len(tensors)


def test_offsets_do_not_depend_on_the_parity_of_the_lengths():
    odd = _to_device([[1], [2, 3, 4], [5]], torch.device("cpu"))
    even = _to_device([[1, 2], [3, 4, 5, 6], [7, 8]], torch.device("cpu"))
    assert [t.storage_offset() for t in odd] == [t.storage_offset() for t in even] == [0, 2, 6]
