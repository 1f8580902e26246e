"""A free TCP port that a process started later can still bind.

A port found by binding to port 0 comes from the kernel's ephemeral range, the same range the
kernel draws from for every outgoing connection. Between choosing such a port and its owner
binding it (a process start, a model load) another connection on the host may take it as its
local port: a node reconnecting to a router not yet listening tries a new ephemeral port on
every attempt. A port below the ephemeral range is never handed out by the kernel, so only a
program that names it explicitly can take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_LOW = 49152  # where no range file says otherwise (macOS, BSDs)
LOWEST_PORT = 10000  # below: ports that well-known services take by name
TRIES = 200


def ephemeral_low(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port the kernel hands out on its own."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return IANA_EPHEMERAL_LOW


def can_bind(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A port no socket on `host` holds, below the ephemeral range and picked at random, so
    that processes choosing at once rarely meet; a kernel-chosen one where the ephemeral range
    leaves no room below it, or where every try was taken."""
    high = ephemeral_low(range_file)
    if high - LOWEST_PORT >= TRIES:
        for port in random.SystemRandom().sample(range(LOWEST_PORT, high), TRIES):
            if can_bind(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
