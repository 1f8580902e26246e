"""Prometheus metrics (prefix `pdserve_`), kept in a per-app CollectorRegistry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.protocol import NodeStats

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
        self.num_preemptions = Gauge(
            "pdserve_num_preemptions_total",
            "Preemptions on the node so far",
            ["node"],
            registry=r,
        )
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
        self.num_preemptions.labels(name).set(stats.num_preemptions)

    def error(self, kind: str) -> None:
        self.request_errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
