"""The run-time planner under streaming load (real processes, tiny model, 1 prefill + 2 decode),
with each policy.

Thresholds forced (for `load`, any queued prompt is "prefill pressure" and any decode KV usage
"low"; for `slo`, every request misses the TTFT target and meets the ITL one): the planner turns
the least busy decode node into a prefill node while streams run. The node it drains may hold
streams or none at that moment (prefill pressure can come before the first prompt reaches a decode
node); a drain that waits for streams in flight is tested in tests/faults/test_drain.py and
tests/router/test_node_drain.py. Every request completes, the change is counted on the router and
logged by the launcher, the deployment serves as 2 prefill + 1 decode afterwards, and no node holds
a KV block once the load ends.
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.commands.serve_process import ServeProcess
from tests.fault_checks import (
    StreamResult,
    assert_no_leaked_blocks,
    metric,
    stream_completion,
    wait_until,
    wait_until_async,
)

CONCURRENCY = 8
AFTER_CHANGE = 6  # requests that must complete after the change, on the new layout
PLANNER = [
    "--planner-interval", "0.2", "--planner-sustain", "0", "--planner-min-dwell", "0",
    "--planner-drain-timeout", "120",
]
# Each policy, forced so that it asks for decode -> prefill as soon as it has signals, with the
# reason and the start of the signals its log line names.
POLICIES = {
    "load": (
        # any queued prompt is pressure, any decode KV usage is low; the reverse can never hold
        ["--planner", "load", "--planner-prefill-delay-high", "0.001",
         "--planner-prefill-delay-low", "0", "--planner-kv-usage-low", "0.99",
         "--planner-kv-usage-high", "1", "--planner-decode-waiting-high", "1000000"],
        "prefill_queue; prefill queue delay",
    ),
    "slo": (
        # no request meets the TTFT target, every one meets the ITL target with slack to spare
        ["--planner", "slo", "--planner-slo", "ttft=0.001,itl=3600",
         "--planner-slo-min-requests", "4"],
        "ttft_slo; TTFT attainment 0.00",
    ),
}


def roles(url: str) -> dict[str, str]:
    """Live node -> its role, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.labels["node"]: sample.labels["role"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdserve_node_up" and sample.value == 1.0
    }


def body(rng: random.Random, model: str) -> dict:
    return {
        "model": model,
        "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(100, 300))],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }


async def stream_until_changed(url: str, model: str) -> tuple[list[StreamResult], int]:
    """CONCURRENCY clients, each sending one streaming request after another, until the
    planner's change was counted and AFTER_CHANGE more requests completed. Returns every
    result and how many were sent before the change was seen."""
    rng = random.Random(11)
    results: list[StreamResult] = []
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            result = StreamResult()
            results.append(result)
            await stream_completion(http, body(rng, model), result)

    def changed() -> bool:
        return sum(metric(url, "pdserve_planner_role_changes_total", "to").values()) >= 1

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120)) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(CONCURRENCY)]
        await wait_until_async(changed, 180, "the planner's role change")
        seen_at = len(results)
        await wait_until_async(
            lambda: sum(r.ended_at > 0 for r in results[seen_at:]) >= AFTER_CHANGE,
            120, f"{AFTER_CHANGE} requests completing after the change",
        )
        stop.set()
        await asyncio.gather(*tasks)
    return results, seen_at


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_planner_turns_a_decode_node_into_a_prefill_node_under_load_losing_nothing(
    policy, tiny_llama_dir, tmp_path
):
    policy_flags, reason = POLICIES[policy]
    log_path = tmp_path / "serve.log"
    flags = [
        "--model", str(tiny_llama_dir), "--prefill", "1", "--decode", "2",
        "--disagg-policy", "always", "--kv-cache-memory", str(32 << 20), "--verbose", *PLANNER,
        *policy_flags,
    ]
    server = ServeProcess(flags, log_path=log_path)
    try:
        wait_until(lambda: len(roles(server.url)) == 3, 120, "3 live nodes")
        results, seen_at = asyncio.run(stream_until_changed(server.url, tiny_llama_dir.name))
        failed = [r for r in results if not (r.completed and r.done)]
        assert not failed, failed[:3]
        assert {r.finish_reason for r in results} == {"length"}
        assert len(results) > seen_at + AFTER_CHANGE
        changes = metric(server.url, "pdserve_planner_role_changes_total", "from")
        assert changes == {"decode": 1.0}
        assert sorted(roles(server.url).values()) == ["decode", "prefill", "prefill"]
        said = log_path.read_text()
        drained = re.search(
            r"node (decode-\d\.\d+) \(decode\): draining, (\d+) requests held", said
        )
        assert drained is not None, said[-3000:]
        changed = re.search(
            rf"planner: changed node {re.escape(drained[1])}: decode -> prefill \(reason "
            rf"{re.escape(reason)}.*\); now node (prefill-\d\.\d+), serving after",
            said,
        )
        assert changed is not None, said[-3000:]
        assert changed[1] in roles(server.url)
        assert drained[1] not in metric(server.url, "pdserve_node_up")  # forgotten
        assert_no_leaked_blocks(server.url)
    finally:
        server.close()
