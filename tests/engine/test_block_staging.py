"""Block moves (engine.kv.block_moves: copy_blocks, gather_blocks, scatter_blocks, BlockStaging)
move exactly the bytes a copy per block moves, in any order of ids, in batches of any size, for
every cache dtype; on CUDA also between the GPU and pinned host memory and within the GPU."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv.block_moves import BlockStaging, copy_blocks, gather_blocks, scatter_blocks
from pdserve.engine.kv.kv_cache import KVCacheSpec

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_buffer(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.buffer_shape(num_blocks), generator=generator).to(dtype)


def copied_block_by_block(dst, dst_ids, src, src_ids) -> torch.Tensor:
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids):
        expected[:, :, d] = src[:, :, s]
    return expected


def shuffled_pairs(num_src: int, num_dst: int, count: int, seed: int):
    rng = random.Random(seed)
    return rng.sample(range(num_src), count), rng.sample(range(num_dst), count)


def test_gather_then_scatter_round_trips_blocks_in_the_buffer_layout():
    buffer = random_buffer(10, torch.float32, seed=1)
    ids = torch.tensor([7, 2, 9, 0])
    packed = gather_blocks(buffer, ids)
    assert packed.shape == SPEC.buffer_shape(4) and packed.is_contiguous()
    for position, block in enumerate(ids.tolist()):
        assert torch.equal(packed[:, :, position], buffer[:, :, block])
    target = torch.zeros_like(buffer)
    scatter_blocks(target, ids, packed)
    assert torch.equal(target[:, :, ids], buffer[:, :, ids])
    untouched = [b for b in range(10) if b not in ids.tolist()]
    assert not target[:, :, untouched].any()


def test_gather_writes_into_a_given_contiguous_out():
    buffer = random_buffer(6, torch.float16, seed=2)
    out = torch.empty(SPEC.buffer_shape(2), dtype=torch.float16)
    assert gather_blocks(buffer, torch.tensor([5, 1]), out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out[:, :, 0], buffer[:, :, 5]) and torch.equal(out[:, :, 1], buffer[:, :, 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch_blocks", [1, 3, 64])
def test_batched_copy_equals_a_copy_per_block(dtype, batch_blocks):
    src, dst = random_buffer(20, dtype, seed=3), random_buffer(12, dtype, seed=4)
    src_ids, dst_ids = shuffled_pairs(20, 12, 9, seed=5)
    expected = copied_block_by_block(dst, dst_ids, src, src_ids)
    block_bytes = SPEC.bytes_per_block * src.element_size() // 4
    BlockStaging(max_batch_bytes=batch_blocks * block_bytes).copy(dst, dst_ids, src, src_ids)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_copy_within_one_buffer_with_disjoint_sources_and_destinations():
    buffer = random_buffer(8, torch.float32, seed=6)
    expected = copied_block_by_block(buffer, [6, 7, 0], buffer.clone(), [1, 2, 3])
    BlockStaging().copy(buffer, [6, 7, 0], buffer, [1, 2, 3])
    assert torch.equal(buffer, expected)


def test_mismatched_requests_are_refused_before_anything_moves():
    src, dst = random_buffer(4, torch.float32, seed=7), random_buffer(4, torch.float32, seed=8)
    before = dst.clone()
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        BlockStaging().copy(dst, [0], src, [0, 1])
    with pytest.raises(ValueError, match="buffers differ"):
        BlockStaging().copy(dst.to(torch.float16), [0], src, [0])
    with pytest.raises(ValueError, match="positive"):
        BlockStaging(max_batch_bytes=0)
    assert torch.equal(dst, before)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_to_pinned_host_and_back_is_bit_exact_in_batches(dtype):
    device_buffer = random_buffer(40, dtype, seed=9).cuda()
    host = torch.zeros(SPEC.buffer_shape(30), dtype=dtype).pin_memory()
    src_ids, dst_ids = shuffled_pairs(40, 30, 25, seed=10)
    staging = BlockStaging(max_batch_bytes=7 * SPEC.bytes_per_block)
    staging.copy(host, dst_ids, device_buffer, src_ids)
    expected = copied_block_by_block(torch.zeros_like(host), dst_ids, device_buffer.cpu(), src_ids)
    assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))

    returned = torch.zeros_like(device_buffer)
    staging.copy(returned, src_ids, host, dst_ids)
    torch.cuda.synchronize()
    assert torch.equal(returned[:, :, src_ids].cpu(), device_buffer[:, :, src_ids].cpu())


@needs_cuda
def test_copy_within_one_gpu_is_one_gather_and_one_scatter():
    src = random_buffer(16, torch.bfloat16, seed=11).cuda()
    dst = torch.zeros_like(src)
    src_ids, dst_ids = shuffled_pairs(16, 16, 10, seed=12)
    BlockStaging().copy(dst, dst_ids, src, src_ids)
    torch.cuda.synchronize()
    expected = copied_block_by_block(torch.zeros_like(src).cpu(), dst_ids, src.cpu(), src_ids)
    assert torch.equal(dst.cpu(), expected)


def test_copy_on_write_copies_every_layer_of_each_pair_within_the_buffer():
    buffer = random_buffer(8, torch.float32, seed=13)
    expected = copied_block_by_block(buffer, [5, 0], buffer.clone(), [2, 7])
    copy_blocks(buffer, [(2, 5), (7, 0)])
    copy_blocks(buffer, [])
    assert torch.equal(buffer, expected)
