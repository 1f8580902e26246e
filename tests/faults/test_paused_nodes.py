"""Slow is not dead: every node process paused at once (SIGSTOP, as a throttled, swapped or
starved host pauses them) for four times what once declared a node dead, while streams are in
flight, real processes (`pdserve serve`, tiny model, 1 prefill + 1 decode, KV over shared
memory, prefill in 32-token chunks). Some requests have streamed tokens when the pause lands,
others still wait for their prefill. After SIGCONT every stream completes with the text of a
run without the pause, no request was retried, the router never marked a node down, and no
block leaked.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx

from pdserve.commands.serve_process import ServeProcess
from tests.fault_checks import (
    assert_no_leaked_blocks,
    completion_texts,
    live_nodes,
    metric,
    node_pids,
    start_streams,
    wait_until,
    wait_until_async,
)

PAUSE_S = 4.0  # the fault itself: four times the node timeout pdserve once had
FLAGS = [
    "--max-num-batched-tokens", "32", "--kv-cache-memory", str(32 << 20),
    "--dtype", "float32", "--prefill", "1", "--decode", "1",
    "--disagg-policy", "always",  # every prompt through the prefill node and a KV transfer
]


def bodies(model: str, count: int) -> list[dict]:
    rng = random.Random(7)
    return [
        {
            "model": model,
            "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(10, 90))],
            "max_tokens": rng.randrange(60, 120),
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(count)
    ]


async def streams_with_a_pause(url: str, requests: list[dict], pids: list[int]):
    """Streams the first half of `requests`, pauses `pids` once two of them have three tokens,
    sends the second half while they are paused and waits until the router has queued it, then
    resumes them after PAUSE_S in all. Returns the results, the number of streams with a token
    when the pause landed, and /metrics' `pdserve_node_up` during the pause."""
    streaming, arriving = requests[: len(requests) // 2], requests[len(requests) // 2:]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120)) as http:
        results, tasks = await start_streams(
            http, streaming, lambda results: sum(len(r.token_times) >= 3 for r in results) >= 2,
            "two streams with three tokens each",
        )
        started_when_paused = sum(r.first_token_at is not None for r in results)
        paused_at = asyncio.get_running_loop().time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            late_results, late_tasks = await start_streams(
                http, arriving, lambda results: True, "the second half's requests sent"
            )
            await wait_until_async(
                lambda: metric(url, "pdserve_router_queued_requests").get("", 0) >= len(arriving),
                60, "the router queuing the requests sent during the pause",
            )
            up_while_paused = metric(url, "pdserve_node_up")
            # the rest of the fault's length, not a wait for an event
            await asyncio.sleep(max(0.0, paused_at + PAUSE_S - asyncio.get_running_loop().time()))
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        await asyncio.gather(*tasks, *late_tasks)
    return results + late_results, started_when_paused, up_while_paused


def test_nodes_paused_for_seconds_finish_every_stream_with_the_same_text(tiny_llama_dir):
    server = ServeProcess(["--model", str(tiny_llama_dir), *FLAGS], ready_timeout_s=120)
    try:
        wait_until(lambda: len(live_nodes(server.url)) == 2, 60, "2 live nodes")
        nodes = {name: pid for name, pid in node_pids(server.process.pid).items()
                 if name != "router"}
        requests = bodies(tiny_llama_dir.name, 12)
        expected = completion_texts(server.url, requests)
        results, started_when_paused, up_while_paused = asyncio.run(
            streams_with_a_pause(server.url, requests, list(nodes.values()))
        )
        assert started_when_paused >= 2
        assert all(r.completed for r in results), [r.error for r in results if not r.completed]
        assert [r.text for r in results] == expected
        assert up_while_paused == dict.fromkeys(nodes, 1.0), up_while_paused
        assert metric(server.url, "pdserve_request_retries_total")[""] == 0
        assert_no_leaked_blocks(server.url)
    finally:
        server.close()
