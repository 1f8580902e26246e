"""Gives sequences their KV blocks: allocation with eviction, prefix reuse, fork, copy-on-write.

Owns the `BlockPool` (reference counts, free list) and the prefix cache. A sequence's block
table holds one reference per entry. Blocks the prefix cache alone holds count as free for
admission: `allocate_slots` evicts them (least recently used first) before it reports a
shortage, so nothing is preempted while an idle cached block remains.

Invariant (checked by `check_integrity`): free + in use + idle cached == total, and every
reference count equals the number of block tables holding the block plus one if the cache
holds it.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.kv.block_pool import BlockPool
from pdserve.engine.prefix_cache import make_prefix_cache
from pdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        prefix_cache_min_blocks: int = 1,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.num_copied_blocks = 0  # copy-on-write copies made, in all
        self.prefix_cache = make_prefix_cache(
            enable_prefix_caching, self.pool, block_size, prefix_cache_min_blocks
        )

    @property
    def ref_counts(self) -> list[int]:
        return self.pool.ref_counts

    @property
    def free_block_ids(self) -> list[int]:
        return self.pool.free_block_ids

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new tokens: free ones plus those only the prefix cache holds."""
        return self.pool.num_free + self.pool.num_idle_cached

    @property
    def num_cached_blocks(self) -> int:
        """Blocks only the prefix cache holds (kept for reuse, evictable at any time)."""
        return self.pool.num_idle_cached

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain so that its next `num_new_tokens` tokens have slots."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence holding no blocks: takes the cached blocks of its longest cached
        prefix (at least one token is left to compute, so a token can be sampled) and marks
        their tokens computed. Returns the number of tokens reused. A sequence that asks for
        prompt logprobs takes cached blocks only over the positions it has scored already:
        cached positions have no logits (engine/sample/prompt_logprobs.py)."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already holds blocks")
        blocks = self.prefix_cache.match(seq.token_ids)
        reusable = seq.num_tokens - 1
        if seq.prompt_logprobs is not None:
            reusable = min(reusable, seq.prompt_logprobs.num_scored)
        del blocks[reusable // self.block_size :]
        for block_id in blocks:
            self.pool.incref(block_id)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        return seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Grows seq's block table for its next tokens; False (nothing changed) if short.

        `reserve` blocks must remain free afterwards (a watermark for admissions).
        """
        count = self.num_new_blocks(seq, num_new_tokens)
        if not self._ensure_free(count + reserve):
            return False
        for _ in range(count):
            seq.block_table.append(self.pool.allocate())
        return True

    def allocate_blocks(self, count: int) -> list[int] | None:
        """`count` blocks held by the caller (evicting idle cached blocks if needed); None,
        changing nothing, when they are not available."""
        if not self._ensure_free(count):
            return None
        return [self.pool.allocate() for _ in range(count)]

    def hold_blocks(self, block_ids: list[int]) -> None:
        """The caller takes one more reference on each block (e.g. while a transfer reads it)."""
        for block_id in block_ids:
            self.pool.incref(block_id)

    def release_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.pool.decref(block_id)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offers seq's full blocks of computed KV to the prefix cache; where the cache already
        holds the same tokens in another block, seq switches to the cache's block."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_blocks_offered:
            return
        table = seq.block_table
        cached = self.prefix_cache.insert(
            seq.token_ids[: num_full * self.block_size], table[:num_full]
        )
        for index, block_id in enumerate(cached):
            if table[index] != block_id:
                self.pool.incref(block_id)
                self.pool.decref(table[index])
                table[index] = block_id
        seq.num_blocks_offered = num_full

    def free(self, seq: Sequence) -> None:
        """Offers seq's computed blocks to the prefix cache, then drops seq's references."""
        self.cache_computed_blocks(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Drops seq's references; blocks no longer held by anyone return to the free list."""
        for block_id in reversed(seq.block_table):
            self.pool.decref(block_id)
        seq.block_table = []
        seq.num_blocks_offered = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks (copy-on-write on the first divergent write;
        n choices of one prompt, engine/forks.py)."""
        if child.block_table:
            raise ValueError(f"fork target {child.request_id} already holds blocks")
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.pool.incref(block_id)

    def copy_on_write(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Makes the blocks seq's next tokens write into private; returns (src, dst) copies.

        Returns None, changing nothing, when there are not enough free blocks.
        """
        first = seq.num_computed_tokens // self.block_size
        last = min(
            len(seq.block_table), self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        )
        shared = [i for i in range(first, last) if self.pool.ref_counts[seq.block_table[i]] > 1]
        if not self._ensure_free(len(shared)):
            return None
        copies = []
        for index in shared:
            src = seq.block_table[index]
            dst = self.pool.allocate()
            self.pool.decref(src)
            seq.block_table[index] = dst
            copies.append((src, dst))
        self.num_copied_blocks += len(copies)
        return copies

    def _ensure_free(self, count: int) -> bool:
        shortage = count - self.pool.num_free
        if shortage > 0 and shortage <= self.pool.num_idle_cached:
            self.prefix_cache.evict(shortage)
        return count <= self.pool.num_free

    def check_integrity(self, block_tables: Iterable[list[int]] | None = None) -> None:
        """Raises RuntimeError when the accounting is inconsistent.

        With `block_tables` (every live sequence's), also checks each ref count against them.
        """
        table_counts = None
        if block_tables is not None:
            table_counts = [0] * self.num_blocks
            for table in block_tables:
                for block_id in table:
                    table_counts[block_id] += 1
        self.pool.check_integrity(table_counts)
        self.prefix_cache.check_integrity()
