"""The KV blocks themselves: reference counts, the free list, and which blocks the cache holds.

A block's reference count is the number of block tables holding it plus one if the prefix cache
holds it. Every block is in exactly one state:
  free         ref count 0, on the free list exactly once;
  in use       held by at least one block table (and maybe by the cache too);
  idle cached  held by the prefix cache alone (ref count 1): its KV is kept for future matches
               but the cache gives it up (eviction) whenever the allocator runs short.
Blocks are handed out in LIFO order so recently freed (cache-warm) blocks are reused first.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))
        self.cached = [False] * num_blocks
        self.num_idle_cached = 0

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def allocate(self) -> int:
        block_id = self.free_block_ids.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} referenced while free")
        if count == 1 and self.cached[block_id]:
            self.num_idle_cached -= 1
        self.ref_counts[block_id] = count + 1

    def decref(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} freed while not in use")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self.free_block_ids.append(block_id)
        elif count == 2 and self.cached[block_id]:
            self.num_idle_cached += 1

    def hold_in_cache(self, block_id: int) -> None:
        """The prefix cache takes its own reference on an in-use block."""
        if self.cached[block_id]:
            raise RuntimeError(f"block {block_id} is already in the prefix cache")
        self.incref(block_id)
        self.cached[block_id] = True

    def release_from_cache(self, block_id: int) -> None:
        if not self.cached[block_id]:
            raise RuntimeError(f"block {block_id} is not in the prefix cache")
        if self.ref_counts[block_id] == 1:
            self.num_idle_cached -= 1
        self.cached[block_id] = False
        self.decref(block_id)

    def is_idle_cached(self, block_id: int) -> bool:
        return self.cached[block_id] and self.ref_counts[block_id] == 1

    def check_integrity(self, table_counts: list[int] | None) -> None:
        """Raises RuntimeError when the accounting is inconsistent; `table_counts[b]` (how many
        live block tables hold block b), when given, must explain every reference count."""
        free = self.free_block_ids
        if len(set(free)) != len(free):
            raise RuntimeError("a block is on the free list twice")
        if any(self.ref_counts[b] != 0 for b in free):
            raise RuntimeError("a block on the free list has a nonzero ref count")
        in_use = sum(1 for b in range(self.num_blocks) if self.ref_counts[b] > self.cached[b])
        idle = sum(1 for b in range(self.num_blocks) if self.is_idle_cached(b))
        if idle != self.num_idle_cached:
            raise RuntimeError(f"{idle} idle cached blocks, but {self.num_idle_cached} counted")
        if len(free) + in_use + idle != self.num_blocks:
            raise RuntimeError(
                f"free {len(free)} + in use {in_use} + cached {idle} != total {self.num_blocks}"
            )
        if table_counts is not None:
            expected = [n + c for n, c in zip(table_counts, self.cached)]
            if expected != self.ref_counts:
                raise RuntimeError("ref counts do not match the live block tables and the cache")
