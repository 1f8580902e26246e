"""A node may bind port 0 (`--listen tcp://HOST:0`): it advertises the port the OS chose, and an
explicit `--advertise` address keeps its own port."""

from __future__ import annotations

from pdserve.node.runtime import with_chosen_port


def test_port_0_becomes_the_bound_port_and_other_addresses_stay():
    bound = "tcp://127.0.0.1:41234"
    assert with_chosen_port("tcp://127.0.0.1:0", bound) == bound
    assert with_chosen_port("tcp://10.0.0.5:0", "tcp://0.0.0.0:41234") == "tcp://10.0.0.5:41234"
    assert with_chosen_port("tcp://node.example:7000", bound) == "tcp://node.example:7000"
    assert with_chosen_port("tcp://127.0.0.1:10", bound) == "tcp://127.0.0.1:10"
    assert with_chosen_port("ipc:///tmp/node-0", "ipc:///tmp/node-0") == "ipc:///tmp/node-0"
