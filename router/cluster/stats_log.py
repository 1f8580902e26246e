"""The periodic stats line, one per node, like vLLM's: every `interval_s` (by default
STATS_LOG_INTERVAL_S, 10 s, vLLM's interval), for each node that had traffic since its previous
line (its token counters moved, or it has requests running or waiting), at INFO (logger `pdserve.router.cluster.stats_log`):

    node n0 (colocated): Avg prompt throughput: 812.4 tokens/s, Avg generation throughput:
    95.1 tokens/s, Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit
    rate: 40.0%

It lives in the router, not in the node loop: the router already receives every node's NodeStats
(router/cluster/node_registry.py), of every role and host, so one log shows the whole deployment in one
clock, and the nodes' step loops keep no timer for it. The cost: a node's counters are as of its
latest NodeStats (sent between steps and at every heartbeat, 0.5 s), so a rate is exact to
about that over the interval. Prompt throughput counts the prompt tokens the node computed
(prefix-cache hits excluded); the hit rate is the interval's hits / lookups (prompt tokens).
The lines are driven by the NodeStats arriving (`observe`), so no task runs for them; a node
that goes down is forgotten (`forget`) and starts afresh when it comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.wire.messages import NodeStats

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0


@dataclass
class _Counters:
    """A node's counters as of its previous line."""

    prompt_tokens: int
    generation_tokens: int
    cache_queries: int
    cache_hits: int

    @classmethod
    def of(cls, stats: NodeStats) -> _Counters:
        return cls(
            stats.scheduling.prompt_tokens_computed_total,
            stats.tokens.generation_total,
            stats.kv.prefix_cache_queries_total,
            stats.kv.prefix_cache_hits_total,
        )

    def since(self, previous: _Counters) -> _Counters:
        """The increase from `previous`; a counter that went back (a restarted node) counts
        from 0."""
        fields = ("prompt_tokens", "generation_tokens", "cache_queries", "cache_hits")
        now, then = [getattr(self, f) for f in fields], [getattr(previous, f) for f in fields]
        return _Counters(*(a - b if a >= b else a for a, b in zip(now, then)))


class StatsLog:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.latest: dict[str, NodeStats] = {}
        self._counters: dict[str, _Counters] = {}  # as of the previous line
        self._line_at: float | None = None  # when the previous lines were written

    def observe(self, node: str, stats: NodeStats) -> list[dict[str, Any]]:
        """Records a node's NodeStats; when the interval is over, writes the line of every
        node with traffic and returns their fields."""
        now = self.clock()
        if self._line_at is None:
            self._line_at = now
        self.latest[node] = stats
        self._counters.setdefault(node, _Counters.of(stats))
        elapsed_s = now - self._line_at
        if elapsed_s < self.interval_s:
            return []
        self._line_at = now
        written = []
        for name, latest in self.latest.items():
            counters = _Counters.of(latest)
            fields = _line_fields(name, latest, counters.since(self._counters[name]), elapsed_s)
            self._counters[name] = counters
            if fields is not None:
                logger.info("%s", _line(fields), extra={"fields": fields})
                written.append(fields)
        return written

    def forget(self, node: str) -> None:
        self.latest.pop(node, None)
        self._counters.pop(node, None)


def _line_fields(
    node: str, stats: NodeStats, increase: _Counters, elapsed_s: float
) -> dict[str, Any] | None:
    """The line's fields; None for a node that had no traffic."""
    moved = increase.prompt_tokens or increase.generation_tokens or increase.cache_queries
    scheduling, kv = stats.scheduling, stats.kv
    if not (moved or scheduling.num_running or scheduling.num_waiting):
        return None
    total = kv.num_total_blocks
    return {
        "node": node,
        "role": stats.identity.role,
        "prompt_tokens_per_s": round(increase.prompt_tokens / elapsed_s, 1),
        "generation_tokens_per_s": round(increase.generation_tokens / elapsed_s, 1),
        "running": scheduling.num_running,
        "waiting": scheduling.num_waiting,
        "kv_cache_usage": (total - kv.num_free_blocks) / total if total > 0 else 0.0,
        "prefix_cache_hit_rate": (
            increase.cache_hits / increase.cache_queries if increase.cache_queries else 0.0
        ),
    }


def _line(f: dict[str, Any]) -> str:
    return (
        f"node {f['node']} ({f['role']}): "
        f"Avg prompt throughput: {f['prompt_tokens_per_s']:.1f} tokens/s, "
        f"Avg generation throughput: {f['generation_tokens_per_s']:.1f} tokens/s, "
        f"Running: {f['running']} reqs, Waiting: {f['waiting']} reqs, "
        f"KV cache usage: {100 * f['kv_cache_usage']:.1f}%, "
        f"Prefix cache hit rate: {100 * f['prefix_cache_hit_rate']:.1f}%"
    )
