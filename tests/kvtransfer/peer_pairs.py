"""Peer processes for the cross-process KV transfer tests: start several at once, stop them
all, open a receiver/sender pair on them, and wait for written blocks to land."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.kvtransfer.peer import PeerProcess
from tests.fault_checks import wait_until

SPEC = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
NUM_BLOCKS = 16
GRACE_S = 0.2


@contextmanager
def peer_starter(log_dir: Path) -> Iterator[Callable[..., list[PeerProcess]]]:
    """Yields `start(*names)`, which starts one peer per name in parallel and returns them once
    all are up; every peer started is stopped on exit."""
    started: list[PeerProcess] = []

    def start(*names: str) -> list[PeerProcess]:
        peers = [PeerProcess(log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log") for name in names]
        started.extend(peers)
        for peer in peers:
            peer.wait_started()
        return peers

    try:
        yield start
    finally:
        for peer in started:
            peer.stop()


def open_pair(
    decode: PeerProcess, prefill: PeerProcess | None, transport: str, node_id: str, seed: int = 1
) -> dict:
    """Opens a receiver named `transport` on `decode` and, if given, a sender on `prefill`
    connected to it; returns the receiver's descriptor."""
    descriptor = decode.call(
        "open_receiver", name=transport, transport=transport, node_id=node_id,
        spec=SPEC, num_blocks=NUM_BLOCKS, grace=GRACE_S,
    )["descriptor"]
    if prefill is not None:
        prefill.call(
            "open_sender", name=transport, transport=transport, descriptor=descriptor,
            seed=seed, num_blocks=NUM_BLOCKS,
        )
    return descriptor


def wait_landed(
    decode: PeerProcess, prefill: PeerProcess, transport: str, src: list[int], dst: list[int]
) -> None:
    """Waits until the receiver's `dst` blocks hold the bytes the sender wrote from `src`."""
    sent = prefill.call("hashes", name=transport, block_ids=src)["hashes"]
    wait_until(
        lambda: decode.call("hashes", name=transport, block_ids=dst)["hashes"] == sent,
        20,
        f"the {transport} write of blocks {src} -> {dst} landing",
    )
