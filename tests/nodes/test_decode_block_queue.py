"""The decode node's wait for KV blocks, in process: requests get their blocks in the engine's
order (priority aged by arrival), not first come first served; the rank keeps the arrival at
this node; a request aborted while it waits leaves at once; every block comes back."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from pdserve.decode_node.node import DecodeNode, Stage
from pdserve.engine.config import EngineConfig
from pdserve.wire.messages import Abort, Generate, PrefillRequest
from pdserve.wire.sampling_params import SamplingParams
from tests.nodes.unlooped import capture_sends, unlooped_config

BLOCK_SIZE = 16
NUM_BLOCKS = 8


@pytest.fixture
def node(tiny_llama_dir):
    node_id = f"q{uuid.uuid4().hex[:10]}"
    decode = DecodeNode(
        engine_config=EngineConfig(
            model=str(tiny_llama_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
        ),
        config=unlooped_config(node_id),
    )
    capture_sends(decode)
    yield decode
    decode.shutdown()
    assert not list(Path("/dev/shm").glob(f"*{node_id}*"))


def generate(request_id: str, num_tokens: int, priority: int = 0) -> Generate:
    return Generate(
        request_id,
        list(range(3, 3 + num_tokens)),
        SamplingParams(max_tokens=4, temperature=0.0),
        priority=priority,
        prefill_address="tcp://127.0.0.1:3",
    )


def reserved(node: DecodeNode) -> list[str]:
    return [m.request_id for m in node.sent if isinstance(m, PrefillRequest)]


def test_blocks_go_to_waiting_requests_by_priority_then_arrival(node):
    node.handle(generate("big", 7 * BLOCK_SIZE))  # 7 of the 8 blocks
    node.work()
    assert reserved(node) == ["big"]
    for request_id, priority in (("normal", 0), ("background", 5), ("urgent", -5), ("late", 0)):
        node.handle(generate(request_id, 3 * BLOCK_SIZE, priority))  # 3 blocks each
    node.work()
    assert reserved(node) == ["big"], "nothing fits while 'big' holds its blocks"
    assert all(node.pending[r].stage is Stage.WAITING_FOR_BLOCKS for r in ("normal", "urgent"))
    node.handle(Abort("background"))  # leaves the queue at once
    assert "background" not in node.pending
    node.handle(Abort("big"))  # never granted: its blocks return at once
    node.work()
    assert reserved(node) == ["big", "urgent", "normal"]  # "late" waits: 2 blocks are left
    assert node.pending["late"].stage is Stage.WAITING_FOR_BLOCKS
    for request_id in ("urgent", "normal", "late"):
        node.handle(Abort(request_id))
    deadline = time.monotonic() + 10
    while node.pending and time.monotonic() < deadline:
        node.work()
    assert not node.pending
    assert node.engine.block_manager.num_free_blocks == NUM_BLOCKS
    node.engine.check_integrity()
