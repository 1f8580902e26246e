"""Block copy (copy-on-write) moves whole blocks of every layer exactly as its reference does,
and refuses moves whose result would depend on their order."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.block_copy import copy_blocks
from pdserve.kernels.reference import copy_blocks_reference
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
    assert torch.equal(buffer[2, 1, 7], buffer[2, 1, 1])  # block 1's last layer, values


def test_a_copy_of_no_blocks_changes_nothing():
    buffer = kv_buffer(16, 64, torch.float32)
    before = buffer.clone()
    copy_blocks(buffer, ids(), ids())
    assert torch.equal(buffer, before)


@pytest.mark.parametrize(
    "src, dst",
    [((1, 2), (3, 3)), ((1, 2), (2, 5)), ((1,), (2, 3))],
    ids=["repeated-destination", "destination-is-a-source", "length-mismatch"],
)
def test_copy_blocks_refuses_order_dependent_or_mismatched_moves(src, dst):
    with pytest.raises(ValueError):
        copy_blocks(kv_buffer(8, 64, torch.float32), ids(*src), ids(*dst))


def test_copy_blocks_rejects_a_buffer_of_the_wrong_layout():
    with pytest.raises(ValueError, match="buffer must be"):
        copy_blocks(torch.zeros(2, 3, 4, 1, 8, 64, device=DEVICE), ids(0), ids(1))
    with pytest.raises(ValueError, match="buffer must be contiguous"):
        copy_blocks(kv_buffer(8, 64, torch.float32).transpose(4, 5), ids(0), ids(1))
