"""Overload and impossible requests against real processes (1 prefill + 1 decode node with small
KV caches, a router with a bounded queue).

- 1,000 concurrent streaming requests: those past the router's queue bound get 429 at once
  with an OpenAI error body; every admitted one finishes with the fault-free greedy text; no
  process dies and every KV block returns.
- A request that fits the context length but not the decode node's whole KV cache (or whose
  prompt does not fit the prefill node's) gets an immediate 400 that says so, while the
  requests queued for KV blocks around it keep flowing.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.__main__ import parse_args
from pdserve.router.cluster.admission import AdmissionQueue
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from tests.fault_cluster import Cluster, completion, greedy_texts, http

MAX_QUEUED = 32
DECODE_BLOCKS = 48  # 768 tokens
PREFILL_BLOCKS = 32  # 512 tokens


def prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 500) for _ in range(length))


SHORT = tuple((prompt(4 + 2 * i, i), 4) for i in range(5))
QUEUED = tuple((prompt(200, 10 + i), 100) for i in range(8))


@pytest.fixture(scope="module")
def reference(tiny_llm) -> dict[tuple[int, ...], str]:
    return greedy_texts(tiny_llm, SHORT + QUEUED)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cluster = Cluster(
        tiny_llama_dir,
        tmp_path_factory.mktemp("overload"),
        prefill_flags=("--num-kv-blocks", str(PREFILL_BLOCKS)),
        decode_flags=("--num-kv-blocks", str(DECODE_BLOCKS)),
        router_flags=("--max-queued-requests", str(MAX_QUEUED)),
    )
    yield cluster
    cluster.close()


def test_the_admission_queue_bounds_requests_and_prompt_tokens():
    queue = AdmissionQueue(RouterConfig("m", max_queued_requests=3, max_queued_tokens=100))
    queue.admit(2, 30)
    with pytest.raises(APIError, match="2 requests are queued") as refused:
        queue.admit(2, 10)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    queue.admit(1, 40)  # 100 tokens: at the bound, not past it
    with pytest.raises(APIError, match="3 requests are queued"):
        queue.check_room()
    for tokens in (30, 30, 40):
        queue.leave(tokens)
    assert (queue.num_requests, queue.num_tokens) == (0, 0)
    queue.check_room()
    queue.admit(1, 500)  # larger than the token bound: admitted into an empty queue only
    with pytest.raises(APIError, match="500 prompt tokens are queued"):
        queue.admit(1, 1)
    with pytest.raises(ValueError, match="max_queued_tokens is 0"):
        RouterConfig("m", max_queued_tokens=0)
    old_flag = ["--model", "m", "--node", "tcp://127.0.0.1:1", "--listen", "tcp://127.0.0.1:2"]
    assert parse_args([*old_flag, "--max-waiting-requests", "7"])[0].max_queued_requests == 7


async def queued_requests(cluster: Cluster) -> float:
    """The router's gauge of requests admitted and not started yet, read without blocking."""
    text = (await http(cluster.port, "/metrics")).body.decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdserve_router_queued_requests"
    )


def assert_openai_error(reply, status: int, kind: str) -> dict:
    assert reply.status == status, reply
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind
    return error


def test_a_thousand_concurrent_streams_get_a_quick_429_or_the_right_text(cluster, reference):
    async def run():
        return await asyncio.gather(
            *(
                http(cluster.port, "/v1/completions", completion(*SHORT[i % len(SHORT)], True))
                for i in range(1000)
            ),
            return_exceptions=True,
        )

    replies = asyncio.run(run())
    errors = [r for r in replies if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    refused = [r for r in replies if r.status == 429]
    admitted = [(i, r) for i, r in enumerate(replies) if r.status != 429]
    assert refused and len(admitted) >= MAX_QUEUED, (len(refused), len(admitted))
    for reply in refused:
        error = assert_openai_error(reply, 429, "rate_limit_error")
        assert "overloaded" in error["message"] and reply.headers["retry-after"] == "1"
    for i, reply in admitted:
        assert reply.status == 200 and reply.error is None, reply
        assert reply.text() == reference[tuple(SHORT[i % len(SHORT)][0])]
    latencies = sorted(r.elapsed_s for r in refused)
    print(
        f"{len(admitted)} admitted, {len(refused)} refused; 429 latency median "
        f"{statistics.median(latencies):.3f} s, max {latencies[-1]:.3f} s"
    )
    assert statistics.median(latencies) < 2.0 and latencies[-1] < 10.0
    assert cluster.alive()
    cluster.wait_blocks_free()
    assert cluster.metric("pdserve_router_queued_requests") == 0


def test_a_request_larger_than_the_kv_cache_is_refused_at_once_and_the_queue_flows(
    cluster, reference
):
    too_long_for_decode = completion([5] * 300, 600)  # 57 blocks; 900 tokens < 1,024
    too_long_for_prefill = completion([6] * 600, 10)  # 39 blocks: fits the decode node only

    async def run():
        queued = [
            asyncio.create_task(http(cluster.port, "/v1/completions", completion(p, n, i % 2 == 1)))
            for i, (p, n) in enumerate(QUEUED)  # 19 blocks each: two at a time fit
        ]
        deadline = time.monotonic() + 60
        while await queued_requests(cluster) < 4:  # two hold the decode blocks, the rest wait
            assert time.monotonic() < deadline, "the requests never queued for KV blocks"
            await asyncio.sleep(0.05)
        refused = await asyncio.gather(
            http(cluster.port, "/v1/completions", too_long_for_decode),
            http(cluster.port, "/v1/completions", {**too_long_for_decode, "stream": True}),
            http(cluster.port, "/v1/completions", too_long_for_prefill),
        )
        return refused, await asyncio.gather(*queued)

    refused, queued = asyncio.run(run())
    for reply, role in zip(refused, ("decode", "decode", "prefill")):
        error = assert_openai_error(reply, 400, "invalid_request_error")
        assert f"largest KV cache of a live {role} node" in error["message"], error
        assert "can never be served" in error["message"]
        assert reply.elapsed_s < 2.0
    for reply, (p, _) in zip(queued, QUEUED):
        assert reply.status == 200 and reply.error is None, reply
        assert reply.text() == reference[tuple(p)]
    cluster.wait_blocks_free()
    assert cluster.alive()
