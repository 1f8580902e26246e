"""Which node gets a request.

- Decode (and colocated) nodes: the most free KV blocks, then the fewest running requests.
  Free blocks are the node's last report less the prompt blocks of the requests sent to it
  since (`NodeState.promised_blocks`), so a burst between two reports spreads over the nodes.
- Prefill nodes: the longest cached prefix, from a per-node index of the block hashes of the
  prompts the router sent there (chained hashes of block-sized runs of token ids, so two
  prompts share a hash exactly when they share every token up to the end of that block; kept
  for decode nodes too, of the prompts they compute themselves: prefill_placement.py). The
  index is the router's belief, not the node's cache: it forgets the oldest hashes beyond
  `max_blocks_per_node` and never learns about evictions, which only costs a cache miss.
  Ties go to the node with less queued work, then to the one with the smaller index, so new
  prefixes spread over the nodes.
  Load balance: when the best-matching node has more than `imbalance_tokens` more uncached
  prompt tokens queued (sent, first token not back yet; router/cluster/queue_delay.py keeps the
  queues) than the least loaded one, the least loaded one gets the request.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.queue_delay import PromptQueues


def pick_decode_node(nodes: list[NodeState]) -> NodeState | None:
    return max(
        nodes,
        key=lambda n: (
            n.stats.kv.num_free_blocks - n.promised_blocks,
            -n.stats.scheduling.num_running,
        ),
        default=None,
    )


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


class PrefillRouter:
    def __init__(
        self,
        queues: PromptQueues,
        imbalance_tokens: int = 4096,
        max_blocks_per_node: int = 1 << 17,
    ) -> None:
        self.queues = queues
        self.imbalance_tokens = imbalance_tokens
        self.max_blocks_per_node = max_blocks_per_node
        self.index: dict[str, OrderedDict[int, None]] = {}

    def pick(self, nodes: list[NodeState], token_ids: list[int]) -> tuple[NodeState, int] | None:
        """The node for a prompt and the number of its tokens that node likely has cached
        (`remember` it once the prompt was sent there)."""
        if not nodes:
            return None
        block_size = nodes[0].stats.identity.block_size or 16
        hashes = block_hashes(token_ids, block_size)
        queued = self.queues.tokens
        matches = {node.address: self._cached_blocks(node, hashes) for node in nodes}
        best = max(
            nodes,
            key=lambda n: (matches[n.address], -queued(n), -len(self.index.get(n.address, ()))),
        )
        least_loaded = min(nodes, key=queued)
        if queued(best) - queued(least_loaded) > self.imbalance_tokens:
            best = least_loaded
        return best, matches[best.address] * block_size

    def cached_tokens(self, node: NodeState, token_ids: list[int]) -> int:
        """How many leading tokens of the prompt `node` likely has cached."""
        block_size = node.stats.identity.block_size or 16
        return self._cached_blocks(node, block_hashes(token_ids, block_size)) * block_size

    def _cached_blocks(self, node: NodeState, hashes: list[int]) -> int:
        known = self.index.get(node.address, {})
        count = 0
        while count < len(hashes) and hashes[count] in known:
            count += 1
        return count

    def remember(self, node: NodeState, token_ids: list[int]) -> None:
        """The prompt was sent to `node`: its blocks are (soon) in that node's cache."""
        known = self.index.setdefault(node.address, OrderedDict())
        for value in block_hashes(token_ids, node.stats.identity.block_size or 16):
            known[value] = None
            known.move_to_end(value)
        while len(known) > self.max_blocks_per_node:
            known.popitem(last=False)

    def forget(self, node: NodeState) -> None:
        """The node went down or restarted: its cache is gone."""
        self.index.pop(node.address, None)
