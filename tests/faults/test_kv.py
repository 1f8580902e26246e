"""Lost, late and repeated KV messages between real prefill and decode nodes (the fault switch of
kvtransfer/faults.py, given to the nodes only): every request either completes with exactly the
greedy text of a fault-free engine or ends with an error, within its transfer deadline plus a
margin; a streamed request that fails has shown only a prefix of the right text; nothing is
ever decoded from a partial transfer; every KV block returns and no process dies."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.engine import SamplingParams
from pdserve.kvtransfer.faults import ENV_VAR, KVFaults
from tests.fault_cluster import Cluster, completion, http

TRANSFER_TIMEOUT_S = 2.0
FAULTS = (
    "drop_frame=0.12,dup_frame=0.25,delay_frame=0.3,delay_frame_ms=150,"
    "drop_done=0.1,dup_done=0.25,delay_done_ms=100,seed=7"
)
# A failed transfer ends at its deadline; the router may retry a request once on another
# attempt while no token reached the client; the rest is this loaded machine's slack.
MAX_REQUEST_S = 3 * TRANSFER_TIMEOUT_S + 15


def workload(count: int = 24) -> list[tuple[list[int], int, bool]]:
    rng = random.Random(5)
    return [
        (
            [rng.randrange(3, 500) for _ in range(rng.randrange(4, 200))],
            rng.randrange(2, 20),
            i % 2 == 1,
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def reference(tiny_llm) -> list[str]:
    requests = workload()
    outputs = tiny_llm.generate(
        [prompt for prompt, _, _ in requests],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n, _ in requests],
    )
    return [out.text for out in outputs]


def test_fault_spec_is_parsed_and_checked():
    faults = KVFaults.parse(FAULTS)
    assert faults.rates["frame"].drop == 0.12 and faults.rates["frame"].delay_s == 0.15
    assert faults.rates["done"].delay == 1.0 and faults.seed == 7
    assert KVFaults.from_environ({}) is None
    assert KVFaults.from_environ({ENV_VAR: "seed=3"}) is None  # nothing to inject
    for bad, why in (("drop_frame=2", "probability"), ("explode=1", "KEY=VALUE"),
                     ("delay_done_ms=x", "not a number"), ("dup_frame", "KEY=VALUE")):
        with pytest.raises(ValueError, match=why):
            KVFaults.parse(bad)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_lost_late_and_repeated_kv_messages_give_the_right_text_or_an_error(
    tiny_llama_dir, tmp_path, reference, transport
):
    cluster = Cluster(
        tiny_llama_dir,
        tmp_path,
        kv_transport=transport,
        prefill_flags=("--max-num-batched-tokens", "32"),
        decode_flags=("--transfer-timeout", str(TRANSFER_TIMEOUT_S)),
        node_env={ENV_VAR: FAULTS},
    )
    try:

        async def run():
            return await asyncio.gather(*(
                http(cluster.port, "/v1/completions", completion(prompt, n, stream))
                for prompt, n, stream in workload()
            ))

        replies = asyncio.run(run())
        outcomes = []
        for reply, expected, (_, _, stream) in zip(replies, reference, workload()):
            assert reply.elapsed_s < MAX_REQUEST_S, reply.elapsed_s
            if reply.status == 200 and reply.error is None:
                assert reply.text() == expected, "a 200 answer with wrong text"
                outcomes.append("ok")
                continue
            assert reply.error is not None and reply.error["message"], reply
            if stream and reply.status == 200:
                assert expected.startswith(reply.text()), "a stream showed wrong text"
            else:
                assert reply.status in (500, 502, 503), reply
            outcomes.append("error")
        assert "ok" in outcomes and "error" in outcomes, outcomes  # the faults did something
        cluster.wait_blocks_free()
        failures = cluster.metric_by_node("pdserve_kv_transfer_failures_total")
        assert sum(failures.values()) > 0, failures
        assert cluster.alive()
        for node in ("prefill", "decode"):
            assert "KV fault injection is ON" in cluster.log(node)
    finally:
        cluster.close()
