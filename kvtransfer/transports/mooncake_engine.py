"""The Mooncake Transfer Engine as the mooncake KV transport uses it: loading it (an error that
names what is missing), starting one without a metadata server, registering memory, one batched
write.

`mooncake.engine.TransferEngine` comes from the PyPI package mooncake-transfer-engine-non-cuda
(`pip install 'pdserve[mooncake]'`: Linux x86_64 or aarch64, CPython 3.10-3.13). Its library
links libibverbs even where no RDMA device exists (Debian: `apt-get install libibverbs1`) and
then moves bytes over TCP.

An engine started here uses the peer-to-peer handshake: no metadata server; a peer is named by
its session id, `HOST:RPC_PORT`, and a write to it first fetches the peer's registered buffers
over that RPC port. Each engine listens on two TCP ports (that RPC port and its TCP transport's),
which Mooncake picks at random in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (15000-17000 unless set in
the process's environment before the library loads).

Who can reach them. Mooncake (0.3.13) binds both ports on every interface (INADDR_ANY and a
dual-stack [::]; no setting changes that: MC_TCP_BIND_ADDRESS only names the host in its
metadata) and authenticates neither: its RPC port hands the list of registered buffers to
anyone who asks, and its TCP port serves reads and writes of any range inside them. So each
engine pdserve starts is confined here instead (`confine_to_host`): a classic BPF socket filter
on both listening sockets drops every packet not addressed to the engine's host (the host of
the node's advertised address: 127.0.0.1 by default), which is what binding to that address
would do, and connections accepted before the filter are closed. `ss -ltn` still shows
0.0.0.0/[::]; a stranger's SYN to another address of the machine goes unanswered. And only the
decode node registers memory (its KV buffer, which the prefill node writes into): a sender's
source needs no registration over TCP, so a prefill node's engine serves nothing. What holds,
then: nothing is readable or writable off a node's advertised address, nothing at all on a
prefill node, and the decode node's KV buffer is readable and writable (within its bounds) by
any process that reaches its advertised address (every process of the host on loopback): the
cluster secret cannot cover that; the network around that address must
(docs/operations.md, KV transports).

A write blocks its caller (the GIL released) until the peer acknowledged every byte, or fails
fast when the peer's process is gone (connection refused or reset), or after WRITE_TIMEOUT_S
plus a nanosecond per byte when the peer stopped answering: pdserve sets Mooncake's
MC_TRANSFER_TIMEOUT to WRITE_TIMEOUT_S for every engine it starts, and the decode side's
late-write rule counts on that bound (kvtransfer/strategies.py, DirectWrite.write_timeout_s).
A batch holds at most MAX_SEGMENTS_PER_BATCH segments; a longer write is several batches.
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
from typing import Any

from pdserve.kvtransfer.transports.host_confinement import confine_to_host, listening_ports

PROTOCOL = "tcp"
WRITE_TIMEOUT_S = 5  # Mooncake's minimum for MC_TRANSFER_TIMEOUT
HANDSHAKE = "P2PHANDSHAKE"
PACKAGE = "mooncake-transfer-engine-non-cuda"
# Mooncake's TCP transport queues at most 1,024 requests per peer by default
# (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and fails a larger batch outright.
MAX_SEGMENTS_PER_BATCH = 1024


class MooncakeUnavailable(RuntimeError):
    """The Mooncake package or the system library it links is missing; the message says which
    and how to install it."""


def explain_import_error(error: ImportError) -> str:
    text = str(error)
    if "libibverbs" in text:
        return (
            "the mooncake KV transport needs the system library libibverbs.so.1, which "
            f"Mooncake's engine links even without an RDMA device: install it (Debian/Ubuntu: "
            f"apt-get install -y libibverbs1). Import error: {text}"
        )
    return (
        f"the mooncake KV transport needs the Python package {PACKAGE} (Linux x86_64/aarch64, "
        f"Python 3.10-3.13): pip install 'pdserve[mooncake]'. Import error: {text}"
    )


def import_engine_module() -> Any:
    """`mooncake.engine`. Its library reads MC_LOG_LEVEL and the port range once, when it loads:
    quiet by default (ERROR), as the environment says otherwise."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return importlib.import_module("mooncake.engine")


def mooncake_missing() -> str | None:
    """None when the mooncake transport can run here, else what is missing and how to install
    it (explain_import_error)."""
    try:
        import_engine_module()
    except ImportError as error:
        return explain_import_error(error)
    return None


def transfer_engine_class() -> Any:
    try:
        module = import_engine_module()
    except ImportError as error:
        raise MooncakeUnavailable(explain_import_error(error)) from None
    return module.TransferEngine


def host_of(address: str) -> str:
    """The host of a ZeroMQ address (tcp://HOST:PORT); 127.0.0.1 for ipc:// and inproc://."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return "127.0.0.1"
    return rest.rsplit(";", 1)[-1].rsplit(":", 1)[0].strip("[]")


def local_address_toward(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent); 127.0.0.1 if unknown."""
    try:
        family, kind, _, _, peer = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(peer)
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class MooncakeEngine:
    """One TransferEngine, its ports confined to `host` (confine_to_host), with the memory it
    registered; `close()` waits for a write in progress (at most its timeout), unregisters the
    memory and stops the engine (about a second: Mooncake joins its threads)."""

    def __init__(self, host: str) -> None:
        engine_class = transfer_engine_class()
        os.environ["MC_TRANSFER_TIMEOUT"] = str(WRITE_TIMEOUT_S)  # read by each new engine
        self._engine = engine_class()
        listening_before = listening_ports()
        status = self._engine.initialize(host, HANDSHAKE, PROTOCOL, "")
        if status != 0:
            raise RuntimeError(
                f"Mooncake's transfer engine did not start on {host!r} (status {status}; "
                "its ports come from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)"
            )
        # The RPC port and the TCP transport's: the listeners initialize() opened.
        self.ports = listening_ports() - listening_before
        try:
            if self._engine.get_rpc_port() not in self.ports:
                raise RuntimeError(
                    f"Mooncake's RPC port {self._engine.get_rpc_port()} is not among the ports "
                    f"its engine opened here ({sorted(self.ports)})"
                )
            confine_to_host(self.ports, host)
        except BaseException:
            self._engine = None  # stops it: no port stays open unconfined
            raise
        self.host = host
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()  # a write and close() never overlap

    def register(self, address: int, nbytes: int) -> None:
        status = self._engine.register_memory(address, nbytes)
        if status != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes:,} bytes (status {status})")
        self._registered.append(address)

    def write(
        self, peer_session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> None:
        """Copies lengths[i] bytes from sources[i] here to targets[i] in the peer's registered
        memory, in one batch (one per MAX_SEGMENTS_PER_BATCH segments); RuntimeError when
        Mooncake reports a batch failed."""
        for start in range(0, len(lengths), MAX_SEGMENTS_PER_BATCH):
            end = start + MAX_SEGMENTS_PER_BATCH
            with self._lock:
                if self._engine is None:
                    raise RuntimeError(f"the Mooncake engine writing to {peer_session} is closed")
                status = self._engine.batch_transfer_sync_write(
                    peer_session, sources[start:end], targets[start:end], lengths[start:end]
                )
            if status != 0:
                raise RuntimeError(
                    f"Mooncake write of {sum(lengths[start:end]):,} bytes in "
                    f"{len(lengths[start:end])} segments to {peer_session} failed (status "
                    f"{status}): the decode node's engine is gone, unreachable, or did not "
                    f"answer within {WRITE_TIMEOUT_S} s"
                )

    def close(self) -> None:
        with self._lock:
            if self._engine is None:
                return
            for address in self._registered:
                self._engine.unregister_memory(address)
            self._registered.clear()
            self._engine = None
