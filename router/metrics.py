"""Prometheus metrics (prefix `pdserve_`), kept in a per-app CollectorRegistry.

Every series carries `model_name` (the served model name) and no `_created` series is exposed:
the metrics live in `registry` and are exposed through `ModelLabelled`, a collector of their
own (prometheus_client's `disable_created_metrics()` would change every registry of the
process). The request histograms follow vLLM's set (docs/operations.md maps the names), timed
as the router sees a request: arrival (its route entered), sent to the nodes (after reading,
validation, tokenization and admission), first token back, last token back, answer done:

    queue time       arrival -> sent         prefill time     sent -> first token
    time to first    arrival -> first token  decode time      first -> last token
    inference time   sent -> last token      e2e latency      arrival -> answer done
    inter-token latency: the gap before each token after the first, shared by the tokens of
    one update

The node's own waiting queue is inside the prefill time; the nodes measure it themselves
(`pdserve_queue_wait_seconds_total`, router/cluster/scheduling_metrics.py). Token, TTFT, prefill, decode,
inference and inter-token values are per choice; prompt and generation tokens per request,
queue time and e2e latency per request (only requests answered in full).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from pdserve.router.cluster.scheduling_metrics import SchedulingCollector
from pdserve.router.recent_latencies import RecentLatencies
from pdserve.router.vllm_metric_names import as_vllm
from pdserve.wire.messages import NodeStats

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
_LONG_LATENCY_BUCKETS = (*_LATENCY_BUCKETS, 300.0, 600.0, 1800.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_ITL_BUCKETS = (*_TPOT_BUCKETS, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)


# Each node counter: its name, its help, and where NodeStats keeps it.
_NODE_COUNTERS: tuple[tuple[str, str, Callable[[NodeStats], float]], ...] = (
    (
        "pdserve_num_preemptions",
        "Preemptions on the node so far",
        lambda stats: stats.scheduling.num_preemptions,
    ),
    (
        "pdserve_prefix_cache_queries",
        "Prompt tokens looked up in the node's prefix cache",
        lambda stats: stats.kv.prefix_cache_queries_total,
    ),
    (
        "pdserve_prefix_cache_hits",
        "Prompt tokens served from the node's prefix cache",
        lambda stats: stats.kv.prefix_cache_hits_total,
    ),
    (
        "pdserve_prefix_cache_evicted_blocks",
        "KV blocks evicted from the node's prefix cache",
        lambda stats: stats.kv.prefix_cache_evicted_blocks_total,
    ),
    (
        "pdserve_prompt_tokens_computed",
        "Prompt tokens the node computed (prefill; n choices of a prompt compute it once)",
        lambda stats: stats.scheduling.prompt_tokens_computed_total,
    ),
    (
        "pdserve_kv_block_copies",
        "KV blocks copied on write (choices forked from one prompt appending to a shared block)",
        lambda stats: stats.kv.block_copies_total,
    ),
    (
        "pdserve_kv_transfer_bytes",
        "KV bytes sent to decode nodes",
        lambda stats: stats.kv_transfer.bytes_total,
    ),
    (
        "pdserve_kv_transfer_seconds",
        "Time from a transfer's first write to its completion, summed",
        lambda stats: stats.kv_transfer.seconds_total,
    ),
    (
        "pdserve_kv_transfer_failures",
        "KV transfers that failed",
        lambda stats: stats.kv_transfer.failures_total,
    ),
    (
        "pdserve_preallocation_wait_seconds",
        "Time requests waited for a decode node to reserve their KV blocks, summed",
        lambda stats: stats.kv_transfer.preallocation_wait_seconds_total,
    ),
)


class NodeTotalsCollector:
    """Counters and gauges the nodes keep themselves, exposed from their latest NodeStats."""

    def __init__(self) -> None:
        self.latest: dict[str, NodeStats] = {}
        self.up: dict[str, tuple[str, bool]] = {}  # node -> (role, alive)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, documentation, value in _NODE_COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["node"])
            for node, stats in self.latest.items():
                family.add_metric([node], value(stats))
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
            kv = stats.kv
            leaked.add_metric([node], kv.num_leaked_blocks)
            cached.add_metric([node], kv.num_cached_blocks)
            queries = kv.prefix_cache_queries_total
            hit_ratio.add_metric([node], kv.prefix_cache_hits_total / queries if queries else 0.0)
            role = stats.identity.role
            by_role[role] = by_role.get(role, 0) + stats.scheduling.num_waiting
        for role, count in by_role.items():
            waiting.add_metric([role], count)
        yield cached
        yield hit_ratio
        yield waiting
        yield leaked
        yield up


class ModelLabelled:
    """The metrics of `source` with `model_name` added to every sample, without the
    `_created` samples of counters and histograms; under vLLM's names where it has them with
    `vllm_names` (router/vllm_metric_names.py)."""

    def __init__(self, source: CollectorRegistry, model_name: str, vllm_names: bool = False):
        self.source = source
        self.model_name = model_name
        self.vllm_names = vllm_names

    def collect(self) -> Iterator[Metric]:
        families = self._labelled()
        return as_vllm(families) if self.vllm_names else families

    def _labelled(self) -> Iterator[Metric]:
        for family in self.source.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            created = f"{family.name}_created"
            labelled.samples = [
                sample._replace(labels={**sample.labels, "model_name": self.model_name})
                for sample in family.samples
                if sample.name != created
            ]
            yield labelled


def _histogram(
    registry: CollectorRegistry, name: str, documentation: str, buckets: tuple[float, ...]
) -> Histogram:
    return Histogram(name, documentation, buckets=buckets, registry=registry)


class RouterMetrics:
    """All of the router's metrics; `render()` gives the Prometheus text exposition. Other
    parts of the router register theirs in `registry` (router/cluster/admission.py)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, metrics_prefix: str = "pdserve") -> None:
        self.registry = CollectorRegistry()
        self.exposed = CollectorRegistry(auto_describe=False)
        self.exposed.register(
            ModelLabelled(self.registry, model_name, vllm_names=metrics_prefix == "vllm")
        )
        r = self.registry
        self.recent = RecentLatencies()  # the SLO planner's window (GET /admin/nodes)
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
        self.planner_role_changes = Counter(
            "pdserve_planner_role_changes",
            "Nodes the launcher's run-time planner turned to another role, by the roles and "
            "the reason",
            ["from", "to", "reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "pdserve_request_errors",
            "Requests answered with an error, by kind",
            ["kind"],
            registry=r,
        )
        self.time_to_first_token = _histogram(
            r,
            "pdserve_time_to_first_token_seconds",
            "From the request's arrival at the router to a choice's first token",
            _LATENCY_BUCKETS,
        )
        self.time_per_output_token = _histogram(
            r,
            "pdserve_time_per_output_token_seconds",
            "Mean time between output tokens, per choice",
            _TPOT_BUCKETS,
        )
        self.inter_token_latency = _histogram(
            r,
            "pdserve_inter_token_latency_seconds",
            "Time between two output tokens of a choice, per token",
            _ITL_BUCKETS,
        )
        self.e2e_request_latency = _histogram(
            r,
            "pdserve_e2e_request_latency_seconds",
            "From the request's arrival at the router to its answer done",
            _LONG_LATENCY_BUCKETS,
        )
        self.request_queue_time = _histogram(
            r,
            "pdserve_request_queue_time_seconds",
            "From the request's arrival at the router to its sending to the nodes (read, "
            "validated, tokenized, admitted)",
            _LATENCY_BUCKETS,
        )
        self.request_prefill_time = _histogram(
            r,
            "pdserve_request_prefill_time_seconds",
            "From a choice's sending to the nodes to its first token (node queue and prefill)",
            _LATENCY_BUCKETS,
        )
        self.request_decode_time = _histogram(
            r,
            "pdserve_request_decode_time_seconds",
            "From a choice's first token to its last",
            _LONG_LATENCY_BUCKETS,
        )
        self.request_inference_time = _histogram(
            r,
            "pdserve_request_inference_time_seconds",
            "From a choice's sending to the nodes to its last token",
            _LONG_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = _histogram(
            r, "pdserve_request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = _histogram(
            r,
            "pdserve_request_generation_tokens",
            "Generated tokens per request (all choices)",
            _TOKEN_BUCKETS,
        )

    def first_token(self, arrived_at: float, submitted_at: float, now: float) -> None:
        self.time_to_first_token.observe(now - arrived_at)
        self.request_prefill_time.observe(now - submitted_at)

    def later_tokens(self, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` tokens after a choice's first, arrived `gap_s` after its previous."""
        for _ in range(num_tokens):
            self.inter_token_latency.observe(gap_s / num_tokens)

    def choice_finished(
        self,
        reason: str,
        arrived_at: float,
        submitted_at: float,
        first_token_at: float | None,
        num_tokens: int,
        now: float,
    ) -> None:
        self.request_success.labels(reason).inc()
        if first_token_at is None:
            return
        self.recent.record(arrived_at, first_token_at, num_tokens, now)
        self.request_decode_time.observe(now - first_token_at)
        self.request_inference_time.observe(now - submitted_at)
        if num_tokens > 1:
            self.time_per_output_token.observe((now - first_token_at) / (num_tokens - 1))

    def request_finished(
        self,
        arrived_at: float,
        submitted_at: float,
        prompt_tokens: int,
        generation_tokens: int,
        now: float,
    ) -> None:
        """A request answered in full."""
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_queue_time.observe(submitted_at - arrived_at)
        self.e2e_request_latency.observe(now - arrived_at)

    def observe_node(self, name: str, stats: NodeStats) -> None:
        self.num_requests_waiting.labels(name).set(stats.scheduling.num_waiting)
        self.num_requests_running.labels(name).set(stats.scheduling.num_running)
        total = stats.kv.num_total_blocks
        used = (total - stats.kv.num_free_blocks) / total if total > 0 else 0.0
        self.kv_cache_usage_ratio.labels(name).set(used)
        self.node_totals.latest[name] = stats

    def observe_liveness(self, name: str, role: str, alive: bool) -> None:
        self.node_totals.up[name] = (role, alive)

    def forget_node(self, name: str) -> None:
        """A node retired for good (router/cluster/node_drain.py): its series go."""
        self.node_totals.latest.pop(name, None)
        self.node_totals.up.pop(name, None)
        for gauge in (
            self.num_requests_waiting, self.num_requests_running, self.kv_cache_usage_ratio
        ):
            try:
                gauge.remove(name)
            except KeyError:
                pass

    def role_change(self, from_role: str, to_role: str, reason: str) -> None:
        """The launcher's planner turned a node from one role to another (router/api/admin.py)."""
        self.planner_role_changes.labels(from_role, to_role, reason).inc()

    def error(self, kind: str) -> None:
        self.request_errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.exposed)
