"""Prometheus metrics (prefix `pdserve_`), kept in a per-app CollectorRegistry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.scheduling_metrics import SchedulingCollector
from wire.messages import NodeStats

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    60.0,
    120.0,
)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


_NODE_COUNTERS = (
    ("pdserve_num_preemptions", "Preemptions on the node so far", "num_preemptions"),
    (
        "pdserve_prefix_cache_queries",
        "Prompt tokens looked up in the node's prefix cache",
        "prefix_cache_queries_total",
    ),
    (
        "pdserve_prefix_cache_hits",
        "Prompt tokens served from the node's prefix cache",
        "prefix_cache_hits_total",
    ),
    (
        "pdserve_prefix_cache_evicted_blocks",
        "KV blocks evicted from the node's prefix cache",
        "prefix_cache_evicted_blocks_total",
    ),
    (
        "pdserve_prompt_tokens_computed",
        "Prompt tokens the node computed (prefill; n choices of a prompt compute it once)",
        "prompt_tokens_computed_total",
    ),
    (
        "pdserve_kv_block_copies",
        "KV blocks copied on write (choices forked from one prompt appending to a shared block)",
        "kv_block_copies_total",
    ),
    ("pdserve_kv_transfer_bytes", "KV bytes sent to decode nodes", "kv_transfer_bytes_total"),
    (
        "pdserve_kv_transfer_seconds",
        "Time from a transfer's first write to its completion, summed",
        "kv_transfer_seconds_total",
    ),
    ("pdserve_kv_transfer_failures", "KV transfers that failed", "kv_transfer_failures_total"),
    (
        "pdserve_preallocation_wait_seconds",
        "Time requests waited for a decode node to reserve their KV blocks, summed",
        "preallocation_wait_seconds_total",
    ),
)


class NodeTotalsCollector:
    """Counters and gauges the nodes keep themselves, exposed from their latest NodeStats."""

    def __init__(self) -> None:
        self.latest: dict[str, NodeStats] = {}
        self.up: dict[str, tuple[str, bool]] = {}  # node -> (role, alive)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, documentation, field in _NODE_COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["node"])
            for node, stats in self.latest.items():
                family.add_metric([node], getattr(stats, field))
            yield family
        cached = GaugeMetricFamily(
            "pdserve_prefix_cache_blocks",
            "KV blocks kept by the node's prefix cache and not in use",
            labels=["node"],
        )
        hit_ratio = GaugeMetricFamily(
            "pdserve_prefix_cache_hit_ratio",
            "Prompt tokens served from the node's prefix cache / prompt tokens looked up",
            labels=["node"],
        )
        waiting = GaugeMetricFamily(
            "pdserve_queue_length", "Requests waiting, by node role", labels=["role"]
        )
        leaked = GaugeMetricFamily(
            "pdserve_kv_leaked_blocks",
            "KV blocks in use on an idle node with nothing holding them (must stay 0)",
            labels=["node"],
        )
        up = GaugeMetricFamily(
            "pdserve_node_up", "1 while the node's heartbeats arrive in time", labels=["node", "role"]
        )
        for node, (role, alive) in self.up.items():
            up.add_metric([node, role], 1.0 if alive else 0.0)
        by_role: dict[str, int] = {}
        for node, stats in self.latest.items():
            leaked.add_metric([node], stats.num_leaked_blocks)
            cached.add_metric([node], stats.num_cached_blocks)
            queries = stats.prefix_cache_queries_total
            hit_ratio.add_metric(
                [node], stats.prefix_cache_hits_total / queries if queries else 0.0
            )
            by_role[stats.role] = by_role.get(stats.role, 0) + stats.num_waiting
        for role, count in by_role.items():
            waiting.add_metric([role], count)
        yield cached
        yield hit_ratio
        yield waiting
        yield leaked
        yield up


class RouterMetrics:
    """All of the router's metrics; `render()` gives the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_requests_waiting = Gauge(
            "pdserve_num_requests_waiting", "Requests waiting on the node", ["node"], registry=r
        )
        self.num_requests_running = Gauge(
            "pdserve_num_requests_running", "Requests running on the node", ["node"], registry=r
        )
        self.kv_cache_usage_ratio = Gauge(
            "pdserve_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use",
            ["node"],
            registry=r,
        )
        self.node_totals = NodeTotalsCollector()
        r.register(self.node_totals)
        r.register(SchedulingCollector(self.node_totals.latest))
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", registry=r
        )
        self.request_success = Counter(
            "pdserve_request_success",
            "Choices finished, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.request_retries = Counter(
            "pdserve_request_retries",
            "Requests sent again after a node failed them before their first token",
            registry=r,
        )
        self.request_errors = Counter(
            "pdserve_request_errors",
            "Requests answered with an error, by kind",
            ["kind"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Mean time between output tokens",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request latency, end to end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def observe_node(self, name: str, stats: NodeStats) -> None:
        self.num_requests_waiting.labels(name).set(stats.num_waiting)
        self.num_requests_running.labels(name).set(stats.num_running)
        total = stats.num_total_blocks
        used = (total - stats.num_free_blocks) / total if total > 0 else 0.0
        self.kv_cache_usage_ratio.labels(name).set(used)
        self.node_totals.latest[name] = stats

    def observe_liveness(self, name: str, role: str, alive: bool) -> None:
        self.node_totals.up[name] = (role, alive)

    def error(self, kind: str) -> None:
        self.request_errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
