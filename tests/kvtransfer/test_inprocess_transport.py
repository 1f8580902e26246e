"""The inprocess transport (the instant-transfer test double) drives the real channel in one
process: a ChannelSender / ChannelReceiver pair moves every byte of every layer into the right
blocks, both sides report the outcome, and every block of every transfer comes back."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest
import torch

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer import (
    ChannelReceiver,
    ChannelSender,
    ReceiverConfig,
    SenderConfig,
    TransferKind,
)
from pdserve.kvtransfer.strategies import DirectWrite
from pdserve.kvtransfer.transports.registry import receiver_transport, sender_transport

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
CPU = torch.device("cpu")
NUM_BLOCKS = 16


@pytest.fixture
def pair(tmp_path):
    """(receiver, its cache, sender, its cache filled with random values), over an ipc socket."""
    config = ReceiverConfig(
        f"ip{uuid.uuid4().hex[:8]}", bind_address=f"ipc://{tmp_path}/kv", release_grace_s=0.2
    )
    receiver = ChannelReceiver("inprocess", config)
    cache = receiver.allocate_kv_cache(SPEC, NUM_BLOCKS, CPU)
    descriptor = receiver.register(cache, "fp")
    local = KVCache(SPEC, NUM_BLOCKS, CPU)
    local.buffer.copy_(torch.randn(local.buffer.shape))
    sender = ChannelSender("inprocess", SenderConfig(step_bytes=1 << 16))
    sender.connect(descriptor, local, "fp")
    yield receiver, cache, sender, local
    sender.close()
    receiver.close()
    assert receiver.held_block_count() == 0


def test_the_test_double_is_a_direct_write_transport_of_both_halves():
    assert receiver_transport("inprocess", "n").strategy == DirectWrite()
    assert sender_transport("inprocess", 1 << 16).strategy == DirectWrite()


def test_chunked_writes_land_every_layer_of_every_block_and_both_sides_complete(pair):
    receiver, cache, sender, local = pair
    dst = [9, 3, 4, 5, 12]
    receiver.expect("req-1", dst, time.monotonic() + 5)
    sender.write("req-1", [0, 1], dst[:2])  # one prefill chunk, then the rest
    sender.write("req-1", [2, 3, 7], dst[2:])

    assert sender.wait("req-1", 5).kind is TransferKind.COMPLETE
    event = receiver.wait("req-1", 5)
    assert event.kind is TransferKind.COMPLETE and sorted(event.block_ids) == sorted(dst)
    assert torch.equal(cache.buffer[:, :, dst], local.buffer[:, :, [0, 1, 2, 3, 7]])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    assert not cache.buffer[:, :, untouched].any()
    assert receiver.held_block_count() == 0


def test_transfers_one_after_another_reuse_the_returned_blocks(pair):
    receiver, cache, sender, local = pair
    for round_number in range(3):
        transfer_id = f"req-{round_number}"
        src = [round_number * 4 + i for i in range(4)]
        receiver.expect(transfer_id, [0, 1, 2, 3], time.monotonic() + 5)
        sender.write(transfer_id, src, [0, 1, 2, 3])
        assert receiver.wait(transfer_id, 5).kind is TransferKind.COMPLETE
        assert sender.wait(transfer_id, 5).kind is TransferKind.COMPLETE
        assert torch.equal(cache.buffer[:, :, :4], local.buffer[:, :, src])
        assert receiver.held_block_count() == 0


def test_an_aborted_transfer_returns_its_blocks_on_the_senders_abandon(pair):
    receiver, _, sender, _ = pair
    receiver.expect("req-a", [6, 7], time.monotonic() + 5)
    sender.write("req-a", [0], [6])
    sender.abort("req-a")
    assert "aborted by the prefill node" in sender.wait("req-a", 5).error
    event = receiver.wait("req-a", 5)
    assert event.kind is TransferKind.RELEASED and event.block_ids == (6, 7)
    assert receiver.held_block_count() == 0


def test_a_descriptor_from_another_process_is_refused_at_connect(pair):
    descriptor = pair[0].descriptor
    other_pid = descriptor.handle["pid"] + 1
    elsewhere = replace(descriptor, handle={**descriptor.handle, "pid": other_pid})
    sender = ChannelSender("inprocess")
    try:
        with pytest.raises(ValueError, match="within one process"):
            sender.connect(elsewhere, KVCache(SPEC, 4, CPU), "fp")
    finally:
        sender.close()
