"""KV blocks an engine holds outside every sequence's block table (disaggregated serving, forks).

Holders, one ledger (a count of holds per block, so one block may be held several times):
  decode side: `reserve(num_tokens)` allocates blocks for a prompt whose KV another node
      computes; they stay held until `hand_over` gives them to the request that joins the
      batch (`LLMEngine.add_prefilled_request`) or `release` returns them (the transfer failed
      or the request was aborted);
  prefill side: `hold(block_ids)` keeps blocks, and their KV, that a transfer still reads, even
      after their request has finished, until `release`;
  forks (engine/forks.py): a reference per further choice of a prompt, until it forks.
`check_integrity` counts the held blocks as one more block table: nothing held may be free.
"""

from __future__ import annotations

from collections import Counter

from pdserve.engine.kv.block_manager import BlockManager


class HeldBlocks:
    def __init__(self, block_manager: BlockManager) -> None:
        self._block_manager = block_manager
        self.counts: Counter[int] = Counter()

    def __bool__(self) -> bool:
        return bool(self.counts)

    def elements(self) -> list[int]:
        """Every held block, once per hold (the table `check_integrity` checks)."""
        return list(self.counts.elements())

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens, held; None if the cache cannot hold them now."""
        block_ids = self._block_manager.allocate_blocks(
            self._block_manager.blocks_for_tokens(num_tokens)
        )
        if block_ids is not None:
            self.counts.update(block_ids)
        return block_ids

    def hold(self, block_ids: list[int]) -> None:
        """One more reference to each block (a block may appear several times)."""
        self._block_manager.hold_blocks(block_ids)
        self.counts.update(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Drops the holds and their references (blocks no one else references are free)."""
        self.hand_over(block_ids)
        self._block_manager.release_blocks(block_ids)

    def hand_over(self, block_ids: list[int]) -> None:
        """Forgets the holds on blocks whose references the caller now gives to a sequence."""
        self.counts.subtract(block_ids)
        if min(self.counts.values(), default=0) < 0:
            raise RuntimeError(f"released blocks that were not held: {block_ids}")
        self.counts = +self.counts
