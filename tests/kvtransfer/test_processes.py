"""KV blocks written by a real prefill process arrive bit-exact in a real decode process.

One decode peer and one prefill peer (`kvtransfer/peer.py`) host a receiver and a sender per
(transport: shm, zmq, mooncake; dtype); each test moves random bytes - shuffled destination
blocks, a partial last block, several transfers at once, written chunk by chunk and each chunk
in layer groups - and compares SHA-256 per block.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest

from pdserve.kvtransfer.peer import PeerProcess
from tests.mooncake_env import require_mooncake

SHM_DIR = Path("/dev/shm")
NUM_BLOCKS = 32
BLOCK_SIZE = 4
SHAPE = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": BLOCK_SIZE}
LAYER_GROUPS = ((0, 2), (2, 3))  # each chunk's blocks leave in two writes, as a forward ends each


def leftover_segments(node_prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"pdserve-kv-{node_prefix}*"))


@pytest.fixture(scope="module")
def node_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def peers(tmp_path_factory, node_prefix):
    logs = tmp_path_factory.mktemp("kv-peers")
    decode, prefill = PeerProcess(logs / "decode.log"), PeerProcess(logs / "prefill.log")
    try:
        decode.wait_started()
        prefill.wait_started()
        yield decode, prefill
    finally:
        decode.stop()
        prefill.stop()
    assert leftover_segments(node_prefix) == []


def chunked_writes(num_tokens: int, chunk_tokens: int) -> list[int]:
    """How many blocks each prefill chunk completes (the last chunk also writes the partial
    last block): the blocks a prefill node writes after each chunk's forward."""
    completed, counts = 0, []
    for end in range(chunk_tokens, num_tokens + chunk_tokens, chunk_tokens):
        end = min(end, num_tokens)
        full = end // BLOCK_SIZE if end < num_tokens else -(-end // BLOCK_SIZE)
        counts.append(full - completed)
        completed = full
    return counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("transport", ["shm", "zmq", "mooncake"])
def test_random_kv_arrives_bit_exact_in_shuffled_blocks(peers, node_prefix, transport, dtype):
    if transport == "mooncake":
        require_mooncake()
    decode, prefill = peers
    name, node_id = f"{transport}-{dtype}", f"{node_prefix}-{transport}-{dtype}"
    rng = random.Random(f"{transport}{dtype}")
    descriptor = decode.call(
        "open_receiver", name=name, transport=transport, node_id=node_id,
        spec={**SHAPE, "dtype": dtype}, num_blocks=NUM_BLOCKS,
    )["descriptor"]
    prefill.call(
        "open_sender", name=name, transport=transport, descriptor=descriptor,
        seed=rng.randrange(1 << 30), num_blocks=NUM_BLOCKS,
    )
    # Three requests at once: 18, 9 and 31 tokens (5, 3 and 8 blocks; all end mid-block).
    prompts = {"req-a": 18, "req-b": 9, "req-c": 31}
    free_dst = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    free_src = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    plans = {}
    for request_id, num_tokens in prompts.items():
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        src = [free_src.pop() for _ in range(num_blocks)]
        dst = [free_dst.pop() for _ in range(num_blocks)]
        plans[request_id] = (src, dst, chunked_writes(num_tokens, chunk_tokens=8))
        decode.call(
            "expect", name=name, transfer_id=request_id, block_ids=dst, deadline_s=10.0
        )
    positions = {request_id: 0 for request_id in plans}
    for chunk in range(max(len(plan[2]) for plan in plans.values())):
        for request_id, (src, dst, counts) in plans.items():
            if chunk < len(counts) and counts[chunk]:
                start = positions[request_id]
                end = start + counts[chunk]
                for layer_start, layer_end in LAYER_GROUPS:
                    prefill.call(
                        "write", name=name, transfer_id=request_id, src=src[start:end],
                        dst=dst[start:end], layer_start=layer_start, layer_end=layer_end,
                    )
                positions[request_id] = end
    for request_id, (src, dst, _) in plans.items():
        assert prefill.call("wait", name=name, transfer_id=request_id, wait_s=10)["kind"] == (
            "complete"
        )
        assert decode.call("wait", name=name, transfer_id=request_id, wait_s=10)["kind"] == (
            "complete"
        )
        sent = prefill.call("hashes", name=name, block_ids=src)["hashes"]
        received = decode.call("hashes", name=name, block_ids=dst)["hashes"]
        assert received == sent, f"{request_id} arrived altered"
    assert decode.call("held", name=name)["held"] == 0
    prefill.call("close", name=name)
    decode.call("close", name=name)
    assert leftover_segments(node_id) == []


def test_chunked_writes_cover_every_block_once():
    assert chunked_writes(18, 8) == [2, 2, 1]
    assert chunked_writes(16, 8) == [2, 2]
    assert chunked_writes(3, 8) == [1]
