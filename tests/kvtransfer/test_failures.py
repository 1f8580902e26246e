"""KV transfer failures across real processes: a killed sender, a killed receiver, and hostile
frames (malformed headers, wrong lengths, out-of-range blocks, a pickle payload)."""

from __future__ import annotations

import hashlib
import pathlib
import pickle
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import zmq

from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.messages import Begin, Data, Written, decode_header, encode_header
from pdserve.kvtransfer.peer import PeerProcess
from tests.kvtransfer.peer_pairs import GRACE_S, SPEC, open_pair, peer_starter, wait_landed

SHM_DIR = Path("/dev/shm")
TRANSPORTS = ("shm", "zmq")
DEADLINE_S = 1.5


def leftover_segments(node_prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"pdserve-kv-{node_prefix}*"))


@pytest.fixture(scope="module")
def node_prefix() -> str:
    return f"f{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-failure-peers")


@pytest.fixture(scope="module")
def survivor(logs):
    """A decode peer that outlives every test of this module (no test kills it)."""
    peer = PeerProcess(logs / "survivor.log")
    yield peer
    peer.stop()


@pytest.fixture
def started_peers(logs, node_prefix, survivor):
    """Starts peers in parallel; stops every one of them and checks /dev/shm afterwards."""
    with peer_starter(logs) as start:
        yield start
    assert leftover_segments(node_prefix) == []


def test_killed_sender_fails_the_transfer_at_its_deadline_and_frees_its_blocks(
    started_peers, survivor, node_prefix
):
    decode = survivor
    (prefill,) = started_peers("prefill")
    dst = [9, 3, 12, 5, 0, 7]
    for transport in TRANSPORTS:
        open_pair(decode, prefill, transport, f"{node_prefix}-ks-{transport}")
        decode.call("expect", name=transport, transfer_id="req-killed", block_ids=dst,
                    deadline_s=DEADLINE_S)
    expected_at = time.monotonic()
    for transport in TRANSPORTS:
        prefill.call("write", name=transport, transfer_id="req-killed", src=[0, 1, 2],
                     dst=dst[:3])
    for transport in TRANSPORTS:  # killed mid-transfer: half of the blocks arrived
        wait_landed(decode, prefill, transport, [0, 1, 2], dst[:3])
    prefill.kill()
    for transport in TRANSPORTS:
        event = decode.call("wait", name=transport, transfer_id="req-killed", wait_s=5)
        elapsed = time.monotonic() - expected_at
        assert event["kind"] == "released"
        assert "'req-killed'" in event["error"] and "deadline" in event["error"]
        assert DEADLINE_S - 0.05 <= elapsed <= DEADLINE_S + GRACE_S + 1.0
        assert decode.call("held", name=transport)["held"] == 0
        # The blocks are free: a new transfer may take them at once.
        decode.call("expect", name=transport, transfer_id="req-next", block_ids=dst,
                    deadline_s=5)
        decode.call("abort", name=transport, transfer_id="req-next")
        assert decode.call("wait", name=transport, transfer_id="req-next", wait_s=2)["kind"] == (
            "released"
        )
        decode.call("close", name=transport)


def test_killed_receiver_fails_the_write_within_its_deadline_and_restart_cleans_its_segment(
    started_peers, survivor, node_prefix
):
    decode, prefill = started_peers("decode", "prefill")
    restarted = survivor
    node_ids = {t: f"{node_prefix}-kr-{t}" for t in TRANSPORTS}
    for transport in TRANSPORTS:
        open_pair(decode, prefill, transport, node_ids[transport])
        decode.call("expect", name=transport, transfer_id="req-orphan", block_ids=[1, 2, 3, 4],
                    deadline_s=DEADLINE_S)
        prefill.call("write", name=transport, transfer_id="req-orphan", src=[5, 6], dst=[1, 2])
    expected_at = time.monotonic()
    for transport in TRANSPORTS:  # killed mid-transfer: the first blocks arrived
        wait_landed(decode, prefill, transport, [5, 6], [1, 2])
    decode.kill()
    assert leftover_segments(node_ids["shm"]) == [f"pdserve-kv-{node_ids['shm']}"]
    for transport in TRANSPORTS:
        prefill.call("write", name=transport, transfer_id="req-orphan", src=[7, 8], dst=[3, 4])
    for transport in TRANSPORTS:
        event = prefill.call("wait", name=transport, transfer_id="req-orphan", wait_s=5)
        assert event["kind"] == "failed"
        assert "'req-orphan'" in event["error"] and "deadline" in event["error"]
    assert time.monotonic() - expected_at <= DEADLINE_S + 0.5
    # A node restarted under the same id replaces the crashed node's stale segment.
    open_pair(restarted, None, "shm", node_ids["shm"])
    restarted.call("close", name="shm")
    assert leftover_segments(node_ids["shm"]) == []


def zeros_hash(num_bytes: int) -> str:
    return hashlib.sha256(bytes(num_bytes)).hexdigest()


class Rogue:
    """A hand-driven DEALER on a decode node's channel."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def reply(self, timeout_s: float = 3.0):
        assert self.socket.poll(int(timeout_s * 1000)), "no reply from the decode node"
        return decode_header(self.socket.recv_multipart()[0])

    def no_reply(self, timeout_s: float = 0.3) -> bool:
        return not self.socket.poll(int(timeout_s * 1000))

    def close(self) -> None:
        self.socket.close()
        self.context.term()


class UnpicklingSideEffect:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_hostile_frames_are_dropped_and_logged_with_the_decode_node_alive(
    survivor, node_prefix, tmp_path
):
    decode = survivor
    block_layer_bytes = 2 * SPEC["num_kv_heads"] * SPEC["block_size"] * SPEC["head_dim"] * 4
    block_bytes = block_layer_bytes * SPEC["num_layers"]
    marker = tmp_path / "unpickled"
    for transport in TRANSPORTS:
        descriptor = KVDescriptor.decode(bytes.fromhex(
            open_pair(decode, None, transport, f"{node_prefix}-hf-{transport}")
        ))
        decode.call("expect", name=transport, transfer_id="victim", block_ids=[1, 2],
                    deadline_s=20)
        rogue = Rogue(descriptor.address)
        try:
            rogue.send(b"\xff\x00 not msgpack")
            rogue.send(msgpack.packb([1, 2, 3]))
            rogue.send(msgpack.packb({"type": "launch", "transfer_id": "victim"}))
            rogue.send(pickle.dumps(UnpicklingSideEffect(marker)))
            rogue.send(msgpack.packb({"type": "begin", "transfer_id": "victim", "extra": 1}))
            assert rogue.no_reply()
            rogue.send(encode_header(Begin("victim")))
            assert rogue.reply().type == "grant"

            def data(block_ids, nbytes=None, dtype="float32", layers=(0, 3), seq=1):
                size = len(block_ids) * (layers[1] - layers[0]) * block_layer_bytes
                return encode_header(Data("victim", seq, block_ids, layers[0], layers[1], dtype,
                                          size if nbytes is None else nbytes))

            hostile = [
                [encode_header(Data("ghost", 1, [1], 0, 3, "float32", block_bytes)),
                 bytes(block_bytes)],
                [data([999]), bytes(block_bytes)],
                [data([5]), bytes(block_bytes)],
                [data([1], nbytes=block_bytes - 4), bytes(block_bytes - 4)],
                [data([1]), bytes(block_bytes - 4)],
                [data([1], dtype="bfloat16"), bytes(block_bytes)],
                [data([1], layers=(2, 5)), bytes(block_bytes)],
                [data([1]), bytes(block_bytes), bytes(4)],
                [data([1]), pickle.dumps(UnpicklingSideEffect(marker))],
                [encode_header(Written("victim", 9, [999], 0, 3))],
            ]
            for frames in hostile:
                rogue.send(*frames)
                reply = rogue.reply()
                assert reply.type == "reject", (frames[0], reply)
            assert decode.alive()
            assert decode.call("hashes", name=transport, block_ids=[1, 2])["hashes"] == (
                [zeros_hash(block_bytes)] * 2
            )
            payload = bytes(range(256)) * (2 * block_bytes // 256)
            if transport == "zmq":
                rogue.send(data([2, 1], seq=7), payload)
            else:  # the shm sender copies first, then reports what landed
                rogue.send(encode_header(Written("victim", 7, [2, 1], 0, 3)))
            assert rogue.reply().type == "ack"
            assert rogue.reply().type == "committed"
            assert decode.call("wait", name=transport, transfer_id="victim", wait_s=3)[
                "kind"] == "complete"
            if transport == "zmq":
                assert decode.call("hashes", name=transport, block_ids=[2])["hashes"] == [
                    hashlib.sha256(payload[:block_bytes]).hexdigest()
                ]
        finally:
            rogue.close()
        decode.call("close", name=transport)
    assert not marker.exists()
    log = decode.stderr_text()
    for expected in ("malformed header", "not msgpack", "no known message type",
                     "'ghost' is unknown", "not destination blocks", "frame has",
                     "dtype 'bfloat16'", "layer range 2..5", "data frames instead of 1"):
        assert expected in log, expected
