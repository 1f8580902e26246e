"""The mooncake KV transport: its failures across real processes (a killed decode node, a killed
prefill node, a deadline passing) on both sides and within their deadlines, every block free
afterwards; one batched Mooncake write per step; and what it says when Mooncake is missing.
Bit-exact transfers of random KV are tests/kvtransfer/test_processes.py's, over every transport;
disaggregated == colocated over HTTP is tests/e2e/test_disaggregated.py's."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv.block_moves import BlockRun
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer import ChannelReceiver, ChannelSender, ReceiverConfig
from pdserve.kvtransfer.peer import PeerProcess
from pdserve.kvtransfer.transports.base import WriteStep, plan_steps
from pdserve.kvtransfer.transports.mooncake_engine import (
    MAX_SEGMENTS_PER_BATCH,
    WRITE_TIMEOUT_S,
    MooncakeUnavailable,
    explain_import_error,
    host_of,
)
from pdserve.kvtransfer.transports.registry import receiver_transport, sender_transport
from tests.kvtransfer.peer_pairs import GRACE_S, open_pair, peer_starter, wait_landed
from tests.mooncake_env import require_mooncake

DEADLINE_S = 1.5
RELEASE_AFTER_DEADLINE_S = WRITE_TIMEOUT_S + 1.0  # the mooncake strategy's write_timeout_s


@pytest.fixture
def start_peers(tmp_path):
    """Starts peer processes in parallel; stops them all."""
    require_mooncake()
    with peer_starter(tmp_path) as start:
        yield start


def open_mooncake_pair(decode: PeerProcess, prefill: PeerProcess) -> None:
    open_pair(decode, prefill, "mooncake", f"mc{uuid.uuid4().hex[:8]}")


def assert_blocks_free_again(decode: PeerProcess, block_ids: list[int]) -> None:
    assert decode.call("held", name="mooncake")["held"] == 0
    decode.call("expect", name="mooncake", transfer_id="req-next", block_ids=block_ids, deadline_s=5)
    decode.call("abort", name="mooncake", transfer_id="req-next")
    assert decode.call("wait", name="mooncake", transfer_id="req-next", wait_s=8)["kind"] == "released"
    assert decode.call("held", name="mooncake")["held"] == 0


def test_killed_decode_node_fails_the_senders_next_write_at_once(start_peers):
    decode, prefill = start_peers("decode", "prefill")
    open_mooncake_pair(decode, prefill)
    decode.call("expect", name="mooncake", transfer_id="req-orphan", block_ids=[1, 2, 3, 4],
                deadline_s=30)
    prefill.call("write", name="mooncake", transfer_id="req-orphan", src=[5, 6], dst=[1, 2])
    wait_landed(decode, prefill, "mooncake", [5, 6], [1, 2])
    decode.kill()
    killed_at = time.monotonic()
    prefill.call("write", name="mooncake", transfer_id="req-orphan", src=[7, 8], dst=[3, 4])
    event = prefill.call("wait", name="mooncake", transfer_id="req-orphan", wait_s=20)
    assert event["kind"] == "failed"
    assert "'req-orphan'" in event["error"] and "Mooncake write" in event["error"]
    assert time.monotonic() - killed_at < 10, "failed only near its 30 s deadline"
    prefill.call("close", name="mooncake")


def test_killed_prefill_node_frees_its_blocks_after_the_deadline_and_the_write_timeout(
    start_peers,
):
    decode, prefill = start_peers("decode", "prefill")
    open_mooncake_pair(decode, prefill)
    dst = [9, 3, 12, 5, 0, 7]
    decode.call("expect", name="mooncake", transfer_id="req-killed", block_ids=dst,
                deadline_s=DEADLINE_S)
    expected_at = time.monotonic()
    prefill.call("write", name="mooncake", transfer_id="req-killed", src=[0, 1, 2], dst=dst[:3])
    wait_landed(decode, prefill, "mooncake", [0, 1, 2], dst[:3])
    prefill.kill()
    event = decode.call(
        "wait", name="mooncake", transfer_id="req-killed", wait_s=DEADLINE_S + 15, timeout=30
    )
    elapsed = time.monotonic() - expected_at
    assert event["kind"] == "released"
    assert "'req-killed'" in event["error"] and "deadline" in event["error"]
    # Held past the deadline for as long as a started Mooncake write could still be landing.
    earliest = DEADLINE_S + RELEASE_AFTER_DEADLINE_S
    assert earliest - 0.05 <= elapsed <= earliest + 2.0
    assert_blocks_free_again(decode, dst)
    decode.call("close", name="mooncake")


def test_a_transfer_past_its_deadline_fails_on_both_sides_and_frees_its_blocks(start_peers):
    decode, prefill = start_peers("decode", "prefill")
    open_mooncake_pair(decode, prefill)
    dst = [4, 8, 15, 2]
    decode.call("expect", name="mooncake", transfer_id="req-late", block_ids=dst,
                deadline_s=DEADLINE_S)
    expected_at = time.monotonic()
    prefill.call("write", name="mooncake", transfer_id="req-late", src=[3, 4], dst=dst[:2])
    sender_event = prefill.call("wait", name="mooncake", transfer_id="req-late", wait_s=10)
    assert sender_event["kind"] == "failed" and "deadline" in sender_event["error"]
    assert DEADLINE_S - 0.3 <= time.monotonic() - expected_at <= DEADLINE_S + 1.5
    # The live sender abandons the transfer, so its blocks return without the write timeout.
    receiver_event = decode.call("wait", name="mooncake", transfer_id="req-late", wait_s=10)
    assert receiver_event["kind"] == "released" and "deadline" in receiver_event["error"]
    assert time.monotonic() - expected_at < DEADLINE_S + RELEASE_AFTER_DEADLINE_S
    assert_blocks_free_again(decode, dst)
    prefill.call("close", name="mooncake")
    decode.call("close", name="mooncake")


def test_each_step_is_one_batched_write_of_its_block_runs_merged_where_adjacent(monkeypatch):
    require_mooncake()
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.float32)
    receiver = ChannelReceiver(
        "mooncake", ReceiverConfig(f"mc{uuid.uuid4().hex[:8]}", "tcp://127.0.0.1:0")
    )
    remote = receiver.allocate_kv_cache(spec, 8, torch.device("cpu"))
    descriptor = receiver.register(remote, "fp")
    sender = ChannelSender("mooncake")
    local = KVCache(spec, 8, torch.device("cpu"))
    local.buffer.normal_()
    sender.connect(descriptor, local, "fp")
    try:
        transport = sender.transport
        run_bytes = spec.bytes_per_block_per_layer // 2
        scattered = WriteStep([BlockRun(0, 5, 3), BlockRun(6, 1, 2)], 0, 3, 0)
        _sources, _targets, lengths = transport.segments(scattered)
        assert lengths == [3 * run_bytes, 2 * run_bytes] * 6  # 3 layers x keys, values
        whole = WriteStep([BlockRun(0, 0, 8)], 1, 3, 0)
        assert transport.segments(whole)[2] == [2 * 2 * 8 * run_bytes]  # one merged segment

        calls = []
        write = transport._engine.write
        monkeypatch.setattr(
            transport._engine, "write", lambda *a: (calls.append(len(a[3])), write(*a))[1]
        )
        receiver.expect("req-1", [5, 6, 7, 1, 2], time.monotonic() + 10)
        sender.write("req-1", [0, 1, 2, 6, 7], [5, 6, 7, 1, 2])
        assert sender.wait("req-1", 10).kind.value == "complete"
        assert receiver.wait("req-1", 10).kind.value == "complete"
        assert calls == [12]  # one write for the step: 2 runs x 3 layers x keys and values
        for src, dst in zip([0, 1, 2, 6, 7], [5, 6, 7, 1, 2]):
            assert torch.equal(remote.buffer[:, :, dst], local.buffer[:, :, src])
        assert receiver.held_block_count() == 0
    finally:
        sender.close()
        receiver.close()


def test_a_step_of_more_segments_than_mooncake_queues_lands_in_several_batches():
    require_mooncake()
    spec = KVCacheSpec(num_layers=3, num_kv_heads=1, head_dim=4, block_size=4,
                       dtype=torch.float16)  # 32-byte segments: thousands fit in a step
    num_blocks = 1600  # 800 single-block runs x 3 layers x keys, values: 4,800 segments
    receiver = ChannelReceiver(
        "mooncake", ReceiverConfig(f"mc{uuid.uuid4().hex[:8]}", "tcp://127.0.0.1:0")
    )
    remote = receiver.allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
    descriptor = receiver.register(remote, "fp")
    sender = ChannelSender("mooncake")
    local = KVCache(spec, num_blocks, torch.device("cpu"))
    local.buffer.normal_()
    sender.connect(descriptor, local, "fp")
    try:
        src = list(range(0, num_blocks, 2))  # every other block, reversed: no run merges
        dst = list(reversed(range(1, num_blocks, 2)))
        (step,) = plan_steps(spec, src, dst, sender.config.step_bytes)
        assert len(sender.transport.segments(step)[2]) == 6 * len(src) > MAX_SEGMENTS_PER_BATCH
        receiver.expect("req-many", dst, time.monotonic() + 20)
        sender.write("req-many", src, dst)
        assert sender.wait("req-many", 20).kind.value == "complete"
        assert receiver.wait("req-many", 20).kind.value == "complete"
        for s_block, d_block in zip(src, dst):
            assert torch.equal(remote.buffer[:, :, d_block], local.buffer[:, :, s_block])
        assert receiver.held_block_count() == 0
    finally:
        sender.close()
        receiver.close()


def test_failed_mooncake_transfers_hold_their_blocks_for_the_write_timeout():
    require_mooncake()
    strategy = receiver_transport("mooncake", "n").strategy
    assert strategy.release_after_failure(100.0, GRACE_S) == 100.0 + RELEASE_AFTER_DEADLINE_S
    assert strategy.release_after_failure(100.0, 30.0) == 130.0


def test_missing_mooncake_names_the_package_or_the_system_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    for build in (lambda: receiver_transport("mooncake", "n"), lambda: sender_transport(
        "mooncake", 1 << 16
    )):
        with pytest.raises(MooncakeUnavailable, match=r"pip install 'pdserve\[mooncake\]'"):
            build()
    message = explain_import_error(
        ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    )
    assert "apt-get install -y libibverbs1" in message and "libibverbs.so.1" in message


def test_the_session_host_is_the_channels_host():
    assert host_of("tcp://10.1.2.3:5553") == "10.1.2.3"
    assert host_of("tcp://decode-0:5553") == "decode-0"
    assert host_of("tcp://[::1]:5553") == "::1"
    assert host_of(f"ipc://{Path('/tmp/kv')}") == "127.0.0.1"
