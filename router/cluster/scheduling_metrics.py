"""Scheduling metrics the nodes keep (preemptions by cure, swapped bytes, queue wait by
priority), exposed from each node's latest NodeStats (its `scheduling` part)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily

from pdserve.wire.messages import NodeStats


class SchedulingCollector:
    def __init__(self, latest: Mapping[str, NodeStats]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[CounterMetricFamily]:
        preemptions = CounterMetricFamily(
            "pdserve_preemptions_by_mode",
            "Preemptions on the node, by cure (recompute or swap)",
            labels=["node", "mode"],
        )
        swapped = CounterMetricFamily(
            "pdserve_swapped_bytes",
            "KV bytes copied between device and host memory by swap preemption",
            labels=["node", "direction"],
        )
        wait_seconds = CounterMetricFamily(
            "pdserve_queue_wait_seconds",
            "Time requests waited on the node before their first step, summed, by priority",
            labels=["node", "priority"],
        )
        wait_requests = CounterMetricFamily(
            "pdserve_queue_wait_requests",
            "Requests counted in pdserve_queue_wait_seconds, by priority",
            labels=["node", "priority"],
        )
        for node, stats in self.latest.items():
            scheduling = stats.scheduling
            preemptions.add_metric([node, "recompute"], scheduling.num_recompute_preemptions)
            preemptions.add_metric([node, "swap"], scheduling.num_swap_preemptions)
            swapped.add_metric([node, "out"], scheduling.swap_out_bytes_total)
            swapped.add_metric([node, "in"], scheduling.swap_in_bytes_total)
            for priority, seconds in _numbers(scheduling.queue_wait_seconds_by_priority):
                wait_seconds.add_metric([node, priority], seconds)
            for priority, count in _numbers(scheduling.queue_wait_requests_by_priority):
                wait_requests.add_metric([node, priority], count)
        yield preemptions
        yield swapped
        yield wait_seconds
        yield wait_requests


def _numbers(values: Mapping[str, object]) -> Iterator[tuple[str, float]]:
    """The numeric entries of a node-reported map (anything else is ignored)."""
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)
