"""Bursts larger than the deployment can serve in time, against real processes: every request
either completes with the fault-free greedy text or is refused (429) before its first token,
quickly; none dies after its first token.

The prefill side is slowed on purpose (a 16-token step budget), and the decode node's KV
transfer timeout (0.5 s) is far shorter than the time the burst's prompts queue on the prefill
node: a transfer's clock runs from its first write, not from the block reservation, so
queueing longer than the transfer timeout is harmless. The router refuses what would wait
longer than `--max-queue-delay` (router/cluster/queue_delay.py), in 1P1D and colocated mode alike.
Each deployment first serves a smaller burst of other prompts, so the router has observed how
fast its queue drains (a cold router relies on the node's own speed measurement, which for a
model this small leaves out most of the per-step cost).
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass

import pytest

from tests.fault_cluster import Cluster, Reply, completion, greedy_texts, http

BURST = 320
PROMPT_TOKENS = 128
MAX_TOKENS = 4
MAX_QUEUE_DELAY_S = 1.5
TRANSFER_TIMEOUT_S = 0.5
SLOW_PREFILL = ("--max-num-batched-tokens", "16")


WARM_UP_BURST = 40


def prompts(count: int = BURST, seed: int = 15) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)) for _ in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_llm) -> dict[tuple[int, ...], str]:
    return greedy_texts(tiny_llm, [(p, MAX_TOKENS) for p in prompts()])


@dataclass
class Outcomes:
    completed: list[Reply]
    refused: list[Reply]
    died_after_a_token: list[Reply]
    other: list[Reply | BaseException]


def classify(replies: list, reference: dict) -> Outcomes:
    outcomes = Outcomes([], [], [], [])
    for prompt, reply in zip(prompts(), replies):
        if isinstance(reply, BaseException):
            outcomes.other.append(reply)
        elif reply.status == 429:
            outcomes.refused.append(reply)
        elif reply.status == 200 and reply.error is None and reply.text() == reference[prompt]:
            outcomes.completed.append(reply)
        elif reply.status == 200 and reply.text():
            outcomes.died_after_a_token.append(reply)
        else:
            outcomes.other.append(reply)
    return outcomes


def burst(cluster: Cluster, reference: dict) -> Outcomes:
    async def send(batch: list[tuple[int, ...]]) -> list:
        return await asyncio.gather(
            *(
                http(cluster.port, "/v1/completions", completion(list(p), MAX_TOKENS, True))
                for p in batch
            ),
            return_exceptions=True,
        )

    warm_up = asyncio.run(send(prompts(WARM_UP_BURST, seed=16)))
    assert all(getattr(r, "status", None) in (200, 429) for r in warm_up), warm_up[:3]
    outcomes = classify(asyncio.run(send(prompts())), reference)
    latencies = sorted(r.elapsed_s for r in outcomes.refused)
    print(
        f"completed {len(outcomes.completed)}, refused {len(outcomes.refused)} (median "
        f"{statistics.median(latencies or [0]):.2f} s), died after a token "
        f"{len(outcomes.died_after_a_token)}, other {len(outcomes.other)}; "
        f"slowest completion {max((r.elapsed_s for r in outcomes.completed), default=0):.2f} s"
    )
    return outcomes


def assert_completed_or_refused_early(cluster: Cluster, outcomes: Outcomes) -> None:
    assert not outcomes.died_after_a_token, outcomes.died_after_a_token[:3]
    assert not outcomes.other, [getattr(r, "body", r) for r in outcomes.other[:3]]
    assert outcomes.refused, "the burst fit in the queue-delay bound: nothing was tested"
    assert len(outcomes.completed) >= 8, len(outcomes.completed)
    for reply in outcomes.refused:
        error = reply.json()["error"]
        assert error["type"] == "rate_limit_error" and "overloaded" in error["message"], error
    assert statistics.median(r.elapsed_s for r in outcomes.refused) < 2.0
    assert cluster.alive()
    cluster.wait_blocks_free()
    assert cluster.metric("pdserve_router_queued_requests") == 0


def test_a_disaggregated_burst_queues_past_the_transfer_timeout_and_refuses_the_rest_early(
    tiny_llama_dir, tmp_path, reference
):
    cluster = Cluster(
        tiny_llama_dir,
        tmp_path,
        prefill_flags=SLOW_PREFILL,
        decode_flags=("--transfer-timeout", str(TRANSFER_TIMEOUT_S)),
        router_flags=("--max-queue-delay", str(MAX_QUEUE_DELAY_S)),
    )
    try:
        outcomes = burst(cluster, reference)
        assert_completed_or_refused_early(cluster, outcomes)
        slowest = max(r.elapsed_s for r in outcomes.completed)
        assert slowest > 2 * TRANSFER_TIMEOUT_S, "no prompt queued past the transfer timeout"
        assert cluster.metric("pdserve_kv_transfer_failures_total") == 0
    finally:
        cluster.close()


def test_a_colocated_burst_is_refused_early_past_the_queue_delay(
    tiny_llama_dir, tmp_path, reference
):
    cluster = Cluster(
        tiny_llama_dir,
        tmp_path,
        colocated=True,
        node_flags=SLOW_PREFILL,
        router_flags=("--max-queue-delay", str(MAX_QUEUE_DELAY_S)),
    )
    try:
        assert_completed_or_refused_early(cluster, burst(cluster, reference))
    finally:
        cluster.close()
