"""Confining a TCP listener this process did not open to one host's addresses, as binding it
there would: for the Mooncake engine (kvtransfer/transports/mooncake_engine.py), which binds
its ports on every interface and offers no setting to do otherwise.

`confine_to_host` finds the listeners among this process's own sockets (/proc/self/fd and
/proc/net/tcp{,6}), attaches a classic BPF socket filter (setsockopt SO_ATTACH_FILTER, which
any process may do to its own sockets; connections a listener accepts inherit it) that drops
every packet not addressed to the host's addresses, and shuts down connections accepted
before, addressed elsewhere. Linux only, as Mooncake is.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

# Classic BPF, as setsockopt(SO_ATTACH_FILTER) takes it (linux/filter.h). A TCP socket's filter
# sees each packet with its IP header at SKF_NET_OFF.
SO_ATTACH_FILTER = 26
SKF_NET_OFF = -0x100000
BPF_LD_B_ABS, BPF_LD_W_ABS, BPF_RSH_K, BPF_JEQ_K, BPF_RET_K = 0x30, 0x20, 0x74, 0x15, 0x06
ACCEPT_PACKET, DROP_PACKET = 0xFFFFFFFF, 0
TCP_LISTEN, TCP_ESTABLISHED = "0A", "01"  # states in /proc/net/tcp

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class TcpSocket:
    """One of this process's TCP sockets, as /proc/net/tcp{,6} lists it."""

    fd: int
    local_address: IPAddress  # an IPv4-mapped IPv6 address as its IPv4 address
    port: int
    state: str


def own_tcp_sockets() -> list[TcpSocket]:
    fd_of_inode = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            fd_of_inode[target[len("socket:[") : -1]] = int(name)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[9] in fd_of_inode:
                    hex_address, hex_port = fields[1].split(":")
                    found.append(
                        TcpSocket(
                            fd_of_inode[fields[9]],
                            proc_net_address(hex_address),
                            int(hex_port, 16),
                            fields[3],
                        )
                    )
    return found


def proc_net_address(hex_address: str) -> IPAddress:
    """An address as /proc/net/tcp writes it: 32-bit words in host byte order (little-endian)."""
    raw = b"".join(
        bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)
    )
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def addresses_of(host: str) -> set[IPAddress]:
    try:
        entries = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as error:
        raise ValueError(
            f"the Mooncake engine's host {host!r} (its node's advertised KV address) does not "
            f"resolve to an IP address here: {error}"
        ) from None
    return {ipaddress.ip_address(entry[4][0].split("%")[0]) for entry in entries}


def destination_filter(addresses: set[IPAddress]) -> bytes:
    """A classic BPF program passing only IPv4 and IPv6 packets addressed to `addresses`."""
    v4 = sorted(a for a in addresses if a.version == 4)
    v6 = sorted(a for a in addresses if a.version == 6)
    program: list[tuple[int, int | str, int | str, int]] = []  # code, jump if true, if false, k

    def load(size_code: int, offset: int) -> None:
        program.append((size_code, 0, 0, (SKF_NET_OFF + offset) & 0xFFFFFFFF))

    load(BPF_LD_B_ABS, 0)
    program.append((BPF_RSH_K, 0, 0, 4))  # the IP version
    program.append((BPF_JEQ_K, "v4", 0, 4))
    program.append((BPF_JEQ_K, "v6", "drop", 6))
    program.append(("v4", 0, 0, 0))
    load(BPF_LD_W_ABS, 16)  # IPv4 destination
    for address in v4:
        program.append((BPF_JEQ_K, "accept", 0, int(address)))
    program.append((BPF_RET_K, 0, 0, DROP_PACKET))
    program.append(("v6", 0, 0, 0))
    for index, address in enumerate(v6):
        words = struct.unpack("!4I", address.packed)
        for word_index, word in enumerate(words):
            load(BPF_LD_W_ABS, 24 + 4 * word_index)  # IPv6 destination
            last = word_index == len(words) - 1
            program.append((BPF_JEQ_K, "accept" if last else 0, f"v6-{index + 1}", word))
        program.append((f"v6-{index + 1}", 0, 0, 0))
    program.append(("drop", 0, 0, 0))
    program.append((BPF_RET_K, 0, 0, DROP_PACKET))
    program.append(("accept", 0, 0, 0))
    program.append((BPF_RET_K, 0, 0, ACCEPT_PACKET))

    labels: dict[str, int] = {}
    instructions = []
    for code, if_true, if_false, k in program:
        if isinstance(code, str):
            labels[code] = len(instructions)
        else:
            instructions.append((code, if_true, if_false, k))
    encoded = b""
    for index, (code, if_true, if_false, k) in enumerate(instructions):
        jumps = [labels[j] - index - 1 if isinstance(j, str) else j for j in (if_true, if_false)]
        encoded += struct.pack("HBBI", code, *jumps, k)
    return encoded


def confine_to_host(ports: set[int], host: str) -> None:
    """Makes this process's TCP listeners on `ports` behave as if bound to `host` alone: a
    socket filter drops packets addressed elsewhere (accepted connections inherit it), and
    connections they accepted before, addressed elsewhere, are shut down. Nothing changes
    for a wildcard host (0.0.0.0, ::)."""
    allowed = addresses_of(host)
    if any(address.is_unspecified for address in allowed):
        return
    program = destination_filter(allowed)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(buffer))
    sockets = [s for s in own_tcp_sockets() if s.port in ports]
    listeners = [s for s in sockets if s.state == TCP_LISTEN]
    if {s.port for s in listeners} != ports:
        raise RuntimeError(
            f"Mooncake's ports {sorted(ports)} are not all listening in this process "
            f"(found {sorted(s.port for s in listeners)})"
        )
    for listener in listeners:
        with socket.socket(fileno=os.dup(listener.fd)) as shared:
            shared.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    for connection in sockets:
        if connection.state == TCP_ESTABLISHED and connection.local_address not in allowed:
            with socket.socket(fileno=os.dup(connection.fd)) as shared:
                shared.shutdown(socket.SHUT_RDWR)


def listening_ports() -> set[int]:
    return {s.port for s in own_tcp_sockets() if s.state == TCP_LISTEN}
