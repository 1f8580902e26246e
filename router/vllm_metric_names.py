"""vLLM's names for the router's metrics (`--metrics-prefix vllm`): the series a vLLM dashboard
or alert queries, exposed under vLLM's exact names so it works unchanged.

`VLLM_NAMES` maps a pdserve metric family to vLLM's family (or families: vLLM renamed its
per-output-token histogram and dashboards query either name); docs/operations.md's table of
metric names is this mapping (tests/router/test_vllm_metric_names.py checks they agree).
Samples keep their suffix (`_total`, `_bucket`, ...) after the new family name, and the label
`finish_reason` is vLLM's `finished_reason`. A metric vLLM has no name for keeps its `pdserve_`
name. Per-node series keep their `node` label (vLLM has one engine per server: sum over it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.metrics_core import Metric

VLLM_NAMES: Mapping[str, tuple[str, ...]] = {
    "pdserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "pdserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "pdserve_time_per_output_token_seconds": (
        "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
    ),
    "pdserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pdserve_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "pdserve_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "pdserve_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "pdserve_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "pdserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "pdserve_request_generation_tokens": ("vllm:request_generation_tokens",),
    "pdserve_prompt_tokens": ("vllm:prompt_tokens",),
    "pdserve_generation_tokens": ("vllm:generation_tokens",),
    "pdserve_request_success": ("vllm:request_success",),
    "pdserve_num_requests_running": ("vllm:num_requests_running",),
    "pdserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "pdserve_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pdserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pdserve_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pdserve_num_preemptions": ("vllm:num_preemptions",),
}
VLLM_LABELS: Mapping[str, str] = {"finish_reason": "finished_reason"}


def renamed(family: Metric, name: str, labels: Mapping[str, str]) -> Metric:
    """`family` as `name`, each sample's suffix kept and its labels renamed by `labels`."""
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = [
        sample._replace(
            name=name + sample.name[len(family.name):],
            labels={labels.get(k, k): v for k, v in sample.labels.items()},
        )
        for sample in family.samples
    ]
    return out


def as_vllm(families: Iterator[Metric]) -> Iterator[Metric]:
    """The families under vLLM's names where it has them, under their own elsewhere."""
    for family in families:
        for name in VLLM_NAMES.get(family.name, (family.name,)):
            yield renamed(family, name, VLLM_LABELS)
