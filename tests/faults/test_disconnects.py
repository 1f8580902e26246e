"""Clients that go away at every stage of a disaggregated request, streaming and not: waiting
for decode KV blocks, while the prefill node holds the prompt, with the KV frames in flight
after the first token came back (the prefill is done, the decode node has not admitted the
request), and mid-decode. Each abort must reach the node that holds the request, every KV
block must return, and requests sent right after, into the freed blocks, must give exactly the
greedy text of a fault-free engine.

The KV frames travel over zmq and every one is held 1 s by the fault switch
(kvtransfer/faults.py): the transfer stage lasts long enough to be hit for certain, and the
frames of an aborted transfer arrive after its blocks were freed and reused, the late writes
the decode node must refuse. Each client hangs up once its request is seen in the stage under
test (a node's log line, its request counts or KV bytes in /metrics), never after a fixed time.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable

import pytest

from pdserve.kvtransfer.faults import ENV_VAR
from tests.fault_checks import wait_until_async
from tests.fault_cluster import (
    Cluster,
    LogCursor,
    completion,
    greedy_texts,
    http,
    open_request,
)

FRAME_DELAY_S = 1.0
NUM_KV_BLOCKS = 200  # decode node: 3 prompts of 1,000 tokens (63 blocks each) fill it
COLOCATED_ABORT = re.compile(r"aborted request \S+\n")
STAGE_TIMEOUT_S = 60.0  # for a request to reach a stage, on a machine with no idle core

def prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 500) for _ in range(length))


BLOCKERS = tuple((prompt(1000, i), 16) for i in range(3))
LOADERS = tuple((prompt(1000, 10 + i), 4) for i in range(4))  # nothing of them is cached
FOLLOW_UPS = tuple(
    (prompt(n, 20 + i), 12)
    for i, n in enumerate((40, 300, 170, 700, 90, 500, 260, 30, 620, 10, 333, 64))
)


@pytest.fixture(scope="module")
def reference(tiny_llm) -> dict[tuple[int, ...], str]:
    return greedy_texts(tiny_llm, BLOCKERS + LOADERS + FOLLOW_UPS)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cluster = Cluster(
        tiny_llama_dir,
        tmp_path_factory.mktemp("disconnects"),
        kv_transport="zmq",
        prefill_flags=("--max-num-batched-tokens", "8"),
        decode_flags=("--num-kv-blocks", str(NUM_KV_BLOCKS), "--transfer-timeout", "10"),
        node_env={ENV_VAR: f"delay_frame_ms={FRAME_DELAY_S * 1000:g}"},
    )
    yield cluster
    cluster.close()


async def hang_up_after(
    port: int, body: dict, *, events: int = 0, stage: Awaitable | None = None
) -> int:
    """Sends the request, waits for `events` SSE events, then for `stage` (the request seen in
    the stage to hang up in), then resets the connection; returns the SSE events seen."""
    reader, writer = await open_request(port, "/v1/completions", body)
    seen = 0
    try:
        if events:
            data = b""
            while data.count(b"data: ") < events:
                chunk = await asyncio.wait_for(reader.read(65536), STAGE_TIMEOUT_S)
                assert chunk, "the server ended the stream"
                data += chunk
            seen = data.count(b"data: ")
        if stage is not None:
            await stage
    finally:
        writer.transport.abort()
    return seen


def stage(predicate, what: str) -> Awaitable:
    return wait_until_async(predicate, STAGE_TIMEOUT_S, what)


def on_decode_node(cluster: Cluster, *counts: str) -> float:
    """The sum of the decode node's `counts` (`waiting`, `running`), from one NodeStats."""
    names = [f"pdserve_num_requests_{count}" for count in counts]
    found = cluster.metrics_by_node(*names)
    return sum(found[name].get(f"decode-{cluster.tag}", 0.0) for name in names)


def kv_bytes_sent(cluster: Cluster) -> float:
    """KV bytes the prefill node has handed to its sender so far (frames leave, held 1 s)."""
    sent = cluster.metric_by_node("pdserve_kv_transfer_bytes_total")
    return sent.get(f"prefill-{cluster.tag}", 0.0)


async def check_answers(port: int, reference: dict, requests: list) -> None:
    replies = await asyncio.gather(*(
        http(port, "/v1/completions", completion(p, n, stream=i % 2 == 0))
        for i, (p, n) in enumerate(requests)
    ))
    for reply, (p, _) in zip(replies, requests):
        assert reply.status == 200 and reply.error is None, reply
        assert reply.text() == reference[tuple(p)], "wrong text after the disconnects"


def first_token_stream(prompt_ids: tuple[int, ...]) -> dict:
    """With logprobs every token makes an SSE event, even one that adds no text yet."""
    return completion(prompt_ids, 8, stream=True, logprobs=0)


def follow_ups(phase: int) -> list:
    return FOLLOW_UPS[2 * phase: 2 * phase + 2]


PREFILL_LET_GO = re.compile(
    r"aborted prefill of (\S+)\n|request '([^']+)' was aborted by the decode node"
)
DECODE_LET_GO = re.compile(
    r"aborted request (\S+) before it joined the batch"
    r"|request (\S+) failed: the prefill node abandoned the transfer"
)


def prefill_let_go(prefill: LogCursor) -> int:
    """Requests the prefill node dropped: on the router's Abort, or (when the decode node's
    abort came first, over the KV channel) when their transfer was cancelled."""
    return len({a or b for a, b in PREFILL_LET_GO.findall(prefill.text())})


def decode_let_go(decode: LogCursor) -> int:
    """Requests the decode node dropped before they joined its batch: on the router's Abort, or
    (when the prefill node's abort came first, over the KV channel) as an abandoned transfer."""
    return len({a or b for a, b in DECODE_LET_GO.findall(decode.text())})


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_disconnect_while_waiting_for_decode_blocks(cluster, reference, stream):
    decode, prefill = LogCursor(cluster, "decode"), LogCursor(cluster, "prefill")

    async def run():
        blockers = asyncio.gather(*(
            http(cluster.port, "/v1/completions", completion(p, n)) for p, n in BLOCKERS
        ))
        # A PrefillRequest leaves the decode node once it has reserved the prompt's blocks.
        await stage(lambda: prefill.count("prefilling") >= len(BLOCKERS), "blockers' reservations")
        both_waiting = len(BLOCKERS) + 2  # on the decode node, neither got blocks
        await asyncio.gather(*(
            hang_up_after(
                cluster.port,
                completion(prompt(300, 100 + i), 8, stream),
                stage=stage(
                    lambda: on_decode_node(cluster, "waiting", "running") >= both_waiting,
                    "both requests waiting for decode blocks",
                ),
            )
            for i in range(2)
        ))
        await check_answers(cluster.port, reference, follow_ups(int(stream)))
        for reply, (p, _) in zip(await blockers, BLOCKERS):
            assert reply.status == 200 and reply.text() == reference[tuple(p)]

    asyncio.run(run())
    wait_for(lambda: decode_let_go(decode) >= 2, decode.text())
    assert prefill.count("aborted prefill of") == 0  # they never reached the prefill node
    assert prefill.count("prefilling") == len(BLOCKERS) + 2
    cluster.wait_blocks_free()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_disconnect_while_the_prefill_node_holds_the_prompt(cluster, reference, stream):
    decode, prefill = LogCursor(cluster, "decode"), LogCursor(cluster, "prefill")

    async def run():
        mine = LOADERS[2 * int(stream): 2 * int(stream) + 2]
        loaders = [asyncio.create_task(http(
            cluster.port, "/v1/completions", completion(p, n))) for p, n in mine]
        # 2,000 prompt tokens, 8 per step, ahead of the target at the prefill node
        await stage(lambda: prefill.count("prefilling") >= len(mine), "the loaders' prefill")
        await hang_up_after(
            cluster.port,
            completion(prompt(1000, 110 + stream), 8, stream),
            stage=stage(
                lambda: prefill.count("prefilling") > len(mine), "the target queued for prefill"
            ),
        )
        await check_answers(cluster.port, reference, follow_ups(2 + int(stream)))
        for reply, (p, _) in zip(await asyncio.gather(*loaders), mine):
            assert reply.status == 200 and reply.text() == reference[tuple(p)]

    asyncio.run(run())
    wait_for(lambda: prefill_let_go(prefill) >= 1, prefill.text())
    wait_for(lambda: decode_let_go(decode) >= 1, decode.text())
    cluster.wait_blocks_free()


def test_disconnect_with_kv_in_flight_before_and_after_the_first_token(cluster, reference):
    """Plain: gone once its first KV frames left the prefill node (held 1 s) while the rest of
    its 600-token prompt is still being prefilled. Streaming: gone as soon as the first token
    (computed by the prefill node) arrives, before the decode node can admit it."""
    decode, prefill = LogCursor(cluster, "decode"), LogCursor(cluster, "prefill")
    sent_before = kv_bytes_sent(cluster)

    async def run():
        await hang_up_after(
            cluster.port,
            completion(prompt(600, 120), 8),
            stage=stage(lambda: kv_bytes_sent(cluster) > sent_before, "its first KV frames"),
        )
        seen = await asyncio.gather(
            hang_up_after(cluster.port, first_token_stream(prompt(150, 121)), events=1),
            hang_up_after(cluster.port, first_token_stream(prompt(90, 122)), events=1),
        )
        assert seen == [1, 1]
        await check_answers(cluster.port, reference, follow_ups(4))

    asyncio.run(run())
    wait_for(lambda: prefill_let_go(prefill) >= 3, prefill.text())
    wait_for(lambda: decode_let_go(decode) >= 3, decode.text())
    cluster.wait_blocks_free()


def test_disconnect_mid_decode(cluster, reference):
    decode = LogCursor(cluster, "decode")

    def both_decoding():
        return stage(lambda: on_decode_node(cluster, "running") >= 2, "both requests decoding")

    async def run():
        await asyncio.gather(
            hang_up_after(cluster.port, completion(prompt(60, 130), 900), stage=both_decoding()),
            hang_up_after(
                cluster.port,
                completion(prompt(60, 131), 900, stream=True),
                events=20,
                stage=both_decoding(),
            ),
        )
        await check_answers(cluster.port, reference, follow_ups(5))

    asyncio.run(run())
    wait_for(lambda: len(COLOCATED_ABORT.findall(decode.text())) >= 2, decode.text())
    cluster.wait_blocks_free()
    assert cluster.alive()
