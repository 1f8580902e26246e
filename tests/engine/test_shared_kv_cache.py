"""The node cache of a tensor-parallel engine on the CPU (engine/kv/shared_kv_cache.py): every
rank's shard in one shared segment, rank-major in the layer dimension; another process's view
(a worker rank's) is the same bytes; the creator unlinks it on close, and a creator killed
outright leaves one that the next creator removes. The descriptor carries the rank count, and
a pair of different sizes is refused naming only that."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv.kv_cache import KVCacheSpec
from pdserve.engine.kv.shared_kv_cache import RANKS_ID_PREFIX, SharedKVCache
from pdserve.engine.kv.shared_segment import HEADER_FORMAT, MAGIC, SHM_DIR, SharedSegment
from pdserve.kvtransfer.descriptor import DescriptorMismatch, KVDescriptor, check_compatible

RANK_SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def test_each_rank_runs_on_its_own_slice_of_one_buffer():
    cache = SharedKVCache.for_ranks(RANK_SPEC, num_blocks=5, num_ranks=2)
    try:
        assert cache.name.startswith(f"pdserve-kv-{RANKS_ID_PREFIX}{os.getpid()}-")
        assert cache.spec.num_layers == 6 and cache.num_ranks == 2
        worker_view = SharedKVCache.attach(cache.name, RANK_SPEC, 5, 2)
        shard = worker_view.rank_shard(1)
        assert shard.spec == RANK_SPEC and shard.num_blocks == 5
        shard.key_cache(0)[4, 1, 2] = 7.0  # rank 1's layer 0 is the node's layer 3
        assert cache.buffer[3, 0, 4, 1, 2].eq(7.0).all()
        assert cache.rank_shard(0).buffer.eq(0).all()
        worker_view.close()
        assert (SHM_DIR / cache.name).exists(), "a view does not unlink the creator's segment"
    finally:
        cache.close()
    assert not (SHM_DIR / cache.name).exists()


def test_a_segment_left_by_a_killed_creator_is_removed_by_the_next():
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    left = SharedSegment.create(f"{RANKS_ID_PREFIX}{dead_pid}-abandoned", 4096)
    live = SharedSegment.create(f"{RANKS_ID_PREFIX}{os.getpid()}-live", 4096)
    try:
        with open(left.path, "r+b") as segment:  # as if the dead process had created it
            segment.write(struct.pack(HEADER_FORMAT, MAGIC, dead_pid, 4096))
        cache = SharedKVCache.for_ranks(RANK_SPEC, num_blocks=1, num_ranks=2)
        cache.close()
        assert not left.path.exists()
        assert live.path.exists(), "a running owner's segment is never touched"
    finally:
        left.close()
        live.close()


def descriptor(num_ranks: int) -> KVDescriptor:
    spec = KVCacheSpec(**{**RANK_SPEC.__dict__, "num_layers": 3 * num_ranks})
    return KVDescriptor.for_cache("shm", "d0", "tcp://127.0.0.1:1", spec, 8, "fp", {}, num_ranks)


def test_the_descriptor_carries_the_rank_count_and_refuses_another():
    sent = descriptor(2)
    assert (sent.num_layers, sent.tensor_parallel_size) == (3, 2)
    received = KVDescriptor.decode(sent.encode())
    assert received == sent and received.spec.num_layers == 6
    node_spec = received.spec
    check_compatible(received, "shm", node_spec, "fp", tensor_parallel_size=2)
    with pytest.raises(DescriptorMismatch) as refused:
        check_compatible(received, "shm", RANK_SPEC, "fp", tensor_parallel_size=1)
    message = str(refused.value)
    assert "tensor_parallel_size is 2 on decode node 'd0' and 1 on this prefill node" in message
    assert "num_layers" not in message, "the size alone explains the other differences"
