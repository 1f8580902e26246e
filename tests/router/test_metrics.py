"""/metrics after one completed request and one error, against the in-process app and a scripted
node (tests/router/test_streaming.py): the model_name label on every series, no `_created`
series, vLLM's request histograms observed, and every metric the Grafana dashboard queries."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics
from pdserve.wire.messages import encode
from tests.node_stats import node_stats
from tests.router.test_streaming import MODEL, run_with_node

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdserve.json"


@pytest.fixture(scope="module")
def scrape(tmp_path_factory, tokenizer) -> dict:
    """One completion of 3 tokens, one 404, and NodeStats with queue waits; then /metrics."""

    async def scenario(http, node):
        body = {"model": MODEL, "prompt": "a", "max_tokens": 3}
        answer = (await http.post("/v1/completions", json=body)).json()
        await http.post("/v1/completions", json={**body, "model": "other"})
        stats = node_stats(
            max_model_len=256,
            queue_wait_seconds_by_priority={"0": 0.5},
            queue_wait_requests_by_priority={"0": 1},
        )
        await node.push.send(encode(stats))
        for _ in range(200):
            text = (await http.get("/metrics")).text
            if "pdserve_queue_wait_requests_total{" in text and "pdserve_node_up{" in text:
                break
            await asyncio.sleep(0.01)
        return answer, text

    answer, text = run_with_node(tmp_path_factory.mktemp("metrics"), tokenizer, scenario)
    samples = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]
    return {"answer": answer, "text": text, "samples": samples}


def value(scrape: dict, name: str) -> float:
    return sum(s.value for s in scrape["samples"] if s.name == name)


def test_every_series_carries_the_served_model_name(scrape):
    pdserve = [s for s in scrape["samples"] if s.name.startswith("pdserve_")]
    assert len(pdserve) > 100
    assert all(s.labels.get("model_name") == MODEL for s in pdserve), [
        s.name for s in pdserve if s.labels.get("model_name") != MODEL
    ]


def test_no_created_series_are_exposed(scrape):
    assert "_created" not in scrape["text"]


def test_vllm_request_histograms_are_observed_after_a_request(scrape):
    generated = scrape["answer"]["usage"]["completion_tokens"]
    assert generated == 3
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert value(scrape, f"pdserve_{name}_count") == 1, name
    assert value(scrape, "pdserve_inter_token_latency_seconds_count") == generated - 1
    assert value(scrape, "pdserve_request_generation_tokens_sum") == generated
    assert value(scrape, "pdserve_request_prompt_tokens_sum") == scrape["answer"]["usage"][
        "prompt_tokens"
    ]
    ttft = value(scrape, "pdserve_time_to_first_token_seconds_sum")
    queue = value(scrape, "pdserve_request_queue_time_seconds_sum")
    prefill = value(scrape, "pdserve_request_prefill_time_seconds_sum")
    assert ttft == pytest.approx(queue + prefill, abs=1e-6)
    assert value(scrape, "pdserve_e2e_request_latency_seconds_sum") >= ttft


def test_two_apps_in_one_process_keep_their_own_model_name():
    first, second = RouterMetrics("a"), RouterMetrics("b")
    first.request_retries.inc()
    assert b'pdserve_request_retries_total{model_name="a"} 1.0' in first.render()
    assert b'pdserve_request_retries_total{model_name="b"} 0.0' in second.render()


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    assert exprs, "the dashboard has no queries"
    return {name for expr in exprs for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}


def test_every_metric_the_dashboard_queries_is_exposed(scrape):
    exposed = {s.name for s in scrape["samples"]}
    names = dashboard_metric_names()
    assert len(names) >= 10
    assert names <= exposed, sorted(names - exposed)


def test_dashboard_covers_the_operator_panels():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in (
        "throughput", "time to first token", "inter-token", "end to end", "running",
        "kv cache", "prefix cache", "preemptions", "errors", "queue time",
    ):
        assert topic in titles, topic


def test_node_stats_without_queue_waits_still_expose_their_series():
    metrics = RouterMetrics(MODEL)
    metrics.observe_node("n0", node_stats(max_model_len=256))
    assert b'pdserve_num_requests_running{model_name="tiny",node="n0"} 0.0' in metrics.render()
