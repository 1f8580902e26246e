"""A KV cache in a named shared-memory segment (engine/kv/shared_segment.py): other processes on
this host map it by name and read or write its blocks in place.

Two owners make one:
- the shm KV transport, for a decode node's cache, which prefill nodes write into;
- a tensor-parallel engine on the CPU, for its node cache: every rank's shard in one segment,
  rank-major in the layer dimension ([size x num_layers, 2, num_blocks, ...], rank r's layers
  at r x num_layers). Rank 0 creates it under a drawn id and publishes the segment's name in
  the group's store; each worker rank maps it and runs on its own slice (`rank_shard`). A KV
  transfer moves the node cache whole, so each prefill rank's shard lands in the same rank's
  shard of the decode node: a node cache is a cache of `num_ranks` x `num_layers` layers.

Lifetime: the creator unlinks the segment on `close()` or at exit; a creator killed outright
leaves it behind, and the next tensor-parallel engine on the host removes it
(`SharedSegment.remove_abandoned`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec, check_holds_a_block
from pdserve.engine.kv.shared_segment import SharedSegment

RANKS_ID_PREFIX = "tp-"


def node_spec(rank_spec: KVCacheSpec, num_ranks: int) -> KVCacheSpec:
    """The spec of a node cache holding `num_ranks` shards of `rank_spec`'s shape."""
    return dataclasses.replace(rank_spec, num_layers=rank_spec.num_layers * num_ranks)


class SharedKVCache(KVCache):
    segment: SharedSegment
    num_ranks: int

    @classmethod
    def create(
        cls, segment_id: str, spec: KVCacheSpec, num_blocks: int, num_ranks: int = 1
    ) -> SharedKVCache:
        """A zeroed cache of `num_blocks` blocks of `spec` (the whole node's spec) in a new
        segment `pdserve-kv-<segment_id>`."""
        check_holds_a_block(spec, num_blocks)
        segment = SharedSegment.create(segment_id, num_blocks * spec.bytes_per_block)
        return cls._over(segment, spec, num_ranks)

    @classmethod
    def for_ranks(cls, rank_spec: KVCacheSpec, num_blocks: int, num_ranks: int) -> SharedKVCache:
        """A tensor-parallel engine's node cache, under an id drawn from this process's pid."""
        SharedSegment.remove_abandoned(RANKS_ID_PREFIX)
        segment_id = f"{RANKS_ID_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        return cls.create(segment_id, node_spec(rank_spec, num_ranks), num_blocks, num_ranks)

    @classmethod
    def attach(
        cls, name: str, rank_spec: KVCacheSpec, num_blocks: int, num_ranks: int
    ) -> SharedKVCache:
        """Maps the node cache another process created (a worker rank's view of rank 0's)."""
        spec = node_spec(rank_spec, num_ranks)
        segment = SharedSegment.attach(name, num_blocks * spec.bytes_per_block)
        return cls._over(segment, spec, num_ranks)

    @classmethod
    def _over(cls, segment: SharedSegment, spec: KVCacheSpec, num_ranks: int) -> SharedKVCache:
        if spec.num_layers % num_ranks:
            raise ValueError(f"{spec.num_layers} layers do not split into {num_ranks} ranks")
        cache = cls.over_buffer(spec, segment.payload)
        cache.segment = segment
        cache.num_ranks = num_ranks
        return cache

    @property
    def name(self) -> str:
        return self.segment.path.name

    def rank_shard(self, rank: int) -> KVCache:
        """Rank `rank`'s own cache: its slice of the layer dimension, in place."""
        layers = self.spec.num_layers // self.num_ranks
        spec = dataclasses.replace(self.spec, num_layers=layers)
        return KVCache.over_buffer(spec, self.buffer[rank * layers:(rank + 1) * layers])

    def close(self) -> None:
        """Unlinks the segment if this process created it."""
        self.segment.close()
