"""Block copy (copy-on-write), gather (pack for transfer) and scatter (unpack) move whole blocks
of every layer exactly as their references do, and refuse moves whose result would depend on
their order."""

from __future__ import annotations

import pytest
import torch

from kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from kernels.reference import (
    copy_blocks_reference,
    gather_blocks_reference,
    scatter_blocks_reference,
)
from tests.kernels.kernel_cases import BLOCK_SIZES, DEVICE, DTYPES, HEAD_DIMS

SHAPES = [
    pytest.param(block_size, head_dim, dtype, id=f"bs{block_size}-d{head_dim}-{dtype}")
    for block_size, head_dim, dtype in zip(BLOCK_SIZES, HEAD_DIMS, DTYPES)
]


def kv_buffer(block_size: int, head_dim: int, dtype: torch.dtype, num_blocks: int = 9):
    generator = torch.Generator().manual_seed(block_size)
    shape = (3, 2, num_blocks, 2, block_size, head_dim)
    return torch.randn(shape, generator=generator).to(dtype).to(DEVICE)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("block_size, head_dim, dtype", SHAPES)
def test_copy_blocks_copies_every_layer_of_each_pair(block_size, head_dim, dtype):
    buffer = kv_buffer(block_size, head_dim, dtype)
    expected = buffer.clone()
    copy_blocks_reference(expected, ids(1, 4), ids(7, 0))

    copy_blocks(buffer, ids(1, 4), ids(7, 0))

    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("block_size, head_dim, dtype", SHAPES)
def test_gather_then_scatter_moves_whole_blocks(block_size, head_dim, dtype):
    buffer = kv_buffer(block_size, head_dim, dtype)
    packed = gather_blocks(buffer, ids(5, 2, 8))
    assert torch.equal(packed, gather_blocks_reference(buffer, ids(5, 2, 8)))
    assert torch.equal(packed[1, 2, 1], buffer[2, 1, 2])  # block 2, layer 2, values

    target = kv_buffer(block_size, head_dim, dtype)
    expected = target.clone()
    scatter_blocks_reference(expected, ids(0, 6, 3), packed)
    scatter_blocks(target, ids(0, 6, 3), packed)
    assert torch.equal(target, expected)


def test_moves_of_no_blocks_change_nothing():
    buffer = kv_buffer(16, 64, torch.float32)
    before = buffer.clone()
    copy_blocks(buffer, ids(), ids())
    scatter_blocks(buffer, ids(), gather_blocks(buffer, ids()))
    assert torch.equal(buffer, before)


@pytest.mark.parametrize(
    "src, dst",
    [((1, 2), (3, 3)), ((1, 2), (2, 5)), ((1,), (2, 3))],
    ids=["repeated-destination", "destination-is-a-source", "length-mismatch"],
)
def test_copy_blocks_refuses_order_dependent_or_mismatched_moves(src, dst):
    with pytest.raises(ValueError):
        copy_blocks(kv_buffer(8, 64, torch.float32), ids(*src), ids(*dst))


def test_block_moves_reject_a_buffer_of_the_wrong_layout():
    with pytest.raises(ValueError, match="buffer must be"):
        gather_blocks(torch.zeros(2, 3, 4, 1, 8, 64, device=DEVICE), ids(0))
    with pytest.raises(ValueError, match="packed blocks must be"):
        scatter_blocks(kv_buffer(8, 64, torch.float32), ids(0), torch.zeros(2, 3, 2, 2, 8, 64))
