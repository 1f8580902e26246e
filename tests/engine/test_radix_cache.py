"""The radix prefix cache on its own: matching, splitting, LRU eviction, locks, accounting.

Block size 4 throughout. A "sequence" here is a list of block ids on which the test holds one
reference each, the way a block table does; holding them is what locks a cached prefix.
"""

from __future__ import annotations

import random

import pytest

from pdserve.engine.kv.block_pool import BlockPool
from pdserve.engine.prefix_cache import RadixPrefixCache

BS = 4


def make_cache(num_blocks: int = 32, min_blocks: int = 1) -> tuple[BlockPool, RadixPrefixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixPrefixCache(pool, BS, min_blocks)


def cache_tokens(pool: BlockPool, cache: RadixPrefixCache, tokens: list[int]) -> list[int]:
    """Computes (allocates) every full block of tokens, inserts them, drops the test's refs."""
    blocks = [pool.allocate() for _ in range(len(tokens) // BS)]
    cached = cache.insert(tokens[: len(blocks) * BS], blocks)
    for block_id in blocks:
        pool.decref(block_id)
    return cached


def check(pool: BlockPool, cache: RadixPrefixCache, held: list[list[int]] = ()) -> None:
    counts = [0] * pool.num_blocks
    for table in held:
        for block_id in table:
            counts[block_id] += 1
    pool.check_integrity(counts)
    cache.check_integrity()


def test_match_diverging_inside_a_block_reuses_only_the_blocks_before_it():
    pool, cache = make_cache()
    a = cache_tokens(pool, cache, list(range(12)))
    query = list(range(6)) + [99] * 6
    assert cache.match(query) == a[:1]
    top = cache.root.children[(0, 1, 2, 3)]
    assert top.block_ids == a[:1]
    assert [c.block_ids for c in top.children.values()] == [a[1:]]
    b = cache_tokens(pool, cache, query)
    assert b[0] == a[0] and b[1:] != a[1:]
    assert sorted(len(c.block_ids) for c in top.children.values()) == [2, 2]
    check(pool, cache)


def test_insert_of_a_shorter_prefix_splits_the_node_and_returns_the_cached_blocks():
    pool, cache = make_cache()
    a = cache_tokens(pool, cache, list(range(16)))
    mine = [pool.allocate(), pool.allocate()]
    assert cache.insert(list(range(8)), mine) == a[:2]
    for block_id in mine:
        pool.decref(block_id)
    assert pool.num_free == 32 - 4
    assert [len(c.block_ids) for c in cache.root.children.values()] == [2]
    check(pool, cache)


def test_match_stops_at_the_last_full_block_of_the_query():
    pool, cache = make_cache()
    a = cache_tokens(pool, cache, list(range(16)))
    assert cache.match(list(range(11))) == a[:2]
    assert cache.match(list(range(3))) == []
    assert cache.match([]) == []
    check(pool, cache)


def test_eviction_takes_least_recently_used_leaves_tail_first():
    pool, cache = make_cache()
    x = cache_tokens(pool, cache, [1] * 8)
    y = cache_tokens(pool, cache, [2] * 8)
    z = cache_tokens(pool, cache, [3] * 8)
    cache.match([1] * 8)
    assert cache.evict(3) == [y[1], y[0], z[1]]
    assert cache.evict(10) == [z[0], x[1], x[0]]
    assert cache.stats.evicted_blocks == 6
    check(pool, cache)


def test_parent_becomes_evictable_only_after_its_children_are_gone():
    pool, cache = make_cache()
    shared = cache_tokens(pool, cache, [7] * 8 + [1] * 4)
    branch = cache_tokens(pool, cache, [7] * 8 + [2] * 4)
    cache.match([7] * 8 + [1] * 4)
    assert cache.evict(1) == [branch[2]]
    assert cache.evict(4) == [shared[2], shared[1], shared[0]]
    check(pool, cache)


def test_a_locked_prefix_is_never_evicted():
    pool, cache = make_cache()
    locked = cache_tokens(pool, cache, list(range(12)))
    other = cache_tokens(pool, cache, [50] * 8)
    held = cache.match(list(range(12)))
    for block_id in held:
        pool.incref(block_id)
    assert sorted(cache.evict(100)) == sorted(other)
    assert cache.match(list(range(12))) == locked
    check(pool, cache, [held])
    for block_id in held:
        pool.decref(block_id)
    assert sorted(cache.evict(100)) == sorted(locked)


def test_a_partly_locked_leaf_gives_up_only_its_unlocked_tail():
    pool, cache = make_cache()
    blocks = cache_tokens(pool, cache, list(range(16)))
    held = cache.match(list(range(9)))
    for block_id in held:
        pool.incref(block_id)
    assert cache.evict(10) == [blocks[3], blocks[2]]
    check(pool, cache, [held])
    for block_id in held:
        pool.decref(block_id)


def test_reference_counts_return_to_zero_after_release_and_eviction():
    pool, cache = make_cache(num_blocks=16)
    for start in range(0, 40, 8):
        cache_tokens(pool, cache, list(range(start, start + 12)))
    assert pool.num_idle_cached == cache.num_cached_blocks == 15
    assert len(cache.evict(100)) == 15
    assert pool.ref_counts == [0] * 16 and pool.num_free == 16
    check(pool, cache)


def test_runs_shorter_than_the_threshold_are_not_kept():
    pool, cache = make_cache(min_blocks=3)
    assert cache_tokens(pool, cache, list(range(8))) and cache.num_cached_blocks == 0
    cache_tokens(pool, cache, list(range(12)))
    assert cache.num_cached_blocks == 3
    assert len(cache.match(list(range(8)))) == 2
    check(pool, cache)


def test_integrity_check_catches_a_misfiled_node():
    pool, cache = make_cache()
    cache_tokens(pool, cache, list(range(8)))
    node = cache.root.children.pop((0, 1, 2, 3))
    cache.root.children[(9, 9, 9, 9)] = node
    with pytest.raises(RuntimeError, match="wrong key"):
        cache.check_integrity()


def test_integrity_check_catches_a_block_the_pool_does_not_mark_cached():
    pool, cache = make_cache()
    blocks = cache_tokens(pool, cache, list(range(8)))
    pool.cached[blocks[0]] = False
    with pytest.raises(RuntimeError):
        check(pool, cache)


class NaiveCache:
    """The reference: a dict from every cached prefix (whole blocks) to its block, and a clock.

    Eviction picks, among cached prefixes that no cached prefix extends and that no sequence
    holds, the least recently touched; every match and insert touches all prefixes it covers.
    """

    def __init__(self, min_blocks: int) -> None:
        self.min_blocks = min_blocks
        self.blocks: dict[tuple[int, ...], int] = {}
        self.touched: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def match(self, tokens: list[int]) -> list[int]:
        self.clock += 1
        out = []
        for end in range(BS, len(tokens) + 1, BS):
            prefix = tuple(tokens[:end])
            if prefix not in self.blocks:
                break
            self.touched[prefix] = self.clock
            out.append(self.blocks[prefix])
        return out

    def insert(self, tokens: list[int], blocks: list[int]) -> list[int]:
        if len(blocks) < self.min_blocks:
            return list(blocks)
        self.clock += 1
        out = []
        for i, block_id in enumerate(blocks):
            prefix = tuple(tokens[: (i + 1) * BS])
            self.blocks.setdefault(prefix, block_id)
            self.touched[prefix] = self.clock
            out.append(self.blocks[prefix])
        return out

    def evict(self, count: int, held: set[int]) -> list[int]:
        out = []
        while len(out) < count:
            extended = {p[:-BS] for p in self.blocks}
            candidates = [p for p, b in self.blocks.items() if p not in extended and b not in held]
            if not candidates:
                break
            victim = min(candidates, key=lambda p: self.touched[p])
            out.append(self.blocks.pop(victim))
            del self.touched[victim]
        return out


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_agree_with_a_naive_reference(seed):
    rng = random.Random(seed)
    min_blocks = 1 + seed % 2
    pool, cache = make_cache(num_blocks=48, min_blocks=min_blocks)
    naive = NaiveCache(min_blocks)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(0, 20))] for _ in range(6)]
    live: list[tuple[list[int], list[int]]] = []

    def evict(count: int, pending: list[int] = ()) -> None:
        held = {b for _, table in live for b in table}.union(pending)
        expected = naive.evict(count, held)
        assert cache.evict(count) == expected

    def offer(tokens: list[int], table: list[int], num_blocks: int) -> None:
        cached = cache.insert(tokens[: num_blocks * BS], table[:num_blocks])
        assert cached == naive.insert(tokens[: num_blocks * BS], table[:num_blocks])
        for i, block_id in enumerate(cached):
            if table[i] != block_id:
                pool.incref(block_id)
                pool.decref(table[i])
                table[i] = block_id

    for _ in range(1500):
        op = rng.random()
        if op < 0.4:
            stem = rng.choice(stems)
            tokens = stem + [rng.randrange(3) for _ in range(rng.randrange(0, 16))]
            table = cache.match(tokens)
            assert table == naive.match(tokens)
            for block_id in table:
                pool.incref(block_id)
            needed = len(tokens) // BS - len(table)
            shortage = needed - pool.num_free
            if shortage > 0:
                evict(shortage, table)
            if needed > pool.num_free:
                for block_id in table:
                    pool.decref(block_id)
                continue
            table += [pool.allocate() for _ in range(needed)]
            live.append((tokens, table))
        elif op < 0.6 and live:
            tokens, table = rng.choice(live)
            offer(tokens, table, rng.randrange(len(table) + 1))
        elif op < 0.85 and live:
            tokens, table = live.pop(rng.randrange(len(live)))
            offer(tokens, table, len(table))
            for block_id in table:
                pool.decref(block_id)
        else:
            evict(rng.randrange(1, 6))
        check(pool, cache, [table for _, table in live])

    for tokens, table in live:
        for block_id in table:
            pool.decref(block_id)
    live.clear()
    evict(pool.num_blocks)
    assert pool.ref_counts == [0] * pool.num_blocks and pool.num_free == pool.num_blocks
    assert cache.num_cached_blocks == 0 and not cache.root.children
    check(pool, cache)
