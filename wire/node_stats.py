"""The parts of a node's NodeStats (wire/messages.py), one per producer, so each value has one
owner and one spelling on the wire and in the router (`stats.kv.num_free_blocks`):

  NodeIdentity      the node runtime: who the node is and the shape of what it serves (its
                    model fingerprint is set by the roles that move KV; empty: none)
  SchedulingStats   the engine (`LLMEngine.scheduling_stats`): its queues, preemptions by cure,
                    swapped bytes, queue waits by priority, prompt tokens computed and the
                    measured prefill speed; a decode node counts the prompts it holds before
                    the engine as waiting too
  KvCacheStats      the engine's block manager and prefix cache (`LLMEngine.kv_cache_stats`),
                    with the leaked blocks of the node's idle-time check
  TokenTotals       the requests a node generates for (node/generation.py): prompt tokens
                    admitted, tokens generated; zero on a prefill node
  KvTransferTotals  the KV transfers of a prefill or decode node; zero on a colocated node

Each part travels as a nested msgpack map, decoded and checked field by field like any message
(wire/messages.py: `build_message`). Counters (`*_total`) only grow within one node process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeIdentity:
    """Who the node is (`instance_id` changes when its process restarts) and the shape of what
    it serves; the router pairs prefill and decode nodes by fingerprint, dtype, block size and
    tensor parallel size (router/cluster/node_registry.py)."""

    node_id: str
    role: str
    max_model_len: int
    vocab_size: int
    instance_id: str = ""
    listen_address: str = ""  # where the router reaches it; registers a node it did not know
    model_fingerprint: str = ""  # the KV layout's (kvtransfer/fingerprint.py); "": not checked
    dtype: str = ""
    block_size: int = 0  # 0: not reported (the router checks no KV capacity)
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class SchedulingStats:
    """The engine's scheduler: requests waiting and running, preemptions (all, and by cure),
    KV bytes swapped out and in, queue waits by priority (summed seconds and the requests
    counted, keyed by the priority as a string), prompt tokens computed (prefix-cache hits
    excluded; n choices of a prompt compute it once) and the measured prefill speed."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    swap_out_bytes_total: int = 0
    swap_in_bytes_total: int = 0
    prompt_tokens_computed_total: int = 0
    queue_wait_seconds_by_priority: dict[str, float] = field(default_factory=dict)
    queue_wait_requests_by_priority: dict[str, int] = field(default_factory=dict)
    prefill_tokens_per_s: float = 0.0  # measured; 0.0: not yet


@dataclass(frozen=True)
class KvCacheStats:
    """The KV blocks: free (including those only the prefix cache keeps) of the total, kept by
    the prefix cache, leaked (in use on an idle node; must stay 0), the prefix cache's lookups,
    hits (both in prompt tokens) and evicted blocks, and blocks copied on write."""

    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int = 0
    num_leaked_blocks: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_evicted_blocks_total: int = 0
    block_copies_total: int = 0


@dataclass(frozen=True)
class TokenTotals:
    """Prompt tokens of the requests the node admitted and tokens it generated."""

    prompt_total: int = 0
    generation_total: int = 0


@dataclass(frozen=True)
class KvTransferTotals:
    """KV transfers: bytes sent and the time from each transfer's first write to its completion
    (prefill node), failures (either side), and the time requests waited for a decode node to
    reserve their blocks (decode node)."""

    bytes_total: int = 0
    seconds_total: float = 0.0
    failures_total: int = 0
    preallocation_wait_seconds_total: float = 0.0


NODE_STATS_PARTS: tuple[type, ...] = (
    NodeIdentity,
    SchedulingStats,
    KvCacheStats,
    TokenTotals,
    KvTransferTotals,
)
