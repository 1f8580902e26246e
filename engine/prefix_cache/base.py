"""Prefix cache interface: full KV blocks kept after their requests, found again by token ids.

Callers (all in `pdserve.engine.kv.block_manager.BlockManager`, which owns the cache):
  match(token_ids)       at admission of a sequence that holds no blocks: the cache's blocks
                         for the longest run of full blocks that is a prefix of `token_ids`.
                         The caller locks them by taking a reference on each (a block held by a
                         block table is never evicted), and prefills only the rest.
  insert(ids, blocks)    after a step that filled blocks, and when a sequence ends or is
                         preempted: `ids` covers exactly `len(blocks)` full blocks of computed
                         KV. Returns the cache's block for each position, which differs where
                         the same tokens were cached first by another sequence; the caller
                         then uses the cache's block and drops its own copy.
  evict(num_blocks)      when the allocator runs short, before anything is preempted: frees
                         up to `num_blocks` blocks that only the cache holds, least recently
                         used first; returns their ids.
  record_admission(n, hit)  counts `n` queried prompt tokens of which `hit` came from the cache.
A partially filled block is never inserted, so no block shared through the cache is ever
written again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Totals since start; `queries` and `hits` count prompt tokens, `evicted_blocks` blocks."""

    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0


class PrefixCache(ABC):
    def __init__(self) -> None:
        self.stats = PrefixCacheStats()

    def record_admission(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int:
        """Blocks the cache holds a reference on (idle or also in use)."""

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, in full blocks."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> list[int]:
        """Caches `block_ids` under `token_ids` (len(token_ids) == len(block_ids) * block_size);
        returns the cache's block for each position."""

    @abstractmethod
    def evict(self, num_blocks: int) -> list[int]:
        """Frees up to `num_blocks` blocks held by the cache alone, LRU first."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raises RuntimeError when the cache's structure or its block holdings are wrong."""
