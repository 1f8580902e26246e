"""Radix tree over runs of full KV blocks, keyed by their token ids.

Each node holds a run of whole blocks: `token_ids` (len = block_size * len(block_ids)) and the
blocks whose KV those tokens produced, continuing its parent's run. Children are keyed by the
token ids of their first block, so siblings never share a first block. A match or insert that
diverges inside a node splits it at the block boundary before the first differing block (a
difference at token 20 of a 16-token-block node keeps block 0 shared, splits before block 1).

The tree holds one reference on each of its blocks (`BlockPool.hold_in_cache`). Sequences
using a cached prefix hold references too, always on a whole prefix of a path, so a block that
only the tree holds has no referenced block below it. Eviction takes such blocks from the tail
of the least recently used leaf, then treats the emptied leaf's parent as a leaf.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from pdserve.engine.kv.block_pool import BlockPool
from pdserve.engine.prefix_cache.base import PrefixCache


class RadixNode:
    __slots__ = ("block_ids", "children", "last_access", "parent", "serial", "token_ids")

    def __init__(
        self,
        token_ids: list[int],
        block_ids: list[int],
        parent: RadixNode | None,
        last_access: int,
        serial: int,
    ) -> None:
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.last_access = last_access
        self.serial = serial


class RadixPrefixCache(PrefixCache):
    def __init__(self, pool: BlockPool, block_size: int, min_blocks: int = 1) -> None:
        if min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
        super().__init__()
        self.pool = pool
        self.block_size = block_size
        self.min_blocks = min_blocks
        self._serials = itertools.count()
        self._clock = 0
        self.root = RadixNode([], [], None, 0, next(self._serials))
        self._num_blocks = 0

    @property
    def num_cached_blocks(self) -> int:
        return self._num_blocks

    def match(self, token_ids: Sequence[int]) -> list[int]:
        blocks: list[int] = []
        for node in self._walk(token_ids, len(token_ids) // self.block_size):
            blocks.extend(node.block_ids)
        return blocks

    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> list[int]:
        num_blocks = len(block_ids)
        if len(token_ids) != num_blocks * self.block_size:
            raise ValueError(
                f"{len(token_ids)} token ids do not fill {num_blocks} blocks of {self.block_size}"
            )
        if num_blocks < self.min_blocks:
            return list(block_ids)
        cached: list[int] = []
        parent = self.root
        for node in self._walk(token_ids, num_blocks):
            cached.extend(node.block_ids)
            parent = node
        start = len(cached)
        if start < num_blocks and parent is not self.root and not parent.children:
            parent.token_ids.extend(token_ids[start * self.block_size :])
            parent.block_ids.extend(block_ids[start:])
            self._hold(block_ids[start:])
            cached.extend(block_ids[start:])
        elif start < num_blocks:
            node = RadixNode(
                list(token_ids[start * self.block_size :]),
                list(block_ids[start:]),
                parent,
                self._clock,
                next(self._serials),
            )
            self._hold(node.block_ids)
            parent.children[self._key(node.token_ids, 0)] = node
            cached.extend(node.block_ids)
        return cached

    def _hold(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.pool.hold_in_cache(block_id)
        self._num_blocks += len(block_ids)

    def evict(self, num_blocks: int) -> list[int]:
        candidates = [
            (leaf.last_access, leaf.serial, leaf)
            for leaf in self._leaves()
            if self._evictable(leaf)
        ]
        heapq.heapify(candidates)
        evicted: list[int] = []
        while candidates and len(evicted) < num_blocks:
            _, _, node = heapq.heappop(candidates)
            key = self._key(node.token_ids, 0)
            while (
                node.block_ids
                and len(evicted) < num_blocks
                and self.pool.is_idle_cached(node.block_ids[-1])
            ):
                block_id = node.block_ids.pop()
                del node.token_ids[-self.block_size :]
                self.pool.release_from_cache(block_id)
                evicted.append(block_id)
            if node.block_ids:
                continue
            parent = node.parent
            del parent.children[key]
            if parent is not self.root and not parent.children and self._evictable(parent):
                heapq.heappush(candidates, (parent.last_access, parent.serial, parent))
        self._num_blocks -= len(evicted)
        self.stats.evicted_blocks += len(evicted)
        return evicted

    def check_integrity(self) -> None:
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or not child.block_ids:
                    raise RuntimeError(f"radix node {child.serial} is detached or empty")
                if len(child.token_ids) != len(child.block_ids) * self.block_size:
                    raise RuntimeError(f"radix node {child.serial} has a partial block")
                if self._key(child.token_ids, 0) != key:
                    raise RuntimeError(f"radix node {child.serial} is filed under the wrong key")
                if seen.intersection(child.block_ids) or len(set(child.block_ids)) < len(
                    child.block_ids
                ):
                    raise RuntimeError(f"a block of radix node {child.serial} is cached twice")
                seen.update(child.block_ids)
                stack.append(child)
        held = {b for b in range(self.pool.num_blocks) if self.pool.cached[b]}
        if seen != held or len(seen) != self._num_blocks:
            raise RuntimeError(
                f"the tree has {len(seen)} blocks, the pool marks {len(held)} cached, "
                f"the count says {self._num_blocks}"
            )

    def _walk(self, token_ids: Sequence[int], num_blocks: int) -> list[RadixNode]:
        """Nodes covering the longest cached prefix of token_ids' first num_blocks blocks,
        splitting the last one where the match ends inside it; marks them used now."""
        self._clock += 1
        path: list[RadixNode] = []
        node = self.root
        block = 0
        while block < num_blocks:
            child = node.children.get(self._key(token_ids, block * self.block_size))
            if child is None:
                break
            matched = self._matching_blocks(child, token_ids, block, num_blocks)
            if matched < len(child.block_ids):
                child = self._split(child, matched)
            child.last_access = self._clock
            path.append(child)
            block += matched
            node = child
        return path

    def _matching_blocks(
        self, node: RadixNode, token_ids: Sequence[int], block: int, num_blocks: int
    ) -> int:
        size = self.block_size
        limit = min(len(node.block_ids), num_blocks - block)
        start = block * size
        if node.token_ids[: limit * size] == list(token_ids[start : start + limit * size]):
            return limit
        matched = 1
        while matched < limit and node.token_ids[matched * size : (matched + 1) * size] == list(
            token_ids[start + matched * size : start + (matched + 1) * size]
        ):
            matched += 1
        return matched

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cuts node after its first num_blocks blocks; returns the new upper part."""
        cut = num_blocks * self.block_size
        upper = RadixNode(
            node.token_ids[:cut],
            node.block_ids[:num_blocks],
            node.parent,
            node.last_access,
            next(self._serials),
        )
        node.parent.children[self._key(node.token_ids, 0)] = upper
        node.token_ids = node.token_ids[cut:]
        node.block_ids = node.block_ids[num_blocks:]
        node.parent = upper
        upper.children[self._key(node.token_ids, 0)] = node
        return upper

    def _key(self, token_ids: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(token_ids[start : start + self.block_size])

    def _leaves(self) -> list[RadixNode]:
        leaves = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def _evictable(self, node: RadixNode) -> bool:
        return self.pool.is_idle_cached(node.block_ids[-1])
