"""A router app with no node process behind it: one configured node address that nothing
binds, so a test decides whether a node is live by injecting its NodeStats (`node_stats`)."""

from __future__ import annotations

from pathlib import Path

from pdserve.router.config import RouterConfig
from pdserve.wire.messages import NodeStats
from pdserve.wire.node_stats import KvCacheStats, NodeIdentity, SchedulingStats


def unlooped_router_config(model_path: Path, served_model_name: str, **settings) -> RouterConfig:
    return RouterConfig(
        model_path=model_path,
        served_model_name=served_model_name,
        node_addresses=["tcp://127.0.0.1:1"],
        listen_address="tcp://127.0.0.1:2",
        **settings,
    )


def node_stats(
    max_model_len: int = 64, vocab_size: int = 512, *, blocks: int = 10, block_size: int = 0
) -> NodeStats:
    """What a live colocated node reports, idle, with `blocks` free blocks (of `block_size`
    tokens; 0: not reported, so the router checks no KV capacity)."""
    return NodeStats(
        NodeIdentity("n0", "colocated", max_model_len, vocab_size, block_size=block_size),
        SchedulingStats(num_waiting=0, num_running=0, num_preemptions=0),
        KvCacheStats(num_free_blocks=blocks, num_total_blocks=blocks),
    )
