"""KV transfer of an fp8 (float8_e4m3fn) cache: the descriptor carries the dtype and a prefill
node whose KV dtype differs from the decode node's is refused at pairing, naming both; the CPU
transports (shm, zmq, inprocess, mooncake) move fp8 blocks byte for byte, into shuffled target
blocks."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer import (
    ChannelReceiver,
    ChannelSender,
    DescriptorMismatch,
    KVDescriptor,
    ReceiverConfig,
    TransferKind,
)
from tests.kvtransfer.test_inprocess import close_all, make_pair
from tests.mooncake_env import require_mooncake

FP8_SPEC = KVCacheSpec(
    num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float8_e4m3fn
)
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "decode_dtype, prefill_dtype",
    [
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
)
def test_a_pair_whose_kv_dtypes_differ_is_refused_naming_both(node_id, decode_dtype, prefill_dtype):
    receiver = ChannelReceiver("zmq", ReceiverConfig(node_id))
    spec = KVCacheSpec(3, 2, 16, 4, decode_dtype)
    descriptor = receiver.register(receiver.allocate_kv_cache(spec, 8, CPU), "model")
    try:
        decoded = KVDescriptor.decode(descriptor.encode())
        assert decoded == descriptor and decoded.spec.dtype == decode_dtype
        other = KVCacheSpec(3, 2, 16, 4, prefill_dtype)
        with pytest.raises(DescriptorMismatch) as raised:
            ChannelSender("zmq").connect(descriptor, KVCache(other, 8, CPU), "model")
        names = {torch.float8_e4m3fn: "'float8_e4m3fn'", torch.bfloat16: "'bfloat16'"}
        message = str(raised.value)
        assert f"dtype is {names[decode_dtype]} on decode node {node_id!r}" in message
        assert f"{names[prefill_dtype]} on this prefill node" in message
        assert "block_size" not in message, "only the dtype differs"
    finally:
        receiver.close()


@pytest.mark.parametrize("transport", ["shm", "zmq", "inprocess", "mooncake"])
def test_cpu_transports_move_fp8_blocks_byte_for_byte(transport, node_id):
    if transport == "mooncake":
        require_mooncake()
    receiver, cache, sender, local = make_pair(transport, node_id, spec=FP8_SPEC, num_blocks=32)
    try:
        assert cache.buffer.dtype == local.buffer.dtype == torch.float8_e4m3fn
        assert FP8_SPEC.bytes_per_block == 2 * 3 * 4 * 2 * 16  # one byte per element
        src, dst = list(range(10)), [31, 3, 4, 5, 20, 19, 18, 7, 0, 1]
        before = cache.buffer.view(torch.uint8).clone()
        receiver.expect("fp8-req", dst, time.monotonic() + 10)
        sender.write("fp8-req", src, dst)
        assert sender.wait("fp8-req", 10).kind is TransferKind.COMPLETE
        assert receiver.wait("fp8-req", 10).kind is TransferKind.COMPLETE
        received = cache.buffer.view(torch.uint8)
        assert torch.equal(received[:, :, dst], local.buffer.view(torch.uint8)[:, :, src])
        untouched = [b for b in range(32) if b not in dst]
        assert torch.equal(received[:, :, untouched], before[:, :, untouched])
    finally:
        close_all(sender, receiver)
