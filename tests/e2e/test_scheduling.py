"""Scheduling options end to end (real processes, tiny model, 1 prefill + 1 decode node): a
decode node short of KV swaps requests out and back in with the same text as an unloaded run,
priorities reach the nodes (queue wait by priority), and a bad priority is a 400."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.e2e.test_disaggregated import Server

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # tiny llama: layers x (k, v) x kv heads x head dim x fp32


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    running = Server(
        tiny_llama_dir, "--kv-cache-memory", str(20 * BLOCK_BYTES), "--preemption-mode", "swap",
        "--allow-client-priority",
    )
    try:
        yield running
    finally:
        running.close()


def bodies(count: int = 12) -> list[dict]:
    rng = random.Random(5)
    return [
        {
            "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(20, 50))],
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
            "priority": index % 3,
        }
        for index in range(count)
    ]


async def complete(http: httpx.AsyncClient, body: dict) -> str:
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_swapped_requests_finish_with_the_text_of_an_unloaded_run(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            alone = [await complete(http, body) for body in bodies()]
            together = await asyncio.gather(*(complete(http, body) for body in bodies()))
            return alone, together

    alone, together = asyncio.run(main())
    assert together == alone
    server.wait_all_blocks_free()
    swaps = {
        node: value
        for node, value in server.metric_by_node("pdserve_preemptions_by_mode_total").items()
    }
    assert swaps, "no preemption metric reported"
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'mode="swap"' in text and 'direction="out"' in text
    swapped_out = [
        line for line in text.splitlines()
        if line.startswith("pdserve_swapped_bytes_total") and 'direction="out"' in line
    ]
    assert any(float(line.rsplit(" ", 1)[1]) > 0 for line in swapped_out), swapped_out
    waits = [line for line in text.splitlines() if line.startswith("pdserve_queue_wait_requests")]
    assert {p for p in ("0", "1", "2") if any(f'priority="{p}"' in w for w in waits)} == {
        "0", "1", "2"
    }


@pytest.mark.parametrize("priority", [2**31, "high", 1.5])
def test_an_invalid_priority_is_a_400(server, priority):
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "priority": priority},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"
