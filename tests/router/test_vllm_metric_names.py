"""`--metrics-prefix vllm` (router/vllm_metric_names.py): /metrics under vLLM's exact names,
samples and labels renamed, metrics without a vLLM name kept; the docs' table is the mapping."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics
from pdserve.router.vllm_metric_names import VLLM_NAMES
from tests.node_stats import node_stats

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def samples(metrics: RouterMetrics) -> dict[str, list]:
    text = metrics.render().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def observed(prefix: str) -> dict[str, list]:
    metrics = RouterMetrics("m", prefix)
    metrics.observe_node("n0", node_stats())
    metrics.first_token(arrived_at=0.0, submitted_at=0.1, now=0.5)
    metrics.choice_finished("stop", 0.0, 0.1, 0.5, 3, now=1.0)
    return samples(metrics)


def test_vllm_names_replace_the_mapped_ones_and_keep_the_rest():
    ours, theirs = observed("pdserve"), observed("vllm")
    assert not any(name.startswith("vllm:") for name in ours)
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:time_per_output_token_seconds_sum", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:request_success_total"):
        assert name in theirs, sorted(theirs)
    assert "pdserve_time_to_first_token_seconds_bucket" not in theirs
    assert "pdserve_kv_transfer_bytes_total" in theirs  # no vLLM name: kept
    [success] = theirs["vllm:request_success_total"]
    assert success.labels["finished_reason"] == "stop" and "finish_reason" not in success.labels
    assert success.labels["model_name"] == "m"
    ttft = {s.labels["le"]: s.value for s in theirs["vllm:time_to_first_token_seconds_bucket"]}
    assert ttft == {s.labels["le"]: s.value
                    for s in ours["pdserve_time_to_first_token_seconds_bucket"]}


def test_the_docs_table_is_the_mapping():
    text = DOCS.read_text()
    table = text[text.index("| pdserve | vLLM (`--metrics-prefix vllm`) |"):]
    table = table[: table.index("\n\n")]

    def family(name: str) -> str:
        return re.sub(r"(_total)?(\{.*\})?$", "", name)

    documented = {}
    for row in table.splitlines()[2:]:
        ours, theirs = row.split(" | ")[:2]
        names = re.findall(r"`([^`]+)`", theirs)
        documented[family(re.findall(r"`([^`]+)`", ours)[0])] = tuple(map(family, names))
    assert documented == dict(VLLM_NAMES)
