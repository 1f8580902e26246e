"""No prefix cache: nothing is kept, nothing matches (for A/B runs and as a test double)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.prefix_cache.base import PrefixCache


class NullPrefixCache(PrefixCache):
    @property
    def num_cached_blocks(self) -> int:
        return 0

    def match(self, token_ids: Sequence[int]) -> list[int]:
        return []

    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> list[int]:
        return block_ids

    def evict(self, num_blocks: int) -> list[int]:
        return []

    def check_integrity(self) -> None:
        return None
