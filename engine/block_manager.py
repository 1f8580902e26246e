"""Owner of the paged KV cache's blocks: free list, reference counts, copy-on-write.

Invariant (checked by `check_integrity`): every block is either free (ref count 0, on the free
list exactly once) or in use (ref count = number of block tables holding it); free + in use +
cached == total. Blocks are handed out in LIFO order so recently freed (cache-warm) blocks are
reused first.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))
        self.num_cached_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain so that its next `num_new_tokens` tokens have slots."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Grows seq's block table for its next tokens; False (nothing changed) if short.

        `reserve` blocks must remain free afterwards (a watermark for admissions).
        """
        count = self.num_new_blocks(seq, num_new_tokens)
        if count + reserve > len(self.free_block_ids):
            return False
        for _ in range(count):
            block_id = self.free_block_ids.pop()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; blocks whose count reaches zero return to the free list."""
        for block_id in reversed(seq.block_table):
            self._decref(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks (copy-on-write on the first divergent write)."""
        if child.block_table:
            raise ValueError(f"fork target {child.request_id} already holds blocks")
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def copy_on_write(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Makes the blocks seq's next tokens write into private; returns (src, dst) copies.

        Returns None, changing nothing, when there are not enough free blocks.
        """
        first = seq.num_computed_tokens // self.block_size
        last = min(
            len(seq.block_table), self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        )
        shared = [i for i in range(first, last) if self.ref_counts[seq.block_table[i]] > 1]
        if len(shared) > len(self.free_block_ids):
            return None
        copies = []
        for index in shared:
            src = seq.block_table[index]
            dst = self.free_block_ids.pop()
            self.ref_counts[dst] = 1
            self._decref(src)
            seq.block_table[index] = dst
            copies.append((src, dst))
        return copies

    def _decref(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} freed while not in use")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self.free_block_ids.append(block_id)

    def check_integrity(self, block_tables: Iterable[list[int]] | None = None) -> None:
        """Raises AssertionError-like RuntimeError when the accounting is inconsistent.

        With `block_tables` (every live sequence's), also checks each ref count against them.
        """
        free = self.free_block_ids
        if len(set(free)) != len(free):
            raise RuntimeError("a block is on the free list twice")
        if any(self.ref_counts[b] != 0 for b in free):
            raise RuntimeError("a block on the free list has a nonzero ref count")
        in_use = sum(1 for c in self.ref_counts if c > 0)
        if len(free) + in_use + self.num_cached_blocks != self.num_blocks:
            raise RuntimeError(
                f"free {len(free)} + in use {in_use} + cached {self.num_cached_blocks} "
                f"!= total {self.num_blocks}"
            )
        if block_tables is not None:
            expected = [0] * self.num_blocks
            for table in block_tables:
                for block_id in table:
                    expected[block_id] += 1
            if expected != self.ref_counts:
                raise RuntimeError("ref counts do not match the live block tables")
