"""Transport names -> the receiver and sender halves that implement them.

`TRANSPORTS` maps each name to its two factories; `TRANSPORT_NAMES` lists the transports a
serving node may use. `inprocess` is registered too, as the test double (both halves in one
process), but is no serving transport; no command line offers it. `mooncake` is registered
whether or not its package is installed (kvtransfer/transports/mooncake_engine.py): building
either half without it fails with what to install.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdserve.kvtransfer.transports.base import ReceiverTransport, SenderTransport
from pdserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiverTransport, CudaIpcSenderTransport
from pdserve.kvtransfer.transports.inprocess import (
    InProcessReceiverTransport,
    InProcessSenderTransport,
)
from pdserve.kvtransfer.transports.mooncake import (
    MooncakeReceiverTransport,
    MooncakeSenderTransport,
)
from pdserve.kvtransfer.transports.shm import ShmReceiverTransport, ShmSenderTransport
from pdserve.kvtransfer.transports.zmq_tcp import ZmqReceiverTransport, ZmqSenderTransport


@dataclass(frozen=True)
class TransportEntry:
    """`receiver(node_id)` and `sender(staging_bytes)` build the two halves; `serving` is False
    for a transport that works only within one process."""

    receiver: Callable[[str], ReceiverTransport]
    sender: Callable[[int], SenderTransport]
    serving: bool = True


TRANSPORTS: Mapping[str, TransportEntry] = MappingProxyType({
    "shm": TransportEntry(ShmReceiverTransport, lambda staging_bytes: ShmSenderTransport()),
    "cuda_ipc": TransportEntry(
        CudaIpcReceiverTransport, lambda staging_bytes: CudaIpcSenderTransport()
    ),
    "zmq": TransportEntry(ZmqReceiverTransport, ZmqSenderTransport),
    "mooncake": TransportEntry(
        MooncakeReceiverTransport, lambda staging_bytes: MooncakeSenderTransport()
    ),
    "inprocess": TransportEntry(
        InProcessReceiverTransport, lambda staging_bytes: InProcessSenderTransport(),
        serving=False,
    ),
})
TRANSPORT_NAMES = tuple(name for name, entry in TRANSPORTS.items() if entry.serving)


def _entry(name: str) -> TransportEntry:
    entry = TRANSPORTS.get(name)
    if entry is None:
        raise ValueError(f"unknown KV transport {name!r}; valid transports: {list(TRANSPORTS)}")
    return entry


def receiver_transport(name: str, node_id: str) -> ReceiverTransport:
    return _entry(name).receiver(node_id)


def sender_transport(name: str, staging_bytes: int) -> SenderTransport:
    return _entry(name).sender(staging_bytes)
