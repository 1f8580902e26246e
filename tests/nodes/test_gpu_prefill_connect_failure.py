"""A KV transport that cannot attach to a decode node's buffer from the prefill process (a GPU
it cannot see, a shared-memory segment that is gone) fails that request alone: the router gets
RequestFailed 503 naming the decode node, and the prefill node serves the next request.

In process, on the tiny model: a decode node (shm) reserves blocks for a request; its
PrefillRequest goes to the prefill node twice, first with the descriptor's segment renamed to
one that does not exist (the transport raises RuntimeError at connect), then as it is."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from pathlib import Path

import pytest

from pdserve.decode_node.node import DecodeNode
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.shared_segment import segment_name
from pdserve.kvtransfer import KVDescriptor
from pdserve.prefill_node.node import PrefillNode
from pdserve.wire.messages import Generate, PrefillDone, PrefillRequest, RequestFailed, TokenBatch
from pdserve.wire.sampling_params import SamplingParams
from tests.nodes.unlooped import capture_sends, unlooped_config

NUM_BLOCKS = 16
DEADLINE_S = 30.0


@pytest.fixture
def nodes(tiny_llama_dir):
    tag = uuid.uuid4().hex[:10]
    engine_config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=NUM_BLOCKS)
    decode = DecodeNode(engine_config=engine_config, config=unlooped_config(f"d{tag}"))
    prefill = PrefillNode(engine_config=engine_config, config=unlooped_config(f"p{tag}"))
    capture_sends(decode)
    capture_sends(prefill)
    try:
        yield decode, prefill
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert not list(Path("/dev/shm").glob(f"*{tag}*"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_transport_that_cannot_attach_fails_the_request_and_the_node_serves_on(nodes):
    decode, prefill = nodes
    decode.handle(Generate("r1", list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0),
                           prefill_address="tcp://127.0.0.1:3"))
    decode.work()
    (request,) = [m for m in decode.sent if isinstance(m, PrefillRequest)]
    descriptor = KVDescriptor.decode(request.kv_descriptor)
    gone = dataclasses.replace(
        descriptor, handle={**descriptor.handle, "segment": segment_name("gone-node")}
    )
    fds_before = open_fds()
    prefill.handle(dataclasses.replace(request, request_id="r0", kv_descriptor=gone.encode()))

    (failed,) = prefill.sent
    assert isinstance(failed, RequestFailed) and failed.request_id == "r0"
    assert failed.status == 503
    assert f"shm KV channel to decode node {descriptor.node_id!r}" in failed.message
    assert "RuntimeError" in failed.message and "gone-node" in failed.message
    assert not prefill.requests and not prefill.senders
    assert open_fds() == fds_before, "the failed sender left files open"

    prefill.handle(request)  # the same decode node, reachable: served as usual
    first_tokens, finished = [], False
    deadline = time.monotonic() + DEADLINE_S
    while not finished:
        assert time.monotonic() < deadline, "the request did not finish in time"
        prefill.work()
        for message in prefill.sent:
            if isinstance(message, PrefillDone):
                decode.handle(message)
            elif isinstance(message, TokenBatch):
                first_tokens += [u.token_ids[0] for u in message.updates]
        prefill.sent.clear()
        decode.work()
        finished = any(
            u.finish_reason for m in decode.sent if isinstance(m, TokenBatch) for u in m.updates
        )
    assert len(first_tokens) == 1
    assert not [m for m in decode.sent if isinstance(m, RequestFailed)]
    while prefill.requests and time.monotonic() < deadline:
        prefill.work()
    assert not prefill.requests
    prefill.engine.check_integrity()
