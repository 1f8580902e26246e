"""Tensor parallelism: one engine's model and KV cache split across ranks, one process each.

Rank 0 is the engine's own process: scheduler, block manager, sampler, and its shard. Ranks
1..N-1 are worker processes that run their shards of each step rank 0 sends them
(rank_workers.py, worker.py, messages.py). Each rank holds the same block ids of a KV cache
of its own KV heads; which heads and weight rows each rank holds is in layout.py, the
collectives in group.py, the sharded layers in engine/layers/parallel.py.
"""
