"""The tensor-parallel group's TCP store listens on loopback alone: read off the kernel's own
table of listening sockets (Linux), every socket on the store's port is bound to 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.engine.distributed.group import connect_store, open_store

LISTEN = "0A"  # the TCP state in /proc/net/tcp{,6}
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1, as hex


def listening_addresses(port: int) -> list[str]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_the_rank_store_listens_on_loopback_alone():
    store = open_store(2, timeout_s=30)
    addresses = listening_addresses(store.port)
    assert addresses and set(addresses) <= LOOPBACK, addresses
    peer = connect_store(store.port, 2, timeout_s=30)  # and it still serves its ranks
    peer.set("rank-1", "joined")
    assert store.get("rank-1") == b"joined"
