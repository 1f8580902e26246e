"""KV transfer behaviour that needs no second process: descriptor checks, the ledger, the
late-write rule, aborts from either side, backpressure, stale segments, KVCache.over_buffer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.kv.shared_segment import SHM_DIR, SharedSegment
from pdserve.kvtransfer import (
    TRANSPORT_NAMES,
    ChannelReceiver,
    ChannelSender,
    DescriptorMismatch,
    KVDescriptor,
    ReceiverConfig,
    SenderConfig,
    TransferKind,
)
from pdserve.kvtransfer.ledger import PACE_FACTOR, TransferLedger
from pdserve.kvtransfer.messages import Begin, KVProtocolError, decode_header, encode_header
from pdserve.kvtransfer.strategies import DirectWrite, Streamed
from pdserve.kvtransfer.transports.base import plan_steps
from pdserve.kvtransfer.transports.registry import receiver_transport

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
CPU = torch.device("cpu")


def make_pair(transport, node_id, grace=0.2, sender_config=None, spec=SPEC, num_blocks=32):
    receiver = ChannelReceiver(transport, ReceiverConfig(node_id, release_grace_s=grace))
    cache = receiver.allocate_kv_cache(spec, num_blocks, CPU)
    descriptor = receiver.register(cache, "fp")
    local = KVCache(spec, num_blocks, CPU)
    local.buffer.copy_(torch.randn(local.buffer.shape))
    sender = ChannelSender(transport, sender_config or SenderConfig(step_bytes=1 << 16))
    sender.connect(descriptor, local, "fp")
    return receiver, cache, sender, local


def close_all(*endpoints):
    for endpoint in endpoints:
        endpoint.close()


def test_descriptor_mismatch_fails_at_connect_naming_both_values(node_id):
    receiver = ChannelReceiver("zmq", ReceiverConfig(node_id))
    cache = receiver.allocate_kv_cache(SPEC, 8, CPU)
    descriptor = receiver.register(cache, "model-a")
    try:
        other = KVCacheSpec(3, 2, 8, 4, torch.bfloat16)
        with pytest.raises(DescriptorMismatch) as raised:
            ChannelSender("zmq").connect(descriptor, KVCache(other, 8, CPU), "model-b")
        message = str(raised.value)
        assert "dtype is 'float32' on decode node" in message and "'bfloat16' on this" in message
        assert "'model-a'" in message and "'model-b'" in message
        with pytest.raises(DescriptorMismatch, match="transport is 'zmq'.*'shm'"):
            ChannelSender("shm").connect(descriptor, KVCache(SPEC, 8, CPU), "model-a")
        assert KVDescriptor.decode(descriptor.encode()) == descriptor
        with pytest.raises(KVProtocolError):
            KVDescriptor.decode(b"\x81\xa1a\x01")
    finally:
        receiver.close()


def test_unknown_transport_names_the_valid_ones():
    valid = r"\['shm', 'cuda_ipc', 'zmq', 'mooncake', 'inprocess'\]"
    with pytest.raises(ValueError, match=rf"'rdma'.*{valid}"):
        receiver_transport("rdma", "n")
    assert TRANSPORT_NAMES == ("shm", "cuda_ipc", "zmq", "mooncake")  # the double serves no node


def test_ledger_refuses_blocks_held_by_another_transfer_and_completes_on_every_layer():
    ledger = TransferLedger(num_blocks=8, num_layers=3, strategy=DirectWrite(), release_grace_s=1)
    ledger.expect("a", [1, 2], deadline=10, now=0)
    with pytest.raises(ValueError, match="block 2 .* still held by transfer 'a'"):
        ledger.expect("b", [2, 3], deadline=10, now=0)
    with pytest.raises(ValueError, match="outside 0..7"):
        ledger.expect("c", [8], deadline=10, now=0)
    assert ledger.grant("a", b"w", now=1) is not None
    assert "another sender" in ledger.grant("a", b"x", now=1)
    assert "not granted to this sender" in ledger.check_write("a", b"x", [1], 0, 3)
    assert "not destination blocks" in ledger.check_write("a", b"w", [3], 0, 3)
    assert ledger.record_write("a", [1, 2], 0, 2, now=2) == 8  # no budget: a fixed deadline
    assert ledger.take_actions() == ([], [])
    assert ledger.record_write("a", [1, 2], 2, 3, now=3) == 0.0
    events, notices = ledger.take_actions()
    assert [e.kind for e in events] == [TransferKind.COMPLETE]
    assert [n[1].type for n in notices] == ["committed"]
    assert "complete" in ledger.check_write("a", b"w", [1], 0, 3)
    assert ledger.held_block_count() == 0


def test_a_transfer_whose_last_layer_group_never_lands_never_commits():
    ledger = TransferLedger(num_blocks=8, num_layers=4, strategy=DirectWrite(), release_grace_s=1)
    ledger.expect("a", [1, 2, 3], deadline=10, now=0)
    ledger.grant("a", b"w", now=0)
    ledger.record_write("a", [1, 2], 0, 2, now=1)  # the first chunk's blocks, group by group
    ledger.record_write("a", [1, 2], 2, 4, now=2)
    ledger.record_write("a", [3], 0, 2, now=3)  # the last chunk's block: its first group only
    ledger.record_write("a", [3], 0, 2, now=4)  # a repeat counts once
    ledger.record_write("a", [3], 1, 3, now=5)  # still short of layer 3
    assert ledger.take_actions() == ([], [])
    assert not ledger.committed("a")
    ledger.expire(now=10)
    events, _ = ledger.take_actions()
    assert [e.kind for e in events] == [TransferKind.FAILED]
    assert "11 of 12 block-layers arrived" in events[0].error


def test_failed_direct_write_holds_blocks_until_abandon_or_deadline_plus_grace():
    ledger = TransferLedger(num_blocks=8, num_layers=1, strategy=DirectWrite(), release_grace_s=0.5)
    ledger.expect("granted", [1], deadline=10, now=0)
    ledger.expect("never-granted", [2], deadline=10, now=0)
    ledger.expect("abandoned", [3], deadline=10, now=0)
    ledger.grant("granted", b"w", now=1)
    ledger.grant("abandoned", b"w", now=1)
    for transfer_id in ("granted", "never-granted", "abandoned"):
        ledger.fail(transfer_id, f"{transfer_id} aborted")
    ledger.abandoned("abandoned", b"w", "ack")
    events, _ = ledger.take_actions()
    released = {e.transfer_id for e in events if e.kind is TransferKind.RELEASED}
    assert released == {"never-granted", "abandoned"}
    ledger.expire(10.4)
    assert ledger.take_actions()[0] == []
    ledger.expire(10.5)
    assert [e.kind for e in ledger.take_actions()[0]] == [TransferKind.RELEASED]


def test_a_write_that_crosses_the_abort_is_refused_for_the_abort_s_reason():
    """The decode node's abort and a write already on its way cross: the write's refusal may
    reach the sender before the Cancel does, so it carries the same reason."""
    ledger = TransferLedger(num_blocks=8, num_layers=1, strategy=DirectWrite(), release_grace_s=5)
    ledger.expect("crossed", [1, 2], deadline=10, now=0)
    ledger.grant("crossed", b"w", now=1)
    ledger.fail("crossed", "KV transfer for request 'crossed' was aborted by the decode node")
    refusal = ledger.check_write("crossed", b"w", [2], 0, 1)
    assert "is failed" in refusal and "aborted by the decode node" in refusal


def test_a_failed_streamed_transfer_releases_its_blocks_at_once():
    ledger = TransferLedger(num_blocks=8, num_layers=1, strategy=Streamed(), release_grace_s=5)
    ledger.expect("granted", [1], deadline=10, now=0)
    ledger.grant("granted", b"w", now=1)
    ledger.fail("granted", "granted aborted")
    events, notices = ledger.take_actions()
    assert [e.kind for e in events] == [TransferKind.FAILED, TransferKind.RELEASED]
    assert [n[1].type for n in notices] == ["cancel"]
    assert ledger.held_block_count() == 0


def test_a_budgeted_transfer_waits_for_its_first_write_then_runs_its_own_clock():
    """A prompt queued on the prefill node longer than the transfer budget must not fail: the
    budget runs from the grant; only the (longer) wait deadline bounds the queueing."""
    ledger = TransferLedger(num_blocks=8, num_layers=1, strategy=DirectWrite(), release_grace_s=0.5)
    ledger.expect("queued-long", [1], deadline=100, now=0, budget_s=5)
    ledger.expect("never-begun", [2], deadline=100, now=0, budget_s=5)
    ledger.expire(60)  # far past the budget, inside the wait deadline
    assert ledger.take_actions() == ([], [])
    granted = ledger.grant("queued-long", b"w", now=60)
    assert granted.deadline == 65
    ledger.expire(64.9)
    assert ledger.take_actions() == ([], [])
    ledger.expire(65)
    events, _ = ledger.take_actions()
    assert [(e.transfer_id, e.kind) for e in events] == [("queued-long", TransferKind.FAILED)]
    assert "made no progress for 5.00 s (0 of 1 block-layers arrived)" in events[0].error
    ledger.expire(100)
    events, _ = ledger.take_actions()
    failed = [e for e in events if e.kind is TransferKind.FAILED]
    assert [e.transfer_id for e in failed] == ["never-begun"]
    assert "did not start" in failed[0].error


def test_a_budgeted_transfer_is_judged_by_its_progress_not_its_total_time():
    """A long prompt's KV arrives chunk by chunk over minutes on a busy host: each write moves
    the deadline to its arrival plus the budget, so only a transfer that stops making progress
    fails, `budget_s` after its last write."""
    ledger = TransferLedger(num_blocks=8, num_layers=2, strategy=DirectWrite(), release_grace_s=0.5)
    ledger.expect("long", [1, 2, 3, 4], deadline=100, now=0, budget_s=5)
    ledger.grant("long", b"w", now=10)
    for block, now in ((1, 14), (2, 18), (3, 22)):  # 12 s in all, never 5 s without a write
        ledger.expire(now)
        assert ledger.record_write("long", [block], 0, 2, now=now) == 5
    ledger.expire(26.9)
    assert ledger.take_actions() == ([], [])
    # a chunk whose forward took 4 s (a busy host): the next may take PACE_FACTOR times that
    assert ledger.record_write("long", [4], 0, 1, now=26, pace_s=4) == PACE_FACTOR * 4
    ledger.expire(26 + PACE_FACTOR * 4 - 0.1)
    assert ledger.take_actions() == ([], [])
    ledger.expire(26 + PACE_FACTOR * 4)
    events, _ = ledger.take_actions()
    assert [e.kind for e in events] == [TransferKind.FAILED]
    assert "made no progress for 12.00 s (7 of 8 block-layers arrived)" in events[0].error


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_transfer_longer_than_its_budget_completes_while_each_chunk_lands_in_time(
    transport, node_id
):
    """Both sides move their deadlines with each acknowledged write: five chunks 0.7 s apart
    (about 3 s in all) complete under a 2 s budget, on the sender's side too."""
    receiver, cache, sender, local = make_pair(transport, node_id)
    try:
        blocks = [3, 4, 5, 6, 7]
        receiver.expect("req-long", blocks, time.monotonic() + 5, budget_s=2.0)
        started = time.monotonic()
        for index, block in enumerate(blocks):
            sender.write("req-long", [index], [block])
            time.sleep(0.7)
        assert time.monotonic() - started > 2.0 + 1.0
        assert sender.wait("req-long", 5).kind is TransferKind.COMPLETE
        assert receiver.wait("req-long", 5).kind is TransferKind.COMPLETE
        assert torch.equal(cache.buffer[:, :, blocks], local.buffer[:, :, : len(blocks)])
    finally:
        close_all(sender, receiver)


def test_a_copy_step_that_raised_is_not_abandoned_its_blocks_wait_for_the_grace(
    node_id, monkeypatch
):
    """A network write that timed out may still be landing: the sender fails the transfer
    without Abandon, so the decode node reuses the blocks only after its deadline + grace."""
    receiver, _, sender, _ = make_pair("shm", node_id, grace=0.3)

    def timed_out(step, ready):
        raise RuntimeError("the write timed out")

    monkeypatch.setattr(sender.transport, "run_step", timed_out)
    try:
        deadline = time.monotonic() + 1.0
        receiver.expect("req-late", [1, 2], deadline)
        sender.write("req-late", [0, 1], [1, 2])
        assert "timed out" in sender.wait("req-late", 3).error
        receiver.abort("req-late")
        assert receiver.wait("req-late", 5).kind is TransferKind.RELEASED
        assert time.monotonic() >= deadline + 0.3
        assert receiver.held_block_count() == 0
    finally:
        close_all(sender, receiver)


def test_decode_abort_of_a_silent_granted_shm_transfer_releases_only_after_the_grace(node_id):
    receiver = ChannelReceiver("shm", ReceiverConfig(node_id, release_grace_s=0.3))
    cache = receiver.allocate_kv_cache(SPEC, 8, CPU)
    descriptor = receiver.register(cache, "fp")
    context = zmq.Context()
    silent_sender = context.socket(zmq.DEALER)
    try:
        silent_sender.connect(descriptor.address)
        receiver.expect("req-1", [4, 5], time.monotonic() + 0.5)
        silent_sender.send(encode_header(Begin("req-1")))
        assert silent_sender.poll(3000)
        assert decode_header(silent_sender.recv()).type == "grant"
        aborted_at = time.monotonic()
        receiver.abort("req-1")
        assert [e.kind for e in receiver.poll()] == [TransferKind.FAILED]
        assert receiver.held_block_count() == 2
        event = receiver.wait("req-1", 3)
        assert event.kind is TransferKind.RELEASED and "aborted by the decode node" in event.error
        assert time.monotonic() - aborted_at >= 0.5 + 0.3 - 0.05
        assert decode_header(silent_sender.recv()).type == "cancel"
    finally:
        silent_sender.close(0)
        context.term()
        receiver.close()


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_decode_abort_cancels_the_sender_and_releases_on_its_abandon(transport, node_id):
    receiver, cache, sender, local = make_pair(transport, node_id, grace=5.0)
    try:
        receiver.expect("req-2", [0, 1, 2, 3], time.monotonic() + 5)
        sender.write("req-2", [0, 1], [0, 1])
        deadline = time.monotonic() + 3
        while receiver.held_block_count() and not torch.equal(cache.buffer[:, :, 1],
                                                                local.buffer[:, :, 1]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        receiver.abort("req-2")
        event = sender.wait("req-2", 3)
        assert event.kind is TransferKind.FAILED and "aborted by the decode node" in event.error
        started = time.monotonic()
        assert receiver.wait("req-2", 3).kind is TransferKind.RELEASED
        assert time.monotonic() - started < 1.0  # the Abandon, not the 5 s grace
        assert receiver.held_block_count() == 0
    finally:
        close_all(sender, receiver)


def test_prefill_abort_fails_both_sides_at_once(node_id):
    receiver, _, sender, _ = make_pair("shm", node_id, grace=5.0)
    try:
        receiver.expect("req-3", [6, 7], time.monotonic() + 5)
        sender.write("req-3", [0], [6])
        sender.abort("req-3")
        assert "aborted by the prefill node" in sender.wait("req-3", 3).error
        event = receiver.wait("req-3", 3)
        assert event.kind is TransferKind.RELEASED and "abandoned" in event.error
    finally:
        close_all(sender, receiver)


def test_writes_outside_the_reservation_or_twice_fail_the_transfer(node_id):
    receiver, _, sender, _ = make_pair("zmq", node_id)
    try:
        with pytest.raises(ValueError, match="outside 0..31"):
            sender.write("req-4", [0], [32])
        with pytest.raises(ValueError, match="twice"):
            sender.write("req-4", [0, 1], [3, 3])
        receiver.expect("req-4", [3, 4], time.monotonic() + 3)
        with pytest.raises(ValueError, match="layer range 2..2"):
            sender.write("req-4", [0], [3], layer_start=2, layer_end=2)
        sender.write("req-4", [0], [3], layer_start=0, layer_end=1)
        sender.write("req-4", [0], [3], layer_start=1)  # its other layers: a write of their own
        sender.write("req-4", [1], [3], layer_start=1, layer_end=2)
        assert "were written already in layers 1..2" in sender.wait("req-4", 3).error
        receiver.expect("req-5", [5], time.monotonic() + 3)
        sender.write("req-5", [0], [6])
        assert "did not reserve" in sender.wait("req-5", 3).error
        sender.write("req-unexpected", [0], [9])
        assert "'req-unexpected' is unknown" in sender.wait("req-unexpected", 3).error
    finally:
        close_all(sender, receiver)


def test_sender_without_a_live_decode_node_fails_after_the_grant_timeout(node_id):
    receiver = ChannelReceiver("zmq", ReceiverConfig(node_id))
    descriptor = receiver.register(receiver.allocate_kv_cache(SPEC, 8, CPU), "fp")
    receiver.close()
    sender = ChannelSender("zmq", SenderConfig(grant_timeout_s=0.3, step_bytes=1 << 16))
    sender.connect(descriptor, KVCache(SPEC, 8, CPU), "fp")
    try:
        started = time.monotonic()
        sender.write("req-6", [0], [0])
        event = sender.wait("req-6", 3)
        assert event.kind is TransferKind.FAILED and "no grant within 0.30 s" in event.error
        assert time.monotonic() - started < 1.0
    finally:
        sender.close()


def test_zmq_in_flight_bytes_never_exceed_the_window(node_id, monkeypatch):
    window, step = 1 << 17, 1 << 16
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float32)  # 64 KiB per block
    receiver, cache, sender, local = make_pair(
        "zmq", node_id, spec=spec, num_blocks=48,
        sender_config=SenderConfig(max_inflight_bytes=window, step_bytes=step),
    )
    peak = []
    original_send = ChannelSender._send

    def recording_send(self, message, frames=()):
        sent = original_send(self, message, frames)
        peak.append(self._in_flight_bytes + (message.nbytes if frames else 0))
        return sent

    monkeypatch.setattr(ChannelSender, "_send", recording_send)
    try:
        dst = list(range(47, -1, -1))
        receiver.expect("req-7", dst, time.monotonic() + 10)
        sender.write("req-7", list(range(48)), dst)
        assert sender.wait("req-7", 10).kind is TransferKind.COMPLETE
        assert receiver.wait("req-7", 10).kind is TransferKind.COMPLETE
        assert torch.equal(cache.buffer[:, :, dst], local.buffer[:, :, :48])
        assert max(peak) <= window and len(peak) > 10
    finally:
        close_all(sender, receiver)


def test_steps_cover_each_block_and_layer_once_within_the_step_size():
    spec = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float32)  # 16 KiB per block-layer
    for max_step in (1 << 14, 3 << 14, 1 << 20):
        for layers in (range(6), range(2, 5)):
            steps = plan_steps(spec, [4, 5, 6, 0], [10, 11, 12, 3], max_step, layers)
            covered = sorted(
                (dst, layer) for s in steps for dst in s.dst_block_ids
                for layer in range(s.layer_start, s.layer_end)
            )
            assert covered == sorted((d, la) for d in (10, 11, 12, 3) for la in layers)
            assert all(s.nbytes <= max(max_step, 1 << 14) for s in steps)


def test_a_stale_segment_of_a_dead_process_is_replaced_and_a_live_ones_is_kept(node_id):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = SharedSegment.create(node_id, 4096)
    stale_path = stale.path
    stale._unlink_at_exit.detach()
    stale.close()
    raw = bytearray(stale_path.read_bytes()[:24])
    raw[8:16] = dead_pid.to_bytes(8, "little")
    with open(stale_path, "r+b") as segment:
        segment.write(raw)
    fresh = SharedSegment.create(node_id, 8192)
    try:
        assert fresh.payload.numel() == 8192
        with open(fresh.path, "r+b") as segment:  # now claim a live owner (our parent)
            segment.seek(8)
            segment.write(os.getppid().to_bytes(8, "little"))
        with pytest.raises(RuntimeError, match="running process"):
            SharedSegment.create(node_id, 4096)
    finally:
        fresh.close()


def test_kv_cache_over_an_external_buffer_shares_its_memory():
    flat = torch.zeros(3 * SPEC.bytes_per_block, dtype=torch.uint8)
    cache = KVCache.over_buffer(SPEC, flat)
    assert cache.num_blocks == 3 and cache.buffer.shape == SPEC.buffer_shape(3)
    cache.key_cache(1)[2].fill_(1.0)
    assert flat.view(torch.float32).sum().item() == 2 * 4 * 8
    shaped = torch.zeros(SPEC.buffer_shape(5))
    assert KVCache.over_buffer(SPEC, shaped).buffer.data_ptr() == shaped.data_ptr()
    with pytest.raises(ValueError, match="whole number"):
        KVCache.over_buffer(SPEC, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dtype"):
        KVCache.over_buffer(SPEC, torch.zeros(SPEC.buffer_shape(2), dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        KVCache.over_buffer(SPEC, torch.zeros(SPEC.buffer_shape(2)).transpose(0, 1))
    assert Path(SHM_DIR).is_dir()
