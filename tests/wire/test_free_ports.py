"""Ports chosen for processes started later lie below the kernel's ephemeral range, where no
outgoing connection can take them first."""

from __future__ import annotations

import socket

from pdserve.wire.free_ports import LOWEST_PORT, ephemeral_low, free_port


def test_a_chosen_port_lies_below_the_ephemeral_range_and_binds(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("32768\t60999\n")
    ports = {free_port(range_file=range_file) for _ in range(20)}
    assert all(LOWEST_PORT <= port < 32768 for port in ports)
    assert len(ports) > 1  # picked at random, not the first free one every time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_outgoing_connections_never_take_a_chosen_port():
    """Many connections made while the chosen port stays unbound: none of their local ports is
    the chosen one, as none can be (the kernel draws them from its ephemeral range)."""
    port = free_port()
    with socket.create_server(("127.0.0.1", 0)) as server:
        target = server.getsockname()
        local_ports = set()
        for _ in range(200):
            with socket.create_connection(target) as client:
                local_ports.add(client.getsockname()[1])
                server.accept()[0].close()
    assert port < ephemeral_low() <= min(local_ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_no_room_below_the_range_falls_back_to_a_port_the_kernel_picks(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("1024 65535\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port(range_file=range_file)))


def test_an_unreadable_range_is_taken_as_the_iana_one(tmp_path):
    assert ephemeral_low(tmp_path / "missing") == 49152
    assert free_port(range_file=tmp_path / "missing") < 49152
