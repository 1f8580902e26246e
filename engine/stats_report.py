"""What the engine reports of itself in a node's NodeStats (wire/node_stats.py): its scheduling
(`scheduling_stats`) and its KV blocks (`kv_cache_stats`), read from the scheduler, the swap
space, the queue-wait and preemption bookkeeping, the block manager and the prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.wire.node_stats import KvCacheStats, SchedulingStats

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


def scheduling_stats(engine: LLMEngine) -> SchedulingStats:
    """Queues, preemptions by cure, swapped bytes, queue wait by priority, prompt tokens
    computed and the measured prefill speed (NodeStats' `scheduling`)."""
    scheduler = engine.scheduler
    by_mode = scheduler.num_preemptions_by_mode
    swap = engine.swap_space
    return SchedulingStats(
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        num_preemptions=scheduler.num_preemptions,
        num_swap_preemptions=by_mode["swap"],
        num_recompute_preemptions=by_mode["recompute"],
        swap_out_bytes_total=swap.bytes_out_total if swap else 0,
        swap_in_bytes_total=swap.bytes_in_total if swap else 0,
        prompt_tokens_computed_total=engine.num_prompt_tokens_computed,
        queue_wait_seconds_by_priority={
            str(p): s for p, s in engine.queue_wait.seconds_by_priority.items()
        },
        queue_wait_requests_by_priority={
            str(p): n for p, n in engine.queue_wait.count_by_priority.items()
        },
        prefill_tokens_per_s=engine.preemption.measured_prefill_tokens_per_s,
    )


def kv_cache_stats(engine: LLMEngine, num_leaked_blocks: int) -> KvCacheStats:
    """The KV blocks and the prefix cache's counters (NodeStats' `kv`), with the blocks the
    node's idle-time check found leaked (node/runtime.py)."""
    manager = engine.block_manager
    cache_stats = manager.prefix_cache.stats
    return KvCacheStats(
        num_free_blocks=manager.num_free_blocks,
        num_total_blocks=manager.num_blocks,
        num_cached_blocks=manager.num_cached_blocks,
        num_leaked_blocks=num_leaked_blocks,
        prefix_cache_queries_total=cache_stats.queries,
        prefix_cache_hits_total=cache_stats.hits,
        prefix_cache_evicted_blocks_total=cache_stats.evicted_blocks,
        block_copies_total=manager.num_copied_blocks,
    )
