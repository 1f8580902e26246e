"""Prefix caches: `RadixPrefixCache` (the default) and `NullPrefixCache` (caching off)."""

from __future__ import annotations

from pdserve.engine.kv.block_pool import BlockPool
from pdserve.engine.prefix_cache.base import PrefixCache, PrefixCacheStats
from pdserve.engine.prefix_cache.null_cache import NullPrefixCache
from pdserve.engine.prefix_cache.radix_cache import RadixPrefixCache

__all__ = [
    "NullPrefixCache",
    "PrefixCache",
    "PrefixCacheStats",
    "RadixPrefixCache",
    "make_prefix_cache",
]


def make_prefix_cache(
    enabled: bool, pool: BlockPool, block_size: int, min_blocks: int = 1
) -> PrefixCache:
    """The radix cache when `enabled`, else the null one; `min_blocks` is the shortest run of
    full blocks worth keeping."""
    if not enabled:
        return NullPrefixCache()
    return RadixPrefixCache(pool, block_size, min_blocks)
